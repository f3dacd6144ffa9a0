"""All five callbacks on one CPU Trainer.fit, their windows one after another, TensorBoard files read back."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from tb import images, scalars, texts

from lmtrain.annotate import active_requests
from lmtrain.bench.callbacks import CALLBACKS, window_plan
from lmtrain.callbacks import CudaSyncTimer, KernelShare, MemorySnapshot, NVTXRanges, PrecisionInspector
from lmtrain.data import LMDataModule
from lmtrain.module import LMModule


def _hooks(module: LMModule) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in module.modules())


def test_all_five_callbacks_in_one_fit(tmp_path: Path) -> None:
    start = window_plan(list(CALLBACKS), 2)  # KernelShare 2..4, PrecisionInspector 5, MemorySnapshot 6, NVTX 7..9
    callbacks = [
        CudaSyncTimer(warmup_steps=2, print_summary=False),
        NVTXRanges(depth="op", start_step=start["NVTXRanges"], num_steps=3),
        MemorySnapshot(start_step=start["MemorySnapshot"], num_steps=1),
        KernelShare(wait=start["KernelShare"] - 1, warmup=1, active=3),
        PrecisionInspector(step=start["PrecisionInspector"]),
    ]
    pl.seed_everything(0)
    module = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                      attention="naive", warmup_steps=1)
    data = LMDataModule(source="synthetic", batch_size=2, context_length=16, vocab_size=64, train_batches=20,
                        val_batches=1)
    trainer = pl.Trainer(max_steps=12, precision="32-true", accelerator="cpu", devices=1,
                         logger=TensorBoardLogger(str(tmp_path), name="all"), callbacks=callbacks,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data)

    logged, text = scalars(trainer.log_dir), texts(trainer.log_dir)
    # CudaSyncTimer: every step after its warm-up, and the summary table
    assert [s for s, _ in logged["time/step_ms"]] == list(range(2, 12))
    assert len(logged["time/warmup_step_ms"]) == 2 and "throughput/tokens_per_s" in logged
    assert "Forward (s)" in text["time/summary"][0]
    # ... whose statistics leave out the steps inside the other callbacks' windows, reported apart
    # (KernelShare 2..4, PrecisionInspector 5, NVTXRanges 7..9; MemorySnapshot records nothing on CPU)
    timer = callbacks[0]
    assert timer.excluded_steps == {2: ["KernelShare"], 3: ["KernelShare"], 4: ["KernelShare"],
                                    5: ["PrecisionInspector"], 7: ["NVTXRanges"], 8: ["NVTXRanges"], 9: ["NVTXRanges"]}
    assert [row["step"] for row in timer.step_times] == list(range(2, 12))  # every step measured and logged
    assert timer.summary()["step_ms"]["count"] == 3  # steps 6, 10, 11
    assert timer.summary(excluded=True)["step_ms"]["count"] == 7
    assert "7 step(s) inside other callbacks' measurement windows excluded" in text["time/summary"][0]
    # KernelShare (CPU operator time on this machine): one report when its window closed
    assert len(logged["kernels/total_ms_per_step"]) == 1 and logged["kernels/total_ms_per_step"][0][1] > 0
    assert "GEMM share" in text["kernels/report"][0] and "kernels/categories" in images(trainer.log_dir)
    # PrecisionInspector at its own step (the global_step while it ran), after the profiler window
    assert [s for s, _ in logged["precision/logits_rel_err"]] == [start["PrecisionInspector"]]
    assert "precision/report" in text
    # MemorySnapshot needs CUDA: it says so once and logs nothing here
    assert sum("need a CUDA device" in str(w.message) for w in caught) == 1
    assert not [t for t in logged if t.startswith("memory/")]
    # NVTXRanges and KernelShare leave nothing behind: ranges off, hooks removed, profiler stopped
    assert active_requests() == (0, 0)
    assert _hooks(module) == 0
    assert callbacks[3]._prof is None
