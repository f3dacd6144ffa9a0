"""All five callbacks at their defaults on every training path lmtrain ships, one tiny CPU fit per path.

Eager, compiled, CUDA graphs (``EmulatedStepGraph``, the CPU stand-in), master weights, compact optimizer state,
optimizer-in-backward and activation checkpointing: each callback's tags are in the TensorBoard files, or the one
line the callback says at setup about what it cannot report here (MemorySnapshot needs CUDA). DDP and FSDP2 on two
gloo processes are in ``tests/test_callbacks_ranks.py``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from tb import scalars, texts

from lmtrain.annotate import active_requests
from lmtrain.callbacks import CudaSyncTimer, KernelShare, MemorySnapshot, NVTXRanges, PrecisionInspector
from lmtrain.data import LMDataModule
from lmtrain.graphs import EmulatedStepGraph
from lmtrain.module import LMModule

TINY = dict(size="tiny", vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64,
            warmup_steps=1)
#: Steps of each fit: KernelShare's default window is steps 5..7 and the timer's warm-up 0..4, so steps 8 and 9 are
#: the timer's summary.
STEPS = 10
#: What each callback logs on a CPU at its defaults.
TAGS = {"CudaSyncTimer": ("time/step_ms", "time/forward_ms", "time/summary", "throughput/tokens_per_s"),
        "KernelShare": ("kernels/total_ms_per_step", "kernels/report", "breakdown/compute_share",
                        "launch/kernels_per_step", "kernels/step_comparison", "kernels/timer_step_ms"),
        "PrecisionInspector": ("precision/logits_rel_err", "precision/report")}


class Emulated(LMModule):
    graph_class = EmulatedStepGraph


def _fit(tmp_path: Path, module: LMModule, precision: str = "32-true") -> tuple[pl.Trainer, list, list[str]]:
    five = [CudaSyncTimer(print_summary=False), NVTXRanges(), MemorySnapshot(), KernelShare(chart=False),
            PrecisionInspector()]
    data = LMDataModule(source="synthetic", batch_size=2, context_length=16, vocab_size=64, train_batches=40,
                        val_batches=1)
    trainer = pl.Trainer(max_steps=STEPS, precision=precision, accelerator="cpu", devices=1,
                         logger=TensorBoardLogger(str(tmp_path), name="path"), callbacks=five,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data)
    return trainer, five, [str(w.message) for w in caught]


def _check(trainer: pl.Trainer, five: list, said: list[str], bf16_storage: bool = False) -> None:
    text = texts(trainer.log_dir)
    tags = set(scalars(trainer.log_dir)) | set(text)
    for name, expected in TAGS.items():
        if bf16_storage and name == "PrecisionInspector":
            # bf16 weights have no fp32 reference forward: its report says so instead of logits_rel_err
            expected = ("precision/report",)
            assert "no fp32 reference: parameters are stored in" in text["precision/report"][0]
        assert set(expected) <= tags, (name, sorted(set(expected) - tags))
    # MemorySnapshot cannot measure on a CPU: one line says so, and it logs nothing
    assert sum("need a CUDA device" in line for line in said) == 1
    assert not [t for t in tags if t.startswith("memory/")]
    timer, kernels = five[0], five[3]
    assert timer.summary()["step_ms"]["count"] >= 2
    assert kernels.comparison["kernels/timer_step_ms"] == pytest.approx(timer.summary()["step_ms"]["median"])
    assert active_requests() == (0, 0)  # NVTXRanges and KernelShare left no ranges on


PATHS: dict[str, tuple[dict[str, Any], str]] = {
    "eager": ({}, "32-true"),
    "cuda-graphs": ({"cuda_graphs": True, "cuda_graph_warmup": 3}, "32-true"),
    "master-weights": ({"master_weights": True}, "bf16-mixed"),
    "compact-state": ({"master_weights": True, "optimizer_state_dtype": "bfloat16"}, "bf16-mixed"),
    "in-backward": ({"optimizer_in_backward": True}, "32-true"),
    "checkpointing": ({"activation_checkpointing": "full"}, "32-true"),
    "compiled": ({"compile": True}, "32-true"),
}


@pytest.mark.parametrize("path", [
    pytest.param(name, marks=[] if name == "cuda-graphs" else [pytest.mark.slow]) for name in PATHS])
def test_all_five_at_their_defaults_on_every_path(tmp_path: Path, path: str) -> None:
    options, precision = PATHS[path]
    pl.seed_everything(0)
    module = (Emulated if options.get("cuda_graphs") else LMModule)(**TINY, **options)
    trainer, five, said = _fit(tmp_path, module, precision)
    _check(trainer, five, said, bf16_storage=bool(options.get("master_weights")))
    if options.get("cuda_graphs"):
        # replayed steps keep their phases (marks inside the step); KernelShare says its window is one phase
        steps = {row["step"]: row for row in five[0].step_times}
        assert "forward_ms" in steps[STEPS - 1] and "optimizer_ms" in steps[STEPS - 1]
        assert "kernels/cuda_graph_ms_per_step" in scalars(trainer.log_dir)
