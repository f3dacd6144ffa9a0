"""GenerateSamples: text samples logged to TensorBoard every N steps, training left as it was."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tb import texts

from lmtrain.callbacks import GenerateSamples
from lmtrain.data import LMDataModule
from lmtrain.errors import LmtrainError
from lmtrain.module import LMModule

TINY = {"size": "tiny", "vocab_size": 256, "context_length": 16, "d_model": 32, "num_layers": 1, "num_heads": 2,
        "d_ff": 64, "warmup_steps": 1}


class ModeRecorder(pl.Callback):
    """Whether the module was in train mode at the start of each training batch."""

    def __init__(self) -> None:
        self.modes: list[bool] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.modes.append(pl_module.training)


def fit(tmp_path: Path, callbacks: list[pl.Callback], source: str = "text", steps: int = 4,
        vocab_size: int = 256) -> LMModule:
    tmp_path.mkdir(parents=True, exist_ok=True)
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 40)
    torch.manual_seed(0)
    module = LMModule(**{**TINY, "vocab_size": vocab_size})
    data = LMDataModule(source=source, path=str(text) if source == "text" else None, batch_size=2,
                        train_batches=20, val_batches=1)
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=TensorBoardLogger(tmp_path, name="tb"),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=callbacks, default_root_dir=tmp_path)
    trainer.fit(module, data)
    return module


def test_samples_logged_every_n_steps(tmp_path: Path) -> None:
    modes = ModeRecorder()
    fit(tmp_path, [GenerateSamples(every_n_steps=2, prompts=["def ", "x"], max_new_tokens=6, temperature=0.0),
                   modes])
    logged = texts(tmp_path / "tb")
    assert sorted(logged) == ["samples/0", "samples/1"]
    assert len(logged["samples/0"]) == 2 and len(logged["samples/1"]) == 2  # steps 2 and 4
    assert all(t.startswith("```\ndef ") and t.endswith("\n```") for t in logged["samples/0"])
    assert all(t.startswith("```\nx") for t in logged["samples/1"])
    assert modes.modes == [True] * 4  # train mode restored after each sampling step


def test_byte_data_with_a_larger_model_vocabulary(tmp_path: Path) -> None:
    """Text data (256 byte ids) and a model vocabulary of 10,000, as the configs have: an untrained model gives the
    ids above 255 most of the probability, and none is drawn (one would stop training: bytes() of an id >= 256)."""
    fit(tmp_path, [GenerateSamples(every_n_steps=2, prompts=["def ", ""], max_new_tokens=16, temperature=1.0)],
        vocab_size=10_000)
    logged = texts(tmp_path / "tb")
    assert len(logged["samples/0"]) == 2 and all(t.startswith("```\ndef ") for t in logged["samples/0"])
    assert all(t.startswith("```\n\n") for t in logged["samples/1"])  # the empty prompt starts from a newline


def test_sampling_leaves_training_unchanged(tmp_path: Path) -> None:
    plain = fit(tmp_path / "a", [])
    sampled = fit(tmp_path / "b", [GenerateSamples(every_n_steps=1, prompts=["a"], max_new_tokens=3)])
    for (name, p), q in zip(plain.state_dict().items(), sampled.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_no_tokenizer_warns_and_logs_nothing(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="no tokenizer"):
        fit(tmp_path, [GenerateSamples(every_n_steps=1, prompts=["a"], max_new_tokens=2)], source="synthetic",
            steps=2)
    assert texts(tmp_path / "tb") == {}


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"every_n_steps": 0}, "callbacks.GenerateSamples.every_n_steps"),
    ({"temperature": -1.0}, "callbacks.GenerateSamples.temperature"),
    ({"top_p": 0.0}, "callbacks.GenerateSamples.top_p"),
    ({"max_new_tokens": 0}, "callbacks.GenerateSamples.max_new_tokens"),
    ({"prompts": "def "}, "callbacks.GenerateSamples.prompts"),
    ({"prompts": []}, "callbacks.GenerateSamples.prompts"),
])
def test_setup_validates(kwargs: dict[str, Any], field: str) -> None:
    callback = GenerateSamples(**kwargs)  # __init__ only stores
    with pytest.raises(LmtrainError, match=f"^{field}: "):
        callback.setup(None, LMModule(**TINY), "fit")  # type: ignore[arg-type]
