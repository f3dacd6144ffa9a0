"""``LMModule(cuda_graphs=True)`` with real CUDA graphs (GPU only): same training as eager, callbacks still report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tb import scalars

from lmtrain.callbacks import CudaSyncTimer, KernelShare, MemorySnapshot, NVTXRanges, PrecisionInspector
from lmtrain.data import LMDataModule
from lmtrain.module import LMModule

pytestmark = pytest.mark.gpu

MODEL = dict(size="small", num_layers=4, vocab_size=1000, context_length=128, warmup_steps=3, decay_steps=12, lr=1e-3)


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.values.append(loss.detach().float().clone())


def _fit(module: LMModule, steps: int, callbacks: list[pl.Callback], logdir: Path | None = None) -> pl.Trainer:
    data = LMDataModule(source="synthetic", batch_size=4, context_length=128, vocab_size=1000, train_batches=40,
                        val_batches=1)
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=steps,
                         logger=TensorBoardLogger(str(logdir), name="g") if logdir else False, callbacks=callbacks,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, data)
    return trainer


def _run(**options: Any) -> tuple[list[float], LMModule]:
    pl.seed_everything(0)
    module = LMModule(**MODEL, **options)
    losses = Losses()
    _fit(module, 12, [losses])
    return [float(v) for v in losses.values], module


@pytest.mark.parametrize("options", [
    {},
    {"compile": True},
    {"optimizer_in_backward": True, "optimizer_overlap": True},
    {"compile": True, "master_weights": True},
    {"compile": True, "master_weights": True, "optimizer_state_dtype": "bfloat16"},
], ids=["eager-kernels", "compiled", "in-backward-overlap", "compiled-master-weights", "compact-optimizer-state"])
def test_graphed_training_matches_eager_on_cuda(options: dict[str, Any]) -> None:
    eager, m_eager = _run(**options)
    graphed, m_graphed = _run(cuda_graphs=True, cuda_graph_warmup=3, **options)
    step = m_graphed.graphed_step
    assert (step.graph.captures, step.capture_step, m_graphed.trainer.global_step) == (1, 3, 12)
    # bf16 kernels: the same arithmetic, up to summation order (capturable AdamW computes its bias correction
    # on the device in fp32, the eager one on the host)
    worst = max(abs(g - e) / abs(e) for g, e in zip(graphed, eager, strict=True))
    assert worst < 2e-3, f"losses differ by up to {worst:.2e} (relative): eager {eager} graphed {graphed}"
    # Parameters: AdamW's update of an element with a gradient near zero is ~ +-lr whichever its sign, so single
    # elements may differ by a few lr; whole tensors agree closely.
    for (name, p), q in zip(m_eager.named_parameters(), m_graphed.parameters(), strict=True):
        p, q = p.detach().float(), q.detach().float()
        assert (q - p).norm() <= 1e-2 * p.norm(), name


def test_all_five_callbacks_under_cuda_graphs(tmp_path: Path) -> None:
    callbacks = [
        CudaSyncTimer(warmup_steps=2, print_summary=False),
        KernelShare(wait=5, warmup=1, active=2),           # steps 6..7 (graphed) profiled, 5 warm-up
        MemorySnapshot(start_step=9, num_steps=1, log_every_n_steps=1),  # runs eagerly (needs_eager_step)
        PrecisionInspector(step=10),                       # runs eagerly
        NVTXRanges(depth="phase", start_step=11, num_steps=1),
    ]
    pl.seed_everything(0)
    module = LMModule(**MODEL, cuda_graphs=True, cuda_graph_warmup=3)
    trainer = _fit(module, 13, callbacks, tmp_path)
    logged = scalars(trainer.log_dir)
    timer = callbacks[0]
    steps = {row["step"]: row for row in timer.step_times}
    # a replayed step keeps its phases (timing events inside the graph)
    assert set(steps[6]) == {"step", "forward_ms", "backward_ms", "optimizer_ms", "step_ms"} and steps[6]["step_ms"] > 0
    assert timer.excluded_steps[3] == ["LMModule"]  # the capture step
    assert timer.excluded_steps[4] == ["LMModule"]  # the second graph's first launch
    assert timer.excluded_steps[9] == ["MemorySnapshot"] and timer.excluded_steps[10] == ["PrecisionInspector"]
    assert "time/step_ms" in logged
    # KernelShare: the replayed steps' kernels, under the one phase a replay has
    total = logged["kernels/total_ms_per_step"][0][1]
    assert total > 0 and logged["kernels/cuda_graph_ms_per_step"][0][1] > 0.9 * total
    assert "kernels/forward_ms_per_step" not in logged
    # PrecisionInspector's step ran eagerly and was inspected; the module captured once only
    assert callbacks[3].result is not None and callbacks[3].result.modules
    assert module.graphed_step.graph.captures == 1
    # MemorySnapshot: the window's step ran eagerly, so its peaks and its allocation history are the step's own; the
    # replayed steps log the capture step's peak instead of per-phase peaks (a replay makes no allocator calls)
    assert not module.replays_graph(9) and module.replays_graph(8)
    peak = dict(logged["memory/peak_after_optimizer_gib"])
    allocated = dict(logged["memory/allocated_gib"])
    assert 9 in peak and not {3, 4, 5, 6, 7, 8, 11, 12} & set(peak), sorted(peak)
    assert peak[9] > allocated[9] > 0  # the step's activations and temporaries on top of what stays
    capture = dict(logged["memory/graph_capture_peak_gib"])
    assert set(capture) == {3, 4, 5, 6, 7, 8, 11, 12} and len(set(capture.values())) == 1
    assert capture[5] > allocated[5] > 0 and capture[5] >= 0.5 * peak[9]
    import pickle

    snapshot_file = next(p for p in callbacks[2].files if p.suffix == ".pickle")
    with open(snapshot_file, "rb") as f:
        trace = [e for device in pickle.load(f)["device_traces"] for e in device]
    assert sum(e["action"] == "alloc" for e in trace) >= 100, len(trace)  # a whole eager step's allocations


#: ``configs/small_bf16_fast.yaml``'s model.
FAST = dict(size="small", vocab_size=10000, context_length=512, attention="sdpa", compile=True, cuda_graphs=True,
            cuda_graph_warmup=3, master_weights=True, optimizer_state_dtype="bfloat16", fused_adamw=True,
            warmup_steps=10, lr=3e-4)


def test_graphed_phases_add_up_to_the_graphed_step_small_bf16_fast() -> None:
    """The timing events inside the graph: forward + backward + optimizer within 2% of the step (median)."""
    pl.seed_everything(0)
    module = LMModule(**FAST)
    assert module.graphed_step is not None
    timer = CudaSyncTimer(warmup_steps=3, print_summary=False)
    data = LMDataModule(source="synthetic", batch_size=4, context_length=512, vocab_size=10000, train_batches=40,
                        val_batches=1)
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=16, logger=False,
                         callbacks=[timer], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, data)
    assert module.graphed_step.timing_problem is None, module.graphed_step.timing_problem
    assert len(module.graphed_step.graph.graphs) == 2  # two graphs, one pool, marks by turns
    replayed = [row for row in timer.step_times if row["step"] > module.graphed_step.capture_step]
    assert len(replayed) >= 10 and all("forward_ms" in row and "optimizer_ms" in row for row in replayed)
    ratios = sorted((r["forward_ms"] + r["backward_ms"] + r["optimizer_ms"]) / r["step_ms"] for r in replayed)
    median = ratios[len(ratios) // 2]
    assert 0.98 <= median <= 1.0 + 1e-6, f"phases / step: {ratios}"
