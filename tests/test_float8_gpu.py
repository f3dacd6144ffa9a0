"""Float8 training on a GPU with float8 tensor cores (compute capability 8.9+): fits through ``LMModule`` with each
option float8 must compose with, the inspector's replay against the real float8 GEMM, and the broken-scale warning.

Each fit is a few steps of a 4-layer small-width model whose layers all convert (``float8_min_features: 256``);
the losses are compared with the same fit in bf16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from tb import scalars

from lmtrain.analysis import float8 as f8
from lmtrain.callbacks import PrecisionInspector
from lmtrain.data import LMDataModule
from lmtrain.float8 import float8_linears, gemm_specs
from lmtrain.module import LMModule

pytestmark = pytest.mark.gpu
pytest.importorskip("torchao.float8")

MODEL = dict(size="small", num_layers=4, vocab_size=1024, context_length=256, warmup_steps=2, lr=1e-3)
FLOAT8 = dict(float8="tensorwise", float8_min_features=256)


def _capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_float8 = pytest.mark.skipif(not _capable(), reason="needs compute capability 8.9+")


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.values.append(float(loss))


def _fit(steps: int = 8, callbacks: list[pl.Callback] | None = None, logdir: Path | None = None,
         **options: Any) -> tuple[LMModule, list[float]]:
    pl.seed_everything(0)
    module = LMModule(**{**MODEL, **options})
    losses = Losses()
    data = LMDataModule(source="synthetic", batch_size=4, context_length=256, vocab_size=1024, train_batches=40,
                        val_batches=1)
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=steps,
                         logger=TensorBoardLogger(str(logdir), name="f8") if logdir else False,
                         callbacks=[losses, *(callbacks or [])], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0)
    trainer.fit(module, data)
    return module, losses.values


@needs_float8
@pytest.mark.parametrize("options", [
    dict(float8="tensorwise"),
    dict(float8="rowwise"),
    dict(float8="tensorwise", compile=True),
    dict(float8="rowwise", compile=True),
    dict(float8="tensorwise", compile=True, cuda_graphs=True, master_weights=True, optimizer_state_dtype="bfloat16"),
    dict(float8="tensorwise", compile=True, activation_checkpointing="full"),
    dict(float8="tensorwise", compile=True, activation_checkpointing="selective"),
    dict(float8="tensorwise", optimizer_in_backward=True),
], ids=["tw", "rw", "tw-compile", "rw-compile", "fp8-config", "tw-ac-full", "tw-ac-selective", "tw-in-backward"])
def test_float8_fits_track_the_bf16_losses(options: dict) -> None:
    bf16 = {k: v for k, v in options.items() if not k.startswith("float8")}
    _, reference = _fit(**bf16)
    module, losses = _fit(**{**FLOAT8, **options})
    assert len(float8_linears(module)) == MODEL["num_layers"] * 5
    assert all(torch.isfinite(torch.tensor(losses)))
    # float8 moves each loss by well under 1% over a few steps at these widths
    for a, b in zip(losses, reference, strict=True):
        assert abs(a - b) / b < 0.01, (losses, reference)


@needs_float8
def test_the_replay_matches_the_real_float8_gemm() -> None:
    module, _ = _fit(steps=1, **FLOAT8)
    module.cuda()  # Lightning moves the module back to the CPU when fit ends
    layer = float8_linears(module)["model.blocks.0.mlp.w1"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1024, layer.in_features, device="cuda", generator=gen, dtype=torch.bfloat16)
    with torch.no_grad():
        real = layer(x).float()
        bf16 = F.linear(x, layer.weight.bfloat16()).float()
    real_err = (torch.linalg.vector_norm(real - bf16) / torch.linalg.vector_norm(bf16)).item()
    specs = gemm_specs(layer.config)["output"]
    replay = f8.to_gemm_stats(f8.gemm(x, layer.weight.detach().bfloat16().t(), *specs)).rel_err
    # the real GEMM rounds its output to bf16 (about 2**-9) on top of the float8 error the replay computes
    assert abs(real_err - replay) < 0.2 * replay + 2**-8, (real_err, replay)


@needs_float8
def test_a_broken_scale_is_flagged_on_the_gpu(tmp_path: Path) -> None:
    broken = "model.blocks.1.attn.out"
    inspector = PrecisionInspector(step=2, float8_scale_factors={broken: 2**10}, reference=False)
    with pytest.warns(UserWarning, match=r"float8 layer\(s\) model\.blocks\.1\.attn\.out have more than"):
        _fit(steps=3, callbacks=[inspector], logdir=tmp_path, **FLOAT8, compile=True)
    saturated = {s.layer: s.worst()[0] for s in inspector.float8_result}  # dynamic scales saturate nothing
    assert saturated[broken] > 0.5 and max(v for k, v in saturated.items() if k != broken) == 0.0
    logged = scalars(next(tmp_path.rglob("version_*")))
    assert logged["precision/float8_flagged_layers"][0][0] == 2 and logged["precision/float8_flagged_layers"][0][1] >= 1
