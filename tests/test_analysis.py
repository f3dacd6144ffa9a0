"""lmtrain.analysis on saved files: a real CPU profiler trace, a constructed allocator snapshot, the analyze tool."""

from __future__ import annotations

import argparse
import csv
import pickle
from pathlib import Path

import pytest

import lmtrain.analysis.cli as analyze
from lmtrain.analysis.kernels import (
    CATEGORIES,
    PHASES,
    analyze_trace,
    categorize,
    load_trace,
    records_from_trace,
    summarize,
    trace_device,
)
from lmtrain.analysis.memory import (
    GIB,
    MIB,
    live_at_peak,
    load_snapshot,
    memory_curve,
    peak_report,
    snapshot_devices,
)

DATA = Path(__file__).parent / "data"
TRACE = DATA / "kernel_trace_cpu_tiny.json.gz"  # tests/data/make_kernel_trace.py: KernelShare on a tiny model, CPU
SNAPSHOT = DATA / "memory_snapshot_constructed.pickle"  # tests/data/make_memory_snapshot.py
PNG = b"\x89PNG\r\n\x1a\n"


def _parser() -> argparse.ArgumentParser:
    """The parser ``python -m lmtrain analyze`` builds from the tool protocol (docstring, add_arguments)."""
    parser = argparse.ArgumentParser(prog="python -m lmtrain analyze",
                                     description=(analyze.__doc__ or "").strip().splitlines()[0])
    analyze.add_arguments(parser)
    return parser


def _run(*argv: str) -> int:
    return analyze.run(_parser().parse_args(list(argv)))


# -- kernels: a real torch.profiler trace of a tiny model's steps on CPU ------------------------------


def test_real_cpu_trace_records_phases_and_steps() -> None:
    trace = load_trace(TRACE)
    assert trace_device(trace) == "cpu"
    tr = records_from_trace(trace, "auto")
    steps = [e for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]
    assert tr.device == "cpu" and tr.steps == len(steps) >= 1
    phases = {r[1] for r in tr.records}
    assert {"forward", "backward", "optimizer"} <= phases <= set(PHASES)
    # naive attention: its stage ranges are in the trace, forward kernels are attributed to them
    assert {r[3] for r in tr.records if r[3]} == {"attention/qk_matmul", "attention/softmax", "attention/pv_matmul"}
    summary = summarize(tr.records, tr.steps)
    assert summary.total_us == pytest.approx(sum(r[2] for r in tr.records) / tr.steps)
    assert summary.stage_us["attention/softmax"].get("softmax", 0) > 0


def test_real_cpu_trace_optimizer_category_is_the_optimizer_step() -> None:
    """CPU AdamW runs per-parameter aten ops; they count as optimizer work, and only they do."""
    tr = records_from_trace(load_trace(TRACE), "cpu")
    summary = summarize(tr.records, tr.steps)
    overridden = [r for r in tr.records if r[4] == "optimizer"]
    assert overridden and all(r[1] == "optimizer" for r in overridden)
    by_name = [r for r in tr.records if not r[4] and categorize(r[0]) == "optimizer"]  # foreach/fused names
    expected = (sum(r[2] for r in overridden) + sum(r[2] for r in by_name)) / tr.steps
    assert summary.category_us["step"]["optimizer"] == pytest.approx(expected)
    metrics = summary.metrics()
    assert expected > 0 and metrics["kernels/optimizer_share_step"] == pytest.approx(expected / summary.total_us)


def test_analyze_trace_metrics_are_fractions_and_report_answers() -> None:
    found = analyze_trace(load_trace(TRACE), head_dim=16, batches="1..2")
    shares = {k: v for k, v in found.metrics.items() if "_share" in k}
    assert shares and all(0.0 <= v <= 1.0 for v in shares.values()), shares
    assert sum(found.metrics.get(f"kernels/{c}_share_step", 0.0) for c in CATEGORIES) == pytest.approx(1.0)
    assert found.metrics["kernels/attn_softmax_to_matmul_flop_ratio"] == pytest.approx(5 / (4 * 16))
    assert "GEMM share" in found.report and "steps 1..2" in found.report
    assert set(found.tables()) == {"step", *[p for p in PHASES if found.summary.rows.get(p)]}


def test_analyze_kernels_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run("kernels", str(TRACE), "--out", str(tmp_path), "--top-k", "5") == 0
    out = capsys.readouterr().out
    found = analyze_trace(load_trace(TRACE), top_k=5)
    assert "## Where the CPU time goes" in out and "**Top CPU ops, forward:**" in out
    assert found.tables(5)["optimizer"] in out  # the same tables as the callback logs
    with open(tmp_path / "kernel_table.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == sum(len(found.summary.rows[s]) for s in ("step", *found.summary.phase_us))
    assert (tmp_path / "kernel_categories.png").read_bytes().startswith(PNG)


# -- memory: a constructed allocator snapshot -----------------------------------------------------------


def test_constructed_snapshot_peak_and_blocks() -> None:
    """The snapshot is constructed (a CPU cannot capture one) in ``torch.cuda.memory._snapshot()``'s format.

    By construction (tests/data/make_memory_snapshot.py): 8 MiB of weights exist before the recording; the
    forward pass allocates H (8 MiB), the scores S (16 MiB) and the attention output (8 MiB) before S is
    freed, so the peak is 40 MiB with the scores the largest block live; backward frees the activations.
    """
    snapshot = load_snapshot(SNAPSHOT)
    assert snapshot_devices(snapshot) == [0]
    positions, totals = memory_curve(snapshot, 0)
    assert totals[0] == 8 * MIB and max(totals) == 40 * MIB
    live, peak = live_at_peak(snapshot, 0)
    assert peak == 40 * MIB and sum(a.size for a in live) == peak
    assert max(live, key=lambda a: a.size).frames[0]["name"] == "attention"
    text = peak_report(snapshot, 0, top_n=3)
    assert f"{40 * MIB / GIB:.2f} GiB" in text and "model.py:57 attention" in text


def test_analyze_memory_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run("memory", str(SNAPSHOT), "--out", str(tmp_path), "--top-n", "3") == 0
    out = capsys.readouterr().out
    snapshot = load_snapshot(SNAPSHOT)
    assert peak_report(snapshot, 0, 3, where=f"`{SNAPSHOT.name}` (device 0)", snapshot_name=SNAPSHOT.name) in out
    assert (tmp_path / "memory_timeline_memory_snapshot_constructed_device0.png").read_bytes().startswith(PNG)


def test_analyze_help_names_both_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "kernels TRACE" in out and "memory SNAPSHOT" in out


def test_analyze_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run("kernels", str(tmp_path / "missing.json")) == 2
    not_a_trace = tmp_path / "x.json"
    not_a_trace.write_text("{}")
    assert _run("kernels", str(not_a_trace)) == 2
    assert _run("kernels", str(TRACE), "--top-k", "0") == 2
    not_a_snapshot = tmp_path / "x.pickle"
    not_a_snapshot.write_bytes(pickle.dumps([1, 2]))
    assert _run("memory", str(not_a_snapshot)) == 2
    assert _run("memory", str(SNAPSHOT), "--device", "3") == 2  # no trace for that device
    err = capsys.readouterr().err
    assert err.count("error: analyze") == 5


# -- communication: category and exposed time (interval arithmetic on synthetic GPU activities) ---------


@pytest.mark.parametrize("name", ["ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ncclKernel_AllGather_RING_LL_Sum_int8_t",
                                  "gloo:all_reduce", "c10d::allreduce_", "_c10d_functional::all_gather_into_tensor",
                                  "record_param_comms", "aten::all_reduce"])
def test_communication_category(name: str) -> None:
    assert categorize(name) == "communication"


def test_communication_rule_leaves_other_kernels_alone() -> None:
    assert categorize("reduce_kernel<512, 1, 4>") == "reduction" and categorize("aten::copy_") == "copy"


NCCL, GEMM_K, EW_K = "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "sm90_xmma_gemm_bf16", "vectorized_elementwise_kernel"


def test_exposed_communication_interval_arithmetic() -> None:
    from lmtrain.analysis.kernels import exposed_communication

    intervals = [
        (0, 100, GEMM_K, "backward"),  # compute 0..100
        (50, 100, NCCL, "backward"),  # comm 50..150: 50..100 hidden, 100..150 exposed
        (120, 10, EW_K, "backward"),  # compute 120..130 hides 10 of it -> exposed 40
        (140, 30, NCCL, "backward"),  # overlaps the first comm kernel: union 50..170, 150..170 exposed too
        (200, 20, "Memcpy DtoD (Device -> Device)", "optimizer"),  # a copy is not compute
        (200, 40, NCCL, "optimizer"),  # fully exposed
        (300, 10, NCCL, "forward"),
        (295, 20, GEMM_K, "optimizer"),  # compute of another phase hides it all
    ]
    result = exposed_communication(intervals)
    assert result["backward"] == (120.0, 60.0)  # union 50..170; exposed 100..120 and 130..170
    assert result["optimizer"] == (40.0, 40.0)
    assert result["forward"] == (10.0, 0.0)
    assert result["step"] == (170.0, 100.0)
    halved = exposed_communication(intervals, steps=2)
    assert halved["step"] == (85.0, 50.0)
    assert exposed_communication([(0, 10, GEMM_K, "forward")]) == {}


def test_communication_interference_compares_kernels_beside_communication_with_their_twins_alone() -> None:
    """Three GEMMs alone (10, 12, 14 us: median 12), two beside an all-reduce (18 and 24 us, 42 in all, against
    2 x 12 = 24 alone): 1.75x, +18 us. One elementwise kernel beside it has two twins alone, too few to judge
    (min_alone 3); one GEMM only a third covered counts in neither group; a copy is not compute."""
    from lmtrain.analysis.kernels import communication_interference

    intervals = [
        (0, 10, GEMM_K, "backward"), (20, 12, GEMM_K, "backward"), (40, 14, GEMM_K, "backward"),
        (100, 200, NCCL, "backward"),  # communication 100..300
        (100, 18, GEMM_K, "backward"), (130, 24, GEMM_K, "backward"),  # fully beside it
        (280, 60, GEMM_K, "backward"),  # 20 of 60 us beside it: neither alone nor beside
        (0, 5, EW_K, "backward"), (60, 5, EW_K, "backward"), (200, 7, EW_K, "backward"),
        (150, 50, "Memcpy DtoD (Device -> Device)", "backward"),
    ]
    inter = communication_interference(intervals)
    assert (inter.beside_us, inter.alone_us, inter.kernels, inter.unmatched_us) == (42.0, 24.0, 2, 7.0)
    assert inter.slowdown == pytest.approx(1.75) and inter.excess_us == pytest.approx(18.0)
    per_step = communication_interference(intervals, steps=2)
    assert (per_step.beside_us, per_step.alone_us, per_step.kernels, per_step.unmatched_us) == (21.0, 12.0, 1, 3.5)
    # the same name in another phase, or with another grid, is not a twin
    shapes = ["a", "a", "a", None, "b", "b", "a", None, None, None, None]
    other_grid = communication_interference(intervals, shapes)
    assert other_grid.slowdown is None and other_grid.unmatched_us == 49.0
    assert communication_interference([(0, 10, GEMM_K, "forward")]) is None  # no communication at all


def test_interference_counts_cover_from_several_communication_kernels_and_half_cover_as_beside() -> None:
    """A kernel over two all-reduces (0..10 and 20..30, 20 of its 40 us covered: exactly half) is beside them; one
    with 9 of 20 us covered (under half) is neither; three twins alone of 20 us each."""
    from lmtrain.analysis.kernels import communication_interference

    intervals = [(0, 10, NCCL, "backward"), (20, 10, NCCL, "backward"), (25, 3, NCCL, "backward"),
                 (-5, 40, GEMM_K, "backward"),  # covered 0..10 and 20..30: 20 of 40
                 (21, 20, EW_K, "backward"),  # covered 21..30: 9 of 20
                 *[(100 + 30 * i, 20, GEMM_K, "backward") for i in range(3)],
                 *[(100 + 30 * i, 20, EW_K, "backward") for i in range(3)]]
    inter = communication_interference(intervals)
    assert (inter.beside_us, inter.alone_us, inter.kernels, inter.unmatched_us) == (40.0, 20.0, 1, 0.0)
    assert inter.slowdown == 2.0


def test_no_slowdown_figure_when_nothing_beside_communication_can_be_compared() -> None:
    """Compute beside an all-reduce with no twin alone: its time is reported as not judged, and neither a slowdown
    nor an excess (a 0 would read as "not slowed")."""
    x = {"ph": "X", "tid": 1}
    events = [{**x, "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0.0, "dur": 100.0}]
    for i, (ts, dur, name) in enumerate([(10.0, 50.0, NCCL), (20.0, 20.0, GEMM_K)]):
        events.append({**x, "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1.0 + i, "dur": 0.5,
                       "args": {"correlation": i}})
        events.append({**x, "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": i}})
    found = analyze_trace({"traceEvents": events}, device="cuda")
    assert found.metrics["kernels/compute_beside_comm_unjudged_ms_step"] == pytest.approx(0.020)
    assert "kernels/compute_beside_comm_slowdown" not in found.metrics
    assert "kernels/compute_beside_comm_excess_ms_step" not in found.metrics
    assert "none of those kernels also ran alone often enough to compare" in found.breakdown


def test_interference_reaches_metrics_and_breakdown_from_a_trace() -> None:
    """From a trace: the profiler's grid and block sizes tell launches apart; the scalars and the breakdown text."""
    x = {"ph": "X", "tid": 1}
    events = [{**x, "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0.0, "dur": 400.0},
              {**x, "cat": "user_annotation", "name": "backward", "ts": 0.0, "dur": 400.0}]
    kernels = [(10.0, 10.0, GEMM_K), (30.0, 10.0, GEMM_K), (50.0, 10.0, GEMM_K), (100.0, 150.0, NCCL),
               (110.0, 15.0, GEMM_K), (130.0, 15.0, GEMM_K)]
    for i, (ts, dur, name) in enumerate(kernels):
        events.append({**x, "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1.0 + i, "dur": 0.5,
                       "args": {"correlation": i}})
        events.append({**x, "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": 7 if name == NCCL else 8,
                       "args": {"correlation": i, "grid": [132, 1, 1], "block": [384, 1, 1]}})
    found = analyze_trace({"traceEvents": events}, device="cuda")
    m = found.metrics
    assert m["kernels/compute_beside_comm_ms_step"] == pytest.approx(0.030)
    assert m["kernels/compute_beside_comm_excess_ms_step"] == pytest.approx(0.010)
    assert m["kernels/compute_beside_comm_slowdown"] == pytest.approx(1.5)
    assert m["kernels/compute_beside_comm_unjudged_ms_step"] == 0.0
    assert "ran 1.50x as long: +0.01 ms per step" in found.breakdown


def test_kernels_of_a_cuda_graph_replay_belong_to_the_cuda_graph_phase() -> None:
    """A replayed step: one ``cuda graph`` range around the graph launch; its kernels share the launch's correlation."""
    from lmtrain.analysis.kernels import GRAPH_PHASE, summarize

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "ts": 0.0, "dur": 100.0, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": GRAPH_PHASE, "ts": 1.0, "dur": 20.0, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 5.0, "dur": 3.0, "tid": 1,
         "args": {"correlation": 42}},
        {"ph": "X", "cat": "kernel", "name": "ampere_bf16_gemm", "ts": 10.0, "dur": 30.0, "args": {"correlation": 42}},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add", "ts": 41.0, "dur": 9.0,
         "args": {"correlation": 42}},
    ]
    tr = records_from_trace({"traceEvents": events}, "cuda")
    assert [(name, phase, us) for name, phase, us, *_ in tr.records] == [
        ("ampere_bf16_gemm", GRAPH_PHASE, 30.0), ("triton_poi_fused_add", GRAPH_PHASE, 9.0)]
    metrics = summarize(tr.records, tr.steps).metrics()
    assert metrics["kernels/cuda_graph_ms_per_step"] == pytest.approx(0.039)
    assert "kernels/forward_ms_per_step" not in metrics


def test_busy_share_counts_overlapping_kernels_once() -> None:
    """A GEMM and an NCCL kernel on two streams overlap: the GPU is busy for the union of their intervals (80 of the
    step's 100 µs), not for the sum of their durations (150 µs, a "share" of 1.5)."""
    x = {"ph": "X", "tid": 1}
    events = [
        {**x, "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0.0, "dur": 100.0},
        {**x, "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 2.0, "dur": 3.0, "args": {"correlation": 1}},
        {**x, "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 6.0, "dur": 3.0, "args": {"correlation": 2}},
        {**x, "cat": "kernel", "name": GEMM_K, "ts": 10.0, "dur": 80.0, "tid": 7, "args": {"correlation": 1}},
        {**x, "cat": "kernel", "name": NCCL, "ts": 20.0, "dur": 70.0, "tid": 8, "args": {"correlation": 2}},
    ]
    figures = analyze_trace({"traceEvents": events}, device="cuda")
    metrics = figures.metrics
    assert metrics["kernels/total_ms_per_step"] == pytest.approx(0.150)
    assert metrics["kernels/gpu_busy_ms_per_step"] == pytest.approx(0.080)
    assert metrics["kernels/busy_share"] == pytest.approx(0.8)
    # the report's busy line says the same, not the sum of durations (150%)
    assert "so the GPU is busy 80% of it" in figures.report
