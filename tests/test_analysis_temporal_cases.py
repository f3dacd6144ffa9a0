"""lmtrain.analysis.temporal on Kineto-shaped constructed traces (``temporal_traces``), one per case HTA's rules
distinguish: the window of profiled steps, gaps after short kernels, queued work, late launches, CUDA graph
replays under one ``cudaGraphLaunch``, NCCL on another stream, memcpy / memset. Exact expected values, worked out
in each builder's docstring; ``test_analysis_temporal_hta.py`` checks the same traces against HTA itself."""

from __future__ import annotations

import pytest
import temporal_traces as traces

from lmtrain.analysis.kernels import analyze_trace
from lmtrain.analysis.temporal import Temporal, activities, idle_split, kind_of, launch_stats, temporal_breakdown


def _window(trace: dict) -> tuple[Temporal, list]:
    acts, steps = activities(trace)
    return temporal_breakdown(acts, steps), acts


def _totals(values: dict[str, float], steps: int) -> dict[str, float]:
    return {k: v * steps for k, v in values.items()}


def test_the_window_is_the_steps_launches_and_the_step_count_the_cpu_ranges() -> None:
    acts, steps = activities(traces.eager())
    assert steps == 2  # each ProfilerStep# also has a GPU annotation of the same name: not another step
    starts = sorted(a.start for a in acts)
    # the kernel still running from before the window (2.5) and the one launched after the last step (211) are out;
    # the one launched at 203, before step 2's GPU annotation ends (205.5), is in
    assert starts[0] == 10.25 and starts[-1] == 204.0 and len(acts) == 9


def test_eager_steps_gaps_after_short_kernels_late_launches_memcpy_and_memset() -> None:
    t, acts = _window(traces.eager())
    assert t.steps == 2 and t.span_us * 2 == 195.25
    assert _totals(t.kind_us, 2) == {"compute": 58.75, "communication": 0, "memory": 4.75, "idle": 131.75}
    assert _totals(t.idle_us, 2) == {"host_wait": 74, "kernel_wait": 3.5, "other": 54.25}
    assert idle_split(acts, per_stream=True) == {"host_wait": 74, "kernel_wait": 3.5, "other": 54.25}
    assert t.overlap_share is None  # no communication
    launch = launch_stats(acts, t)
    assert launch.kernels_per_step == 3.5 and launch.short_per_step == 2  # the memcpy / memset are not kernels
    assert sorted(launch.delays_us) == [1, 5, 9.25, 10, 26.5, 28.25, 66]


def test_cpu_launch_operators_with_a_stream_are_not_gpu_work() -> None:
    """Inductor's launch operators carry a stream argument but run on the CPU: the figures are eager's, and the
    comparison script's HTA copy drops exactly their stream arguments (what HTA would otherwise count as compute)."""
    from conftest import load_script

    t, acts = _window(traces.triton_launch_operators())
    plain, plain_acts = _window(traces.eager())
    assert t == plain and acts == plain_acts
    copy, dropped = load_script("hta_compare").without_cpu_op_streams(traces.triton_launch_operators())
    assert dropped == 2
    assert not [e for e in copy["traceEvents"] if e.get("cat") == "cpu_op" and "stream" in e.get("args", {})]
    assert sum("stream" in e.get("args", {}) for e in copy["traceEvents"]) == 11  # the 11 GPU activities keep theirs


def test_a_cuda_graph_replay_has_one_launch_for_all_its_kernels() -> None:
    t, acts = _window(traces.graphed())
    assert t.span_us * 2 == 178.75
    assert _totals(t.kind_us, 2) == {"compute": 110, "communication": 0, "memory": 0, "idle": 68.75}
    # only the gap before each replay's first kernel can wait for the host; the 1.25 µs gaps inside are kernel waits
    assert _totals(t.idle_us, 2) == {"host_wait": 21.25, "kernel_wait": 47.5, "other": 0}
    assert idle_split(acts, per_stream=True) == {"host_wait": 21.25, "kernel_wait": 47.5, "other": 0}
    launch = launch_stats(acts, t)
    assert launch.kernels_per_step == 20.5 and launch.delays_us == [4]  # graph kernels have no launch delay


def test_nccl_on_another_stream_overlapping_compute() -> None:
    t, acts = _window(traces.overlapped())
    assert t.span_us * 2 == 155
    assert _totals(t.kind_us, 2) == {"compute": 70, "communication": 25, "memory": 0, "idle": 60}
    assert t.communication_us * 2 == 60 and t.overlap_us * 2 == 35 and t.overlap_share == pytest.approx(35 / 60)
    assert _totals(t.idle_us, 2) == {"host_wait": 60, "kernel_wait": 0, "other": 0}
    assert idle_split(acts, per_stream=True) == {"host_wait": 148, "kernel_wait": 2, "other": 0}
    assert _totals(t.idle_stream_us, 2) == {"host_wait": 148, "kernel_wait": 2, "other": 0}


def test_sub_microsecond_activities_keep_their_times() -> None:
    t, _ = _window(traces.sub_microsecond_memset())
    assert t.steps == 1 and t.span_us == 19.75
    assert t.kind_us == {"compute": 16.75, "communication": 0, "memory": 0.5, "idle": 2.5}
    assert t.idle_us == {"host_wait": 0, "kernel_wait": 2.5, "other": 0}


def test_overlapping_activities_on_one_stream_leave_no_idle_time() -> None:
    t, acts = _window(traces.parallel_branches())
    assert t.kind_us == {"compute": 18, "communication": 0, "memory": 0, "idle": 2}
    assert idle_split(acts, per_stream=True) == {"host_wait": 0, "kernel_wait": 2, "other": 0}


@pytest.mark.parametrize(("name", "kind"), [
    (traces.NCCL, "communication"), ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, ncclWork*)",
                                     "communication"),
    ("nccl:all_reduce", "communication"), ("ncclGroupEnd", "compute"),  # HTA: a kernel only with "Kernel" after nccl
    (traces.MEMCPY, "memory"), (traces.MEMSET, "memory"), ("Memcpy PtoP (Device -> Device)", "memory"),
    ("void at::native::(anonymous namespace)::fooMemcpy_kernel", "memory"),  # HTA: non-compute
    ("triton_poi_fused_memset_0", "compute"), (traces.GEMM, "compute")])
def test_kinds_follow_htas_name_patterns(name: str, kind: str) -> None:
    assert kind_of(name) == kind


def test_a_trace_with_one_step_counts_every_activity() -> None:
    """Fewer than two steps: no window to cut (as in HTA), so the kernel without its launch in the trace counts."""
    b = traces.TraceBuilder().step(1, 0.0, 50.0)
    b.launch(None, traces.GEMM, 0.5, 4.5).launch(7.0, traces.GEMM, 10.0, 5.0)
    t, acts = _window(b.trace())
    assert len(acts) == 2 and t.span_us == 14.5 and t.idle_us == {"host_wait": 5, "kernel_wait": 0, "other": 0}


def test_analyze_trace_reports_the_window_per_step() -> None:
    found = analyze_trace(traces.overlapped())
    assert ("host wait 100.0%, kernel wait 0.0%, other 0.0%; each stream's gaps summed (HTA's split): host wait "
            "98.7%, kernel wait 1.3%, other 0.0%.") in found.breakdown
    metrics = found.metrics
    assert metrics["breakdown/span_ms_per_step"] == pytest.approx(0.0775)
    assert metrics["breakdown/idle_share"] == pytest.approx(60 / 155)
    assert metrics["breakdown/comm_overlap_share"] == pytest.approx(35 / 60)


def test_cpu_operators_count_as_the_innermost_of_each_thread() -> None:
    """A CPU trace: an all-reduce called inside a gradient hook on thread 1 (as DDP's on a CPU) is communication for
    its 80 µs and the hook compute for the other 20, with no overlap (one thread runs one operator); an operator
    on thread 2 running beside the all-reduce (40-60) is compute beside communication, so 20 of the 80 µs overlap
    and those 20 µs are compute."""

    def op(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": {}}

    hook = op("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 0, 100)
    events = [op("ProfilerStep#1", 0, 100, cat="user_annotation"), hook, op("c10d::allreduce_", 10, 80)]
    t, _ = _window({"traceEvents": events})
    assert t.kind_us == {"compute": 20.0, "communication": 80.0, "memory": 0.0, "idle": 0.0}
    assert (t.communication_us, t.overlap_us) == (80.0, 0.0)
    t, _ = _window({"traceEvents": [*events, op("aten::mm", 40, 20, tid=2)]})
    assert t.kind_us == {"compute": 40.0, "communication": 60.0, "memory": 0.0, "idle": 0.0}
    assert (t.communication_us, t.overlap_us) == (80.0, 20.0)


def test_kernel_records_and_the_breakdown_take_the_same_window() -> None:
    """The eager trace's kernel launched after its last step (at 211) is in neither the temporal breakdown nor the
    kernel records, so the two spans and idle times agree (they differed by that kernel's 1.5 µs and its gap)."""
    figures = analyze_trace(traces.eager())
    m = figures.metrics
    assert m["kernels/gpu_span_ms_per_step"] == pytest.approx(m["breakdown/span_ms_per_step"])
    assert m["kernels/gpu_idle_ms_per_step"] == pytest.approx(m["breakdown/idle_ms_per_step"])
    acts, _ = activities(traces.eager())
    assert len(figures.records.records) == len(acts) == 9
