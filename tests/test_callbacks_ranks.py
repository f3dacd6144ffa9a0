"""The five callbacks on several ranks: 2-process CPU fits over gloo (DDP and FSDP2), plus the pure cross-rank code.

Each fit runs in its own Python process (this file is also the script: ``python tests/test_callbacks_ranks.py
STRATEGY OUT_DIR``), as in ``tests/test_distributed.py``, so that Lightning's launcher starts rank 1 from a
script and pytest is never forked.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from subprocs import own_job_env
from test_callback_memory import fake_cuda  # noqa: F401 (a fixture)

STEPS = 6
#: Steps of the fits with every callback at its defaults: the timer's warm-up is steps 0..4 and KernelShare's window
#: steps 5..7, so 12 of the 15 measured steps (80%) are the summary's.
DEFAULT_STEPS = 20
BATCH = 4
CONTEXT = 32
VOCAB = 256


# -- the script ---------------------------------------------------------------------------------------------


def run_fit(strategy: str, out: Path) -> None:
    """Fit the tiny model on 2 CPU processes under ``strategy`` (``ddp``, ``ddp_rank1`` or ``fsdp``: STEPS steps, the
    callbacks set for those tests; ``ddp_defaults`` or ``fsdp_defaults``: DEFAULT_STEPS steps, all five callbacks at
    their defaults); every rank writes ``rank{r}.json`` (what its callbacks hold) to ``out``."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lmtrain.callbacks import CudaSyncTimer, KernelShare, MemorySnapshot, NVTXRanges, PrecisionInspector
    from lmtrain.module import LMModule

    defaults = strategy.endswith("_defaults")
    steps = DEFAULT_STEPS if defaults else STEPS
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (steps * BATCH * 2, CONTEXT + 1), generator=g)

    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> torch.utils.data.DataLoader:
            rank = self.trainer.global_rank
            return torch.utils.data.DataLoader(data[rank::2], batch_size=BATCH, shuffle=False)

    module = LMModule(size="tiny", vocab_size=VOCAB, context_length=CONTEXT, lr=1e-3, warmup_steps=0,
                      fused_adamw=False)
    if defaults:
        timer, kernels, precision = CudaSyncTimer(), KernelShare(), PrecisionInspector()
        callbacks = [timer, NVTXRanges(), MemorySnapshot(), kernels, precision]
    else:
        timer = CudaSyncTimer(warmup_steps=1)
        kernels = KernelShare(wait=1, warmup=1, active=2, ranks=[1] if strategy == "ddp_rank1" else [0], chart=False)
        precision = PrecisionInspector(step=1)
        callbacks = [timer, NVTXRanges(depth="module", nvtx=False), MemorySnapshot(start_step=2), kernels, precision]
    fsdp = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    strategies = {"ddp": "ddp", "ddp_rank1": "ddp", "fsdp": fsdp, "ddp_defaults": "ddp", "fsdp_defaults": fsdp}
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategies[strategy], precision="32-true", max_steps=steps,
        logger=TensorBoardLogger(str(out), name="tb"), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, use_distributed_sampler=False, callbacks=callbacks,
    )
    trainer.fit(module, datamodule=Data())
    report = precision.result
    result = {
        "rank": trainer.global_rank, "world_size": trainer.world_size, "steps": len(timer.step_times),
        "summary_steps": timer.summary().get("step_ms", {}).get("count", 0),
        "excluded": {str(k): v for k, v in timer.excluded_steps.items()},
        "kernel_summary": kernels.summary is not None,
        "precision": None if report is None else {
            "compute_dtype": report.compute_dtype, "parameters": report.parameters[:3],
            "notes": report.notes, "numerics": report.numerics},
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


# -- the tests ----------------------------------------------------------------------------------------------


def _fit(strategy: str, tmp_path: Path, stderr: list[str] | None = None) -> dict[int, dict]:
    env = own_job_env()
    proc = subprocess.run([sys.executable, __file__, strategy, str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if stderr is not None:
        stderr.append(proc.stderr)
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}


def _rank0_scalars(tmp_path: Path) -> dict[str, list[tuple[int, float]]]:
    from tb import scalars

    files = sorted(tmp_path.rglob("events.out.tfevents.*"))
    # Rank 0 alone writes TensorBoard: one folder of event files (Lightning's logger is a no-op on rank 1).
    assert files and {f.parent for f in files} == {tmp_path / "tb" / "version_0"}, files
    return scalars(tmp_path / "tb" / "version_0")


def test_ddp_two_ranks_all_five_callbacks(tmp_path: Path) -> None:
    ranks = _fit("ddp", tmp_path)
    assert ranks[0]["world_size"] == 2 and ranks[0]["steps"] == STEPS - 1
    assert ranks[0]["kernel_summary"] and not ranks[1]["kernel_summary"]  # ranks=[0]: rank 1 did not profile
    sc = _rank0_scalars(tmp_path)
    logged = [s for s, _ in sc["time/step_ms"]]
    assert logged == list(range(1, STEPS))  # after the warm-up step, every step
    for tag in ("time/step_ms_slowest", "time/step_ms_fastest", "time/straggler_ratio", "time/slowest_rank",
                "time/forward_ms_max", "time/backward_ms_max", "time/optimizer_ms_max", "throughput/tokens_per_s"):
        assert [s for s, _ in sc[tag]] == logged, tag
    assert all(v >= 1.0 for _, v in sc["time/straggler_ratio"])
    assert {v for _, v in sc["time/slowest_rank"]} <= {0.0, 1.0}
    for (_, slow), (_, fast), (_, ratio) in zip(sc["time/step_ms_slowest"], sc["time/step_ms_fastest"],
                                                sc["time/straggler_ratio"], strict=True):
        assert slow >= fast > 0 and ratio == pytest.approx(slow / fast, rel=1e-5)
    # Tokens of both ranks over the slowest rank's step time.
    for (_, tps), (_, slow) in zip(sc["throughput/tokens_per_s"], sc["time/step_ms_slowest"], strict=True):
        assert tps == pytest.approx(2 * BATCH * CONTEXT / (slow / 1000), rel=1e-4)
    # KernelShare's CPU profile holds DDP's gloo all-reduce of the gradients, in the backward pass.
    assert sc["kernels/communication_share_step"][0][1] > 0
    assert sc["kernels/communication_ms_step"][0][0] == 3  # the window's last step
    assert sc["kernels/communication_ms_step"][0][1] > 0
    # ... set against the timer's step at the fit's end: NVTXRanges at module depth perturbs every step here, so the
    # timer has no unperturbed step, and the comparison says so instead of logging those ratios; the timer's own
    # times of the profiled steps (2 and 3) are still there to compare with
    from tb import texts

    said = texts(tmp_path / "tb" / "version_0")["kernels/step_comparison"][0]
    assert "No unprofiled timer step to compare with" in said and "mean of 2 profiled steps" in said
    assert "kernels/timer_step_ms" not in sc and "kernels/wall_to_timer_profiled" in sc
    # MemorySnapshot measures nothing on CPU; PrecisionInspector ran on both ranks.
    assert not any(tag.startswith("memory/") for tag in sc)
    assert "precision/flagged_modules" in sc


def test_ddp_kernel_share_on_rank_one_only(tmp_path: Path) -> None:
    ranks = _fit("ddp_rank1", tmp_path)
    assert ranks[1]["kernel_summary"] and not ranks[0]["kernel_summary"]
    sc = _rank0_scalars(tmp_path)
    # Rank 0 did not profile, yet logs rank 1's results.
    assert sc["kernels/total_ms_per_step"][0][0] == 3 and sc["kernels/communication_ms_step"][0][1] > 0


def test_fsdp2_two_ranks_all_five_callbacks(tmp_path: Path) -> None:
    ranks = _fit("fsdp", tmp_path)
    sc = _rank0_scalars(tmp_path)
    assert "time/straggler_ratio" in sc and "kernels/communication_ms_step" in sc
    for rank in (0, 1):
        prec = ranks[rank]["precision"]
        assert prec["compute_dtype"] == "float32"
        first = prec["parameters"][0]  # the embedding, sharded along dim 0 over the two ranks
        assert first["shape"] == [VOCAB, 128] and first["local_shape"] == [VOCAB // 2, 128]
        assert first["dtype"] == first["compute_dtype"] == "float32"
        assert prec["numerics"]["logits_max_abs_err"] == 0.0


#: What each callback logs on a CPU at its defaults (MemorySnapshot measures nothing without CUDA: it says so once;
#: NVTXRanges logs no tag: its ranges are in KernelShare's trace, whose phases come from them).
DEFAULT_TAGS = {"CudaSyncTimer": ("time/step_ms", "time/forward_ms", "time/step_ms_slowest", "time/straggler_ratio",
                                  "time/summary", "throughput/tokens_per_s"),
                "KernelShare": ("kernels/total_ms_per_step", "kernels/report", "kernels/communication_ms_step",
                                "kernels/step_comparison", "kernels/timer_step_ms"),
                "PrecisionInspector": ("precision/logits_rel_err", "precision/report")}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp_defaults", "fsdp_defaults"], ids=["ddp", "fsdp2"])
def test_two_ranks_all_five_callbacks_at_their_defaults(tmp_path: Path, strategy: str) -> None:
    """All five at their defaults on 2 ranks: the timer keeps >= 80% of its measured steps on every rank (KernelShare's
    profiled steps 5..7 alone are left out), and every callback reports."""
    from tb import texts

    said: list[str] = []
    ranks = _fit(strategy, tmp_path, said)
    for rank in (0, 1):
        measured = ranks[rank]["steps"]
        assert measured == DEFAULT_STEPS - 5  # the timer's 5 warm-up steps apart
        assert ranks[rank]["excluded"] == {str(s): ["KernelShare"] for s in (5, 6, 7)}
        assert ranks[rank]["summary_steps"] >= 0.8 * measured
    assert ranks[0]["kernel_summary"] and ranks[0]["precision"] is not None
    tags = set(_rank0_scalars(tmp_path)) | set(texts(tmp_path / "tb" / "version_0"))
    for name, expected in DEFAULT_TAGS.items():
        assert set(expected) <= tags, (name, sorted(set(expected) - tags))
    assert "time/summary" in tags and "Forward (s)" in texts(tmp_path / "tb" / "version_0")["time/summary"][0]
    assert "MemorySnapshot: memory peaks, snapshots and OOM dumps need a CUDA device" in said[0]


# -- pure code -----------------------------------------------------------------------------------------------


def test_cross_rank_metrics() -> None:
    from lmtrain.analysis.timing import cross_rank_metrics, step_metrics

    nan = math.nan
    rows = [[10.0, 20.0, 5.0, 40.0, 100.0, 1e9], [12.0, 30.0, nan, 50.0, 100.0, 3e9]]
    metrics, slowest, tokens, flops = cross_rank_metrics(rows)
    assert metrics == {"time/step_ms_slowest": 50.0, "time/step_ms_fastest": 40.0, "time/slowest_rank": 1.0,
                       "time/straggler_ratio": 1.25, "time/forward_ms_max": 12.0, "time/backward_ms_max": 30.0,
                       "time/optimizer_ms_max": 5.0}
    assert (slowest, tokens, flops) == (50.0, 200.0, 2e9)
    row = {"step": 3, "forward_ms": 10.0, "backward_ms": 20.0, "optimizer_ms": 5.0, "step_ms": 40.0}
    out, raw = step_metrics(row, rows, 100, 1e9, peak_flops=1e11)
    assert out["time/step_ms"] == 40.0  # rank 0's own
    assert out["throughput/tokens_per_s"] == pytest.approx(200 / 0.05)
    assert raw == pytest.approx(2e9 / 0.05 / 1e11) == out["throughput/mfu"]
    # One process: as before, this rank's values only.
    one, raw1 = step_metrics(row, None, 100, 1e9, peak_flops=1e11)
    assert set(one) == {"time/forward_ms", "time/backward_ms", "time/optimizer_ms", "time/step_ms",
                        "throughput/tokens_per_s", "throughput/mfu"}
    assert one["throughput/tokens_per_s"] == pytest.approx(100 / 0.04) and raw1 == pytest.approx(1e9 / 0.04 / 1e11)
    # Ties go to the lowest rank; a rank that cannot count tokens drops tokens/s.
    tie, _, no_tokens, _ = cross_rank_metrics([[1, 1, 1, 5, nan, 1], [1, 1, 1, 5, 3, 1]])
    assert tie["time/slowest_rank"] == 0.0 and tie["time/straggler_ratio"] == 1.0 and no_tokens is None


def test_merge_rank_metrics() -> None:
    from lmtrain.analysis.kernels import merge_rank_metrics

    assert merge_rank_metrics({}) == {}
    one = {"kernels/total_ms_per_step": 2.0, "kernels/communication_ms_step": 1.0,
           "kernels/compute_beside_comm_excess_ms_step": 0.25}
    assert merge_rank_metrics({1: one}) == one
    two = {"kernels/total_ms_per_step": 3.0, "kernels/communication_ms_step": 0.5,
           "kernels/compute_beside_comm_excess_ms_step": 0.75}
    merged = merge_rank_metrics({1: one, 0: two})
    assert merged["kernels/total_ms_per_step"] == 3.0  # rank 0's own
    assert merged["kernels/communication_ms_step_max"] == 1.0 and merged["kernels/busiest_rank"] == 0.0
    assert merged["kernels/compute_beside_comm_excess_ms_step_max"] == 0.75
    assert "kernels/communication_exposed_ms_step_max" not in merged  # no rank had it


def test_exposed_communication_reaches_the_metrics() -> None:
    from lmtrain.analysis.kernels import TraceRecords, summarize, trace_metrics

    nccl, gemm = "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "sm90_xmma_gemm_bf16"
    records = [(nccl, "backward", 100.0), (gemm, "backward", 300.0)]
    tr = TraceRecords(records, 1, 500.0, "cuda", communication={"backward": (100.0, 40.0), "step": (100.0, 40.0)})
    metrics = trace_metrics(summarize(records), tr)
    assert metrics["kernels/communication_ms_backward"] == pytest.approx(0.1)
    assert metrics["kernels/communication_ms_step"] == pytest.approx(0.1)
    assert metrics["kernels/communication_exposed_ms_backward"] == pytest.approx(0.04)
    assert metrics["kernels/communication_exposed_ms_step"] == pytest.approx(0.04)
    assert "kernels/communication_ms_forward" not in metrics


def test_dtensor_parameters_report_master_and_compute_dtypes(tmp_path: Path) -> None:
    """FSDP2 on a 1-rank gloo mesh in this process: bf16 all-gather of fp32 master shards."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lmtrain.analysis.dtypes import PrecisionReport, parameter_entries
    from lmtrain.callbacks.dtype_recorder import DtypeRecorder

    if dist.is_initialized():
        pytest.skip("a process group exists already")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)), mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        with DtypeRecorder(model, "cpu") as rec:
            out = model(torch.randn(2, 8))
        out.float().sum().backward()  # FSDP2 reshards: the parameters are sharded fp32 DTensors again
        assert out.dtype == torch.bfloat16
        entries = parameter_entries(model, rec.param_compute)
        assert [e["path"] for e in entries] == ["0.weight", "0.bias", "2.weight", "2.bias"]
        first = entries[0]
        assert first["dtype"] == "float32" and first["compute_dtype"] == "bfloat16"
        assert first["shape"] == first["local_shape"] == [16, 8] and first["local_numel"] == 128
        report = PrecisionReport(precision="bf16-mixed", device_type="cpu", autocast=False, autocast_dtype=None,
                                 compute_dtype="bfloat16", parameters=entries)
        text = report.to_markdown()
        assert "parameters (compute: as the modules saw them)" in text and "sharded parameters (DTensor)" in text
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", [0, 1])
def test_memory_snapshot_on_rank_of_two(fake_cuda, monkeypatch: pytest.MonkeyPatch, rank: int) -> None:  # noqa: F811
    """MemorySnapshot as rank ``rank`` of 2 (fake allocator, the gather stubbed with the other rank's peak 6 GiB)."""
    from test_callback_memory import run_step

    import lmtrain.callbacks.memory as memory_module
    from lmtrain.callbacks.memory import MemorySnapshot

    alloc, trainer = fake_cuda
    trainer.world_size, trainer.global_rank = 2, rank
    gathered = []

    def gather(trainer_, values):  # noqa: ANN001, ANN202
        gathered.append(list(values))
        return [list(values), [6.0]] if rank == 0 else [[6.0], list(values)]

    monkeypatch.setattr(memory_module, "gather_values", gather)
    module = torch.nn.Linear(2, 2)
    cb = MemorySnapshot(start_step=1, num_steps=1, ranks=[1], log_every_n_steps=2)
    cb.setup(trainer, module, "fit")
    recording = []
    for _ in range(3):
        run_step(cb, trainer, module, alloc)
        recording.append(alloc.recording)
    cb.teardown(trainer, module, "fit")
    assert gathered == [[4.5], [4.5]]  # logged steps 0 and 2 only: the step's peak, on every rank
    if rank == 0:  # rank 0 logs the gathered peaks; it does not record history
        tags = trainer.loggers[0].logged[0][1]
        assert tags["memory/peak_gib_max"] == 6.0 and tags["memory/peak_gib_rank0"] == 4.5
        assert tags["memory/peak_gib_rank1"] == 6.0
        assert alloc.recording_in_step == [False, False, False] and cb.files == []
    else:
        assert alloc.recording_in_step == [False, True, False]  # recorded in step 1 only
        assert recording == [False, False, False]  # and stopped at its end
        assert [p.name for p in cb.files] == ["memory_snapshot_rank1_steps_1-1.pickle",
                                              "memory_timeline_rank1_steps_1-1.png"]


def test_check_ranks() -> None:
    from lmtrain.callbacks._common import check_ranks
    from lmtrain.errors import LmtrainError

    assert check_ranks("KernelShare", [1, 0], 2) == [0, 1]
    for bad in ([], [2], [0, 0], [-1], "0", [True], None):
        with pytest.raises(LmtrainError, match="callbacks.KernelShare.ranks"):
            check_ranks("KernelShare", bad, 2)


if __name__ == "__main__":
    from lmtrain.distributed import end_process_group

    run_fit(sys.argv[1], Path(sys.argv[2]))
    end_process_group()
