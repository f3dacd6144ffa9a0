"""A normal run says nothing false or irrelevant: no product tips, no deprecations from Lightning's own code, no
warning that a checkpoint's betas list "replaces" the same betas as a tuple."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities import rank_zero_info

from lmtrain.checkpoints import check_checkpoint_model
from lmtrain.cli_config import lightning_notices_off


def test_tips_and_leafspec_deprecation_are_dropped_only_inside(caplog: pytest.LogCaptureFixture) -> None:
    from torch.utils._pytree import LeafSpec

    caplog.set_level(logging.INFO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with lightning_notices_off():
            rank_zero_info("💡 Tip: install something.")
            rank_zero_info("a real message")
            LeafSpec()
    assert [r.getMessage() for r in caplog.records] == ["a real message"]
    assert not [w for w in caught if "LeafSpec" in str(w.message)]
    caplog.clear()
    rank_zero_info("💡 Tip: install something.")  # outside: Lightning's behaviour is untouched
    assert [r.getMessage() for r in caplog.records] == ["💡 Tip: install something."]


@pytest.mark.parametrize(("saved", "requested"), [((0.9, 0.95), [0.9, 0.95]), ([0.9, 0.95], (0.9, 0.95))])
def test_betas_as_list_or_tuple_are_the_same(saved: object, requested: object, tmp_path: Path) -> None:
    hparams = {"size": "tiny", "vocab_size": 64, "context_length": 16, "betas": saved, "lr": 0.003}
    path = tmp_path / "last.ckpt"
    torch.save({"hyper_parameters": hparams, "global_step": 1}, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_checkpoint_model(path, {**hparams, "betas": requested})
    assert not [w for w in caught if "replace" in str(w.message)]
    with pytest.warns(UserWarning, match=r"lr=0.003 \(requested 0.001\)"):  # a real difference is still reported
        check_checkpoint_model(path, {**hparams, "betas": requested, "lr": 0.001})


def test_model_summary_gives_the_step_flops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """The command line's model summary says the model FLOPs of one step (lmtrain.flops), not Lightning's 0, and
    Lightning's note that it replaces the default summary is not shown."""
    from lmtrain.cli_config import run_lightning
    from lmtrain.config import ModelConfig
    from lmtrain.flops import flops_per_step

    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO)
    status = run_lightning(["fit", "--config", str(Path(__file__).parents[1] / "configs" / "tiny.yaml"),
                            "--trainer.max_steps", "1", "--data.max_bytes", "60000", "--data.batch_size", "2",
                            "--model.context_length", "32", "--trainer.enable_progress_bar", "false"])
    assert status == 0
    text = "\n".join(r.getMessage() for r in caplog.records)
    flops = flops_per_step(ModelConfig.from_size("tiny", vocab_size=256, context_length=32), 2, 32)
    (line,) = [ln for ln in text.splitlines() if ln.endswith("Total Flops")]
    from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

    assert flops > 0 and line.split("Total Flops")[0].strip() == get_human_readable_count(int(flops))
    assert "Trainer already configured with model summary" not in text
