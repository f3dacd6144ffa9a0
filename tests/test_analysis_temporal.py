"""lmtrain.analysis.temporal on constructed traces with known intervals: exact breakdown, idle split, overlap and
launch statistics; ``analyze kernels`` on a CPU trace and on a two-rank folder."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import pytest

import lmtrain.analysis.cli as analyze
from lmtrain.analysis.kernels import analyze_trace
from lmtrain.analysis.temporal import activities, idle_split, launch_stats, temporal_breakdown

TRACE = Path(__file__).parent / "data" / "kernel_trace_cpu_tiny.json.gz"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1_execute_segment_k_off_kernel"
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def _x(name: str, cat: str, ts: float, dur: float, tid: int = 1, **args: object) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def constructed(ranges: bool = True, shift: float = 0.0) -> dict:
    """One step: forward [0, 50), backward [50, 100); stream 7 runs compute and a memcpy, stream 9 an all-reduce.

    GPU timeline (µs, launch call start in brackets):
        10-20 gemm (1), 20-25 add (2), 32-40 gemm (30), 35-60 NCCL on stream 9 (33),
        62-66 memcpy (55), 70-80 add (56), 95-100 gemm (90)
    """
    launches = [(1, 10, 10, GEMM, 7, "kernel"), (2, 20, 5, "triton_poi_fused_add_0", 7, "kernel"),
                (30, 32, 8, GEMM, 7, "kernel"), (33, 35, 25, NCCL, 9, "kernel"),
                (55, 62, 4, "Memcpy DtoD (Device -> Device)", 7, "gpu_memcpy"),
                (56, 70, 10, "triton_poi_fused_add_0", 7, "kernel"), (90, 95, 5, GEMM, 7, "kernel")]
    events = [_x("ProfilerStep#4", "user_annotation", 0, 100)]
    if ranges:
        events += [_x("forward", "user_annotation", 0, 50), _x("backward", "user_annotation", 50, 50)]
    for i, (launch, ts, dur, name, stream, cat) in enumerate(launches):
        events.append(_x("cudaLaunchKernel", "cuda_runtime", launch, 1, correlation=i))
        events.append(_x(name, cat, ts + shift, dur, tid=stream, correlation=i, stream=stream))
    return {"traceEvents": events}


def test_breakdown_of_a_constructed_trace() -> None:
    acts, steps = activities(constructed())
    t = temporal_breakdown(acts, steps)
    assert steps == 1 and t.span_us == 90
    # compute: the union of compute kernels; communication / memory: what compute (then communication) leaves
    assert t.kind_us == {"compute": 38, "communication": 20, "memory": 4, "idle": 28}
    assert t.by_phase == {"forward": {"compute": 23, "communication": 20, "memory": 0, "idle": 7},
                          "backward": {"compute": 15, "communication": 0, "memory": 4, "idle": 21}}
    assert t.communication_us == 25 and t.overlap_us == 5 and t.overlap_share == pytest.approx(0.2)
    # idle gaps of the whole GPU: 25-32 and 80-95 wait for the host (launched at 30 and 90); 60-62 and 66-70
    # have their work queued (launched at 55 and 56): under HTA's 30 µs, kernel waits
    assert t.idle_us == {"host_wait": 22, "kernel_wait": 6, "other": 0}
    assert idle_split(acts, kernel_wait_us=3) == {"host_wait": 22, "kernel_wait": 2, "other": 4}


def test_idle_split_per_stream_as_hta_computes_it() -> None:
    """HTA splits each stream's gaps: stream 7 waits 40-62 for a memcpy launched at 55, which is host wait there."""
    acts, _ = activities(constructed())
    assert idle_split(acts, per_stream=True) == {"host_wait": 44, "kernel_wait": 4, "other": 0}
    assert idle_split(acts, per_stream=True, kernel_wait_us=3) == {"host_wait": 44, "kernel_wait": 0, "other": 4}


def test_launch_statistics_of_a_constructed_trace() -> None:
    acts, steps = activities(constructed())
    t = temporal_breakdown(acts, steps)
    launch = launch_stats(acts, t)
    assert launch.kernels_per_step == 6  # the memcpy is not a kernel
    assert launch.short_per_step == 3  # 5, 8 and 5 µs; 10 µs is not short
    assert sorted(launch.delays_us) == [2, 2, 5, 9, 14, 18]
    assert launch.delay(0.5) == 7 and launch.delay(0.9) == 18
    assert launch.host_wait_share == pytest.approx(22 / 90) and launch.launch_bound


def test_a_trace_without_lmtrain_ranges_is_one_window_of_unknown_phase() -> None:
    found = analyze_trace(constructed(ranges=False))
    assert found.metrics["breakdown/unknown_compute_ms_per_step"] == pytest.approx(0.038)
    assert found.metrics["breakdown/idle_share"] == pytest.approx(28 / 90)
    assert found.metrics["breakdown/comm_overlap_share"] == pytest.approx(0.2)
    assert found.metrics["idle/host_wait_share"] == pytest.approx(22 / 28)
    assert found.metrics["launch/bound"] == 1.0 and found.metrics["launch/delay_median_us"] == 7


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    analyze.add_arguments(parser)
    return parser


def test_analyze_kernels_on_a_cpu_trace_prints_the_breakdown(capsys: pytest.CaptureFixture[str]) -> None:
    assert analyze.run(_parser().parse_args(["kernels", str(TRACE)])) == 0
    out = capsys.readouterr().out
    for text in ("**Temporal breakdown** (CPU timeline", "**Idle split**", "**Communication hidden behind compute:**",
                 "**Launches:**", "| forward", "| backward", "| optimizer"):
        assert text in out
    assert "wrote" not in out  # no --out: nothing written next to the trace


def test_analyze_kernels_on_a_two_rank_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "trace_rank0.json").write_text(json.dumps(constructed()))
    (folder / "precision_step0.json").write_text("{}")  # a run's log folder holds other JSON files too
    with gzip.open(folder / "trace_rank1.json.gz", "wt") as f:
        json.dump(constructed(shift=1.0), f)  # rank 1's kernels start 1 µs later: the same shares
    out_dir = tmp_path / "analysis"
    assert analyze.run(_parser().parse_args(["kernels", str(folder), "--out", str(out_dir), "--no-chart"])) == 0
    out = capsys.readouterr().out
    assert "## Rank 0: temporal breakdown (trace_rank0.json)" in out
    assert "## Rank 1: temporal breakdown (trace_rank1.json.gz)" in out
    assert out.count("**Idle split**") == 2 and out.count("**Launches:**") == 2
    # the rank table: compute 38/90, communication 20/90, memory 4/90, idle 28/90, overlap 20%, no compute kernel
    # beside communication with twins alone to compare (-), host wait 22/28
    row = ("| 42.2%   | 22.2%         | 4.4%   | 31.1% | 20.0%       | -                   | 78.6%           "
           "| 6            | yes")
    assert out.count(row) == 2, out[-800:]
    assert sorted(p.name for p in out_dir.iterdir()) == ["kernel_table_rank0.csv", "kernel_table_rank1.csv"]
    assert sorted(p.name for p in folder.iterdir()) == ["precision_step0.json", "trace_rank0.json",
                                                        "trace_rank1.json.gz"]
