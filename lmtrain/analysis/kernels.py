"""Kernel-time analysis of ``torch.profiler`` traces: records, categories, per-phase shares, GPU timeline, reports.

Pure functions over a Kineto Chrome trace (the JSON that ``prof.export_chrome_trace`` writes, also gzipped)
or over ``(name, phase, duration_us[, stage])`` records: no Lightning, no profiler. ``KernelShare``
captures a trace and hands it here; ``python -m lmtrain analyze kernels TRACE.json`` does the same for a
trace taken by anyone.

How kernels are assigned to phases
----------------------------------
The phases are ``record_function`` ranges named ``forward``, ``backward`` and ``optimizer`` in the trace
(``KernelShare`` opens them; any script can). Each GPU activity (``cat`` ``kernel``, ``gpu_memcpy``,
``gpu_memset``) carries a ``correlation`` id shared with the CUDA runtime or driver call that launched it
(``cudaLaunchKernel``, ``cuLaunchKernel``, ``cudaMemcpyAsync`` ...: the trace's ``ac2g`` flow arrows join
the same pair). The launch call has a CPU timestamp; the kernel belongs to the phase range whose CPU
interval contains that timestamp. Time containment, not the parent chain, is used on purpose: the
autograd engine runs CUDA backward ops on its own device thread, so backward kernels have no CPU parent
inside the ``backward`` range, yet their launches fall inside its interval. If no launch call is found
for a kernel, the CPU op whose ``External id`` the kernel carries stands in for it; activities with
neither are left out and counted. Kernels launched outside the three ranges form the phase ``outside``.
The attention stages (``attention/...`` ranges of the same thread) are found the same way; only forward
stages are used for the softmax-versus-matmul answer. In a trace without CUDA activities, CPU operator
self times stand in for kernel times.

Categories
----------
Kernels are categorized by name (``lmtrain.analysis.categories``, whose docstring has the table), never by the
phase that launched them, with one exception: work launched inside torch.optim's own ``Optimizer.step#...`` range
outside the forward and backward phases is ``optimizer`` (an optimizer without foreach or fused kernels runs
per-parameter ``aten::mul_``, ``aten::lerp_`` ... that the name rules would call elementwise). Kernels replayed
from a CUDA graph (launched by ``cudaGraphLaunch``) are exempt: the whole graphed step replays inside
``Optimizer.step``, and its GEMMs are GEMMs.

Softmax versus matmul FLOPs
---------------------------
For one score element of the (N_q x N_k) attention matrix, ``Q K^T`` costs ``2 d`` FLOPs (d = head
dim) and ``P V`` another ``2 d``. Softmax costs 5 FLOPs per element: running max, subtract, exp, sum,
divide (exp counted as one FLOP, the causal mask and the score scale not counted). So
``softmax FLOPs / matmul FLOPs = 5 / (4 d)``: 1.95 % at d = 64. The time ratio comes from the kernels
launched inside the ``attention/softmax`` range against those inside ``attention/qk_matmul`` and
``attention/pv_matmul`` (naive backend only: fused backends have no such stages).

Every metric that ``KernelShare`` logs, with its unit, is listed in its class docstring; shares are
fractions in [0, 1] everywhere (reports print them as percentages).
"""

from __future__ import annotations

import bisect
import csv
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmtrain.analysis import ceilings as roofline
from lmtrain.analysis import temporal
from lmtrain.analysis.categories import CATEGORIES, CATEGORY_LABELS, CATEGORY_RULES, categorize
from lmtrain.analysis.tables import markdown_table
from lmtrain.analysis.trace import (
    _GPU_CATS,
    _LAUNCH_CATS,
    GRAPH_PHASE,
    PHASE_RANGES,
    _Intervals,
    load_trace,
    trace_device,
)

__all__ = [
    "CATEGORIES",
    "CATEGORY_RULES",
    "PHASES",
    "GpuTimeline",
    "Interference",
    "KernelRow",
    "KernelSummary",
    "TraceAnalysis",
    "TraceRecords",
    "analyze_trace",
    "build_report",
    "category_chart",
    "gpu_timeline",
    "kernel_table_markdown",
    "load_trace",
    "write_csv",
    "categorize",
    "communication_interference",
    "exposed_communication",
    "merge_rank_metrics",
    "records_from_trace",
    "short_name",
    "softmax_matmul_flop_ratio",
    "step_comparison",
    "summarize",
]

#: Phases of a training step, in order; ``outside`` holds kernels launched outside the three ranges.
PHASES: tuple[str, ...] = ("forward", "backward", "optimizer", "outside")
#: Attention stage ranges of the naive backend (``lmtrain.attention``).
STAGE_PREFIX = "attention/"
SOFTMAX_STAGE = "attention/softmax"
MATMUL_STAGES: tuple[str, ...] = ("attention/qk_matmul", "attention/pv_matmul")
#: FLOPs per attention score element counted for softmax (max, subtract, exp, sum, divide).
SOFTMAX_FLOPS_PER_ELEMENT = 5
#: Prefix of the range torch.optim opens around every ``Optimizer.step`` (``Optimizer.step#AdamW.step``).
OPTIMIZER_STEP_PREFIX = "Optimizer.step#"

_I = re.IGNORECASE


_NAMESPACES = re.compile(r"\(anonymous namespace\)::|at::native::|at::|c10::|std::|binary_internal::|"
                         r"cutlass::|cute::|pytorch_flash::")


def short_name(name: str, width: int = 64) -> str:
    """A readable one-line kernel name: no ``void``, namespaces, ``(int)`` casts or parameter list; cut at width.

    Args:
        name: the full kernel name.
        width: longest result; longer names end in ``…``.
    """
    s = name.strip()
    s = s.removeprefix("void ")
    # Drop the trailing parameter list "(...)" of a demangled signature (not a template argument).
    if s.endswith(")"):
        depth = 0
        for i in range(len(s) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(s[i], 0)
            if depth == 0:
                if s[:i].count("<") == s[:i].count(">") and i > 0:
                    s = s[:i]
                break
    s = _NAMESPACES.sub("", s)
    s = re.sub(r"\((int|unsigned long|long|bool|char)\)", "", s)
    s = re.sub(r"\s+", " ", s)
    return s if len(s) <= width else s[: width - 1] + "…"


def softmax_matmul_flop_ratio(head_dim: int) -> float:
    """Softmax FLOPs over the FLOPs of the two attention matmuls, per score element: ``5 / (4 d)``."""
    return SOFTMAX_FLOPS_PER_ELEMENT / (4 * head_dim)


# -- pure summary -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelRow:
    """One kernel in one phase (or in the whole step): totals are per step."""

    name: str
    category: str
    calls: float  # calls per step
    total_us: float  # device time per step
    share: float  # of the phase's (or step's) kernel time

    @property
    def mean_us(self) -> float:
        return self.total_us / self.calls if self.calls else 0.0


@dataclass
class KernelSummary:
    """Tables and shares computed from kernel records; see :func:`summarize`.

    Attributes:
        steps: number of profiled steps the records cover (per-step values divide by it).
        phase_us: kernel time per step for each phase (``PHASES`` order, then any others).
        category_us: ``{"step" or phase: {category: time per step}}``.
        rows: ``{"step" or phase: [KernelRow, ...]}`` sorted by total time, largest first.
        stage_us: forward-phase time per step inside each attention stage range, by category.
    """

    steps: int
    phase_us: dict[str, float] = field(default_factory=dict)
    category_us: dict[str, dict[str, float]] = field(default_factory=dict)
    rows: dict[str, list[KernelRow]] = field(default_factory=dict)
    stage_us: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def total_us(self) -> float:
        return sum(self.phase_us.values())

    def scope_us(self, scope: str) -> float:
        """Kernel time per step of ``scope`` (``"step"`` or a phase)."""
        return self.total_us if scope == "step" else self.phase_us.get(scope, 0.0)

    def share(self, category: str, scope: str = "step") -> float | None:
        """Category's share of the scope's kernel time, or None when the scope has no kernels."""
        total = self.scope_us(scope)
        if total <= 0:
            return None
        return self.category_us.get(scope, {}).get(category, 0.0) / total

    def top(self, scope: str = "step", exclude: Sequence[str] = ()) -> KernelRow | None:
        """The largest kernel of the scope, skipping the given categories."""
        return next((r for r in self.rows.get(scope, []) if r.category not in exclude), None)

    def stage_total_us(self, stages: Iterable[str]) -> float:
        return sum(sum(self.stage_us.get(s, {}).values()) for s in stages)

    def metrics(self, head_dim: int | None = None) -> dict[str, float]:
        """The ``kernels/...`` scalars of the class docstring that this summary defines."""
        out: dict[str, float] = {"kernels/total_ms_per_step": self.total_us / 1e3}
        for phase in (*PHASES, GRAPH_PHASE):
            if self.phase_us.get(phase, 0.0) > 0:
                out[f"kernels/{phase.replace(' ', '_')}_ms_per_step"] = self.phase_us[phase] / 1e3
        for category in CATEGORIES:
            value = self.share(category)
            if value is not None:
                out[f"kernels/{category}_share_step"] = value
        for scope in ("forward", "backward", "optimizer", "step"):
            value = self.share("gemm", scope)
            if value is not None:
                out[f"kernels/gemm_share_{scope}"] = value
        for scope in ("forward", "backward", "step"):
            row = self.top(scope)
            if row is not None:
                out[f"kernels/top_kernel_share_{scope}"] = row.share
                out[f"kernels/top_kernel_calls_{scope}"] = row.calls
        if SOFTMAX_STAGE in self.stage_us or any(s in self.stage_us for s in MATMUL_STAGES):
            soft, mat = self.stage_total_us([SOFTMAX_STAGE]), self.stage_total_us(MATMUL_STAGES)
            out["kernels/attn_softmax_ms_per_step"] = soft / 1e3
            out["kernels/attn_matmul_ms_per_step"] = mat / 1e3
            if mat > 0:
                out["kernels/attn_softmax_to_matmul_time_ratio"] = soft / mat
            if head_dim:
                out["kernels/attn_softmax_to_matmul_flop_ratio"] = softmax_matmul_flop_ratio(head_dim)
        return out


def summarize(records: Iterable[Sequence[Any]], steps: int = 1) -> KernelSummary:
    """Kernel tables and shares from ``(name, phase, duration_us[, stage[, category]])`` records.

    Each record is one kernel execution (or one CPU operator's self time) with the phase that launched
    it and, optionally, the attention stage range it was launched in (``attention/softmax`` ...; None
    or "" for none) and a category that overrides the name rules (None or "": :func:`categorize` decides;
    :func:`records_from_trace` sets ``optimizer`` for everything the optimizer's own step ran). Pure: no
    profiler, no GPU; tests assert exact values.

    Args:
        records: kernel executions.
        steps: number of steps the records cover; every time and call count is divided by it.

    Returns:
        The summary; shares are fractions in [0, 1].
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    # scope -> (name, category) -> us: one name can run as the model's work and as the optimizer's
    time: dict[str, dict[tuple[str, str], float]] = defaultdict(lambda: defaultdict(float))
    calls: dict[str, dict[tuple[str, str], int]] = defaultdict(lambda: defaultdict(int))
    stage_us: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    categories: dict[str, str] = {}
    for rec in records:
        name, phase, dur = rec[0], rec[1], float(rec[2])
        stage = rec[3] if len(rec) > 3 else None
        cat = (rec[4] if len(rec) > 4 else None) or categories.get(name) or categories.setdefault(
            name, categorize(name))
        for scope in ("step", phase):
            time[scope][name, cat] += dur
            calls[scope][name, cat] += 1
        if stage and phase == "forward":
            stage_us[stage][cat] += dur / steps
    summary = KernelSummary(steps=steps)
    extra = sorted(set(time) - set(PHASES) - {"step"})
    for phase in (*PHASES, *extra):
        if phase in time:
            summary.phase_us[phase] = sum(time[phase].values()) / steps
    for scope, per_name in time.items():
        total = sum(per_name.values())
        by_cat: dict[str, float] = defaultdict(float)
        rows = []
        for (name, cat), us in per_name.items():
            by_cat[cat] += us / steps
            rows.append(KernelRow(name=name, category=cat, calls=calls[scope][name, cat] / steps,
                                  total_us=us / steps, share=us / total if total > 0 else 0.0))
        rows.sort(key=lambda r: (-r.total_us, r.name, r.category))
        summary.rows[scope] = rows
        summary.category_us[scope] = {c: by_cat[c] for c in CATEGORIES if c in by_cat}
    summary.stage_us = {s: dict(v) for s, v in stage_us.items()}
    return summary


# -- trace parsing ----------------------------------------------------------------------------------



def _self_times(ops: list[dict]) -> list[tuple[dict, float]]:
    """(event, self time us) for CPU op events: duration minus the durations of direct children, per thread."""
    out = []
    by_tid: dict[Any, list[dict]] = defaultdict(list)
    for e in ops:
        by_tid[e.get("tid")].append(e)
    for events in by_tid.values():
        events.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
        stack: list[list] = []  # [event, end, time of direct children]
        for e in events:
            ts, dur = float(e["ts"]), float(e.get("dur", 0))
            while stack and stack[-1][1] <= ts:
                done = stack.pop()
                out.append((done[0], max(0.0, float(done[0].get("dur", 0)) - done[2])))
            if stack:
                stack[-1][2] += dur
            stack.append([e, ts + dur, 0.0])
        for done in stack:
            out.append((done[0], max(0.0, float(done[0].get("dur", 0)) - done[2])))
    return out


@dataclass
class TraceRecords:
    """Records read from one profiler trace, plus step timing."""

    records: list[tuple[str, str, float, str | None, str | None]]
    steps: int
    step_wall_us: float  # mean ProfilerStep duration
    device: str  # "cuda" or "cpu"
    unattributed_kernels: int = 0  # GPU activities with no launch record in the trace (left out)
    unattributed_us: float = 0.0  # their total duration
    timeline: GpuTimeline | None = None  # busy and idle time of the GPU over the active steps (CUDA only)
    communication: dict[str, tuple[float, float]] | None = None  # exposed_communication() of the activities (CUDA)
    interference: Interference | None = None  # communication_interference() of the activities (CUDA)


@dataclass
class GpuTimeline:
    """The GPU's busy and idle time over the profiled steps, per step (from the attributed GPU activities).

    ``span_us`` runs from the start of the first activity to the end of the last; ``busy_us`` is the union of
    the activities' intervals (overlapping kernels on several streams count once); ``idle_us`` = span - busy.
    ``idle_by_phase_us`` charges each gap to the phase whose activity ends it (a gap before a forward kernel
    is time the GPU waited for the host to launch forward work). ``largest_gaps`` holds the longest gaps as
    ``(gap_us, phase, kernel before, kernel after)``, per profiled run (not per step).
    """

    span_us: float
    busy_us: float
    idle_by_phase_us: dict[str, float]
    largest_gaps: list[tuple[float, str, str, str]]

    @property
    def idle_us(self) -> float:
        return max(0.0, self.span_us - self.busy_us)


def gpu_timeline(intervals: Sequence[tuple[float, float, str, str]], steps: int = 1,
                 keep_gaps: int = 5) -> GpuTimeline | None:
    """Busy/idle time from GPU activity intervals ``(start_us, duration_us, name, phase)`` over ``steps`` steps."""
    if not intervals:
        return None
    steps = max(1, steps)
    ordered = sorted(intervals, key=lambda iv: iv[0])
    start, busy = ordered[0][0], 0.0
    cur_start, cur_end = ordered[0][0], ordered[0][0] + ordered[0][1]
    prev_name = ordered[0][2]
    idle: dict[str, float] = {}
    gaps: list[tuple[float, str, str, str]] = []
    for ts, dur, name, phase in ordered[1:]:
        if ts > cur_end:  # a gap: nothing ran between cur_end and ts
            gap = ts - cur_end
            idle[phase] = idle.get(phase, 0.0) + gap
            gaps.append((gap, phase, prev_name, name))
            busy += cur_end - cur_start
            cur_start, cur_end = ts, ts + dur
        else:
            cur_end = max(cur_end, ts + dur)
        if ts + dur >= cur_end:
            prev_name = name
    busy += cur_end - cur_start  # cur_end is now the end of the last activity to finish
    gaps.sort(key=lambda g: -g[0])
    return GpuTimeline(span_us=(cur_end - start) / steps, busy_us=busy / steps,
                       idle_by_phase_us={k: v / steps for k, v in idle.items()}, largest_gaps=gaps[:keep_gaps])


def _optimizer_category(optim: _Intervals, phase: str, t: float, tid: Any) -> str | None:
    # Lightning runs the forward and backward inside the optimizer's closure, hence inside its
    # Optimizer.step range: only work outside the forward and backward phases is the optimizer's own.
    if phase in ("forward", "backward"):
        return None
    return optim.find(t, tid)


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint (start, end) intervals covering the given ones."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _uncovered(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Total length of disjoint ``intervals`` outside the disjoint, sorted ``cover``."""
    total, j = 0.0, 0
    for start, end in intervals:
        while j < len(cover) and cover[j][1] <= start:
            j += 1
        pos, k = start, j
        while k < len(cover) and cover[k][0] < end:
            if cover[k][0] > pos:
                total += cover[k][0] - pos
            pos = max(pos, cover[k][1])
            k += 1
        total += max(0.0, end - pos)
    return total


def _role(name: str) -> str:
    """What a GPU activity is to communication overlap: ``communication`` (:func:`categorize`), ``copy`` (a memcpy
    or memset, which hides nothing) or ``compute`` (everything else)."""
    if categorize(name) == "communication":
        return "communication"
    return "copy" if re.match(r"memcpy|memset", name, _I) else "compute"


def exposed_communication(intervals: Sequence[tuple[float, float, str, str]],
                          steps: int = 1) -> dict[str, tuple[float, float]]:
    """Communication time per phase and the part of it no compute kernel overlaps (the GPU waited on it).

    Args:
        intervals: GPU activities of one GPU as ``(start_us, duration_us, name, phase)``; the names choose the
            category (:func:`categorize`). Compute is every activity that is neither communication nor a
            memcpy / memset.
        steps: steps the intervals cover (results are per step).

    Returns:
        ``{phase: (communication_us, exposed_us)}`` for the phases with communication, plus ``"step"`` for all
        of them; overlapping communication kernels count once, and ``exposed_us`` is the part of the
        communication intervals' union outside the union of all compute intervals (of every phase: compute of
        the next phase hides communication just as well).
    """
    steps = max(1, steps)
    comm: dict[str, list[tuple[float, float]]] = defaultdict(list)
    compute: list[tuple[float, float]] = []
    for start, dur, name, phase in intervals:
        role = _role(name)
        if role == "communication":
            comm[phase].append((start, start + dur))
            comm["step"].append((start, start + dur))
        elif role == "compute":
            compute.append((start, start + dur))
    cover = _union(compute)
    out = {}
    for phase, spans in comm.items():
        merged = _union(spans)
        out[phase] = (sum(e - s for s, e in merged) / steps, _uncovered(merged, cover) / steps)
    return out


@dataclass
class Interference:
    """What communication kernels cost the compute kernels that run beside them, per step.

    A compute kernel runs *beside* communication when communication kernels cover at least half of its duration,
    and *alone* when none covers any of it. Kernels are compared with their twins: the kernels of the same name,
    phase, grid and block size that ran alone (at least ``min_alone`` of them), whose median duration is what the
    kernel would have taken without communication beside it.
    """

    beside_us: float  # compute kernel time beside communication that has twins alone
    alone_us: float  # what the same kernels take at their twins' median duration
    kernels: float  # kernels beside communication with twins, per step
    unmatched_us: float  # compute kernel time beside communication without enough twins (not judged)

    @property
    def excess_us(self) -> float:
        """Compute time per step that communication beside it added (can be negative: noise, clocks)."""
        return self.beside_us - self.alone_us

    @property
    def slowdown(self) -> float | None:
        """How many times longer the kernels ran beside communication than alone (None: nothing to compare)."""
        return self.beside_us / self.alone_us if self.alone_us > 0 else None


def communication_interference(intervals: Sequence[tuple[float, float, str, str]],
                               shapes: Sequence[Any] | None = None, steps: int = 1,
                               min_alone: int = 3) -> Interference | None:
    """How much slower compute kernels run beside communication kernels than alone (:class:`Interference`).

    Overlap hides communication only if the compute beside it keeps its speed. NCCL's kernels occupy SMs and
    memory bandwidth, so a matrix multiply beside an all-gather may take longer than alone: that time is in the
    step although no communication is exposed.

    Args:
        intervals: GPU activities of one GPU as ``(start_us, duration_us, name, phase)``, as for
            :func:`exposed_communication`.
        shapes: per activity, anything that tells launches of one kernel apart beyond name and phase (the
            profiler's grid and block sizes); None: name and phase alone.
        steps: steps the intervals cover (results are per step).
        min_alone: twins alone a kernel needs to be judged.

    Returns:
        None without communication kernels, else the :class:`Interference` per step.
    """
    steps = max(1, steps)
    comm = _union((start, start + dur) for start, dur, name, _ in intervals if _role(name) == "communication")
    if not comm:
        return None
    starts = [s for s, _ in comm]
    groups: dict[Any, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for i, (start, dur, name, phase) in enumerate(intervals):
        if dur <= 0 or _role(name) != "compute":
            continue
        end, covered = start + dur, 0.0
        j = bisect.bisect_right(starts, end) - 1
        while j >= 0 and comm[j][1] > start:  # disjoint, sorted: walk back while they reach into the kernel
            covered += min(end, comm[j][1]) - max(start, comm[j][0])
            j -= 1
        alone, beside = groups[(name, phase, shapes[i] if shapes is not None else None)]
        if covered <= 0:
            alone.append(dur)
        elif covered >= 0.5 * dur:
            beside.append(dur)
    beside_us = alone_us = unmatched_us = 0.0
    kernels = 0
    for alone, beside in groups.values():
        if not beside:
            continue
        if len(alone) < min_alone:
            unmatched_us += sum(beside)
            continue
        beside_us += sum(beside)
        alone_us += statistics.median(alone) * len(beside)
        kernels += len(beside)
    return Interference(beside_us / steps, alone_us / steps, kernels / steps, unmatched_us / steps)


def records_from_trace(trace: dict, device: str = "cuda") -> TraceRecords:
    """Kernel records ``(name, phase, duration_us, stage, category)`` from a Kineto Chrome trace (``json.load``-ed).

    The category is ``optimizer`` for everything launched inside torch.optim's own ``Optimizer.step#...``
    range and outside the ``forward`` and ``backward`` phases, else None (the name rules decide). An
    optimizer without foreach or fused kernels (AdamW on CPU) runs per-parameter ``aten::mul_``,
    ``aten::lerp_``, ``aten::addcdiv_`` ... that the name rules would call elementwise.

    Args:
        trace: the trace object (``{"traceEvents": [...]}``).
        device: ``cuda`` to read GPU activities (kernels, memcpy, memset); ``cpu`` to read CPU operator
            self times instead; ``auto``: :func:`trace_device`.
    """
    if device == "auto":
        device = trace_device(trace)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    phases, stages, steps, optim = [], [], [], []
    for e in events:
        name, cat = e.get("name", ""), e.get("cat", "")
        if cat not in ("user_annotation", "cpu_op", "python_function"):
            continue
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        if name in PHASE_RANGES:
            phases.append((start, end, name, e.get("tid")))
        elif name.startswith(STAGE_PREFIX):
            stages.append((start, end, name, e.get("tid")))
        elif name.startswith("ProfilerStep#"):
            steps.append(end - start)
        elif name.startswith(OPTIMIZER_STEP_PREFIX):
            optim.append((start, end, "optimizer", e.get("tid")))
    phase_iv, stage_iv, optim_iv = _Intervals(phases), _Intervals(stages), _Intervals(optim)
    n_steps = max(1, len(steps))
    wall = sum(steps) / len(steps) if steps else 0.0
    records: list[tuple[str, str, float, str | None, str | None]] = []
    intervals: list[tuple[float, float, str, str]] = []
    shapes: list[tuple[Any, Any]] = []  # each activity's grid and block sizes (communication_interference)
    missing, missing_us = 0, 0.0
    if device == "cpu":
        ops = [e for e in events if e.get("cat") == "cpu_op"]
        for e, self_us in _self_times(ops):
            t = float(e["ts"])
            phase = phase_iv.find(t) or "outside"
            records.append((e["name"], phase, self_us, stage_iv.find(t, e.get("tid")),
                            _optimizer_category(optim_iv, phase, t, e.get("tid"))))
        return TraceRecords(records, n_steps, wall, "cpu")
    launches: dict[int, tuple[float, Any, bool]] = {}  # correlation -> (ts, tid, a graph launch)
    by_external: dict[int, tuple[float, Any, bool]] = {}
    for e in events:
        cat, args = e.get("cat", ""), e.get("args") or {}
        if cat in _LAUNCH_CATS and "correlation" in args:
            launches[int(args["correlation"])] = (float(e["ts"]), e.get("tid"), "GraphLaunch" in e.get("name", ""))
        elif cat in ("cpu_op", "user_annotation") and "External id" in args:
            by_external.setdefault(int(args["External id"]), (float(e["ts"]), e.get("tid"), False))
    # the window's end, as the temporal breakdown takes it (its activities and these records are the same ones)
    last_step_end = temporal.window_end([e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")])
    for e in events:
        if e.get("cat") not in _GPU_CATS:
            continue
        args = e.get("args") or {}
        launch = launches.get(int(args.get("correlation", -1)))
        if launch is None:
            launch = by_external.get(int(args.get("External id", -1)))
        if launch is None:  # launched before the window opened (the GPU runs behind the CPU): not ours
            missing += 1
            missing_us += float(e.get("dur", 0))
            continue
        if last_step_end is not None and launch[0] > last_step_end:
            continue  # launched after the window's last step: work of a step not profiled
        phase = phase_iv.find(launch[0]) or "outside"
        stage = stage_iv.find(launch[0], launch[1])
        graphed = launch[2] or "graph id" in args
        records.append((e.get("name", "?"), phase, float(e.get("dur", 0)), stage,
                        None if graphed else _optimizer_category(optim_iv, phase, launch[0], launch[1])))
        intervals.append((float(e["ts"]), float(e.get("dur", 0)), e.get("name", "?"), phase))
        shapes.append((str(args.get("grid")), str(args.get("block"))))
    return TraceRecords(records, n_steps, wall, "cuda", missing, missing_us, gpu_timeline(intervals, n_steps),
                        exposed_communication(intervals, n_steps),
                        communication_interference(intervals, shapes, n_steps))


def trace_metrics(summary: KernelSummary, tr: TraceRecords, head_dim: int | None = None) -> dict[str, float]:
    """Every ``kernels/...`` scalar of a trace: :meth:`KernelSummary.metrics` plus the step wall time, the busy
    share, the communication time per scope and (CUDA) the GPU timeline and the exposed communication time.
    Shares are fractions in [0, 1]."""
    metrics = summary.metrics(head_dim)
    for scope in ("step", *PHASES):
        comm_us = summary.category_us.get(scope, {}).get("communication", 0.0)
        if comm_us > 0:
            metrics[f"kernels/communication_ms_{scope}"] = comm_us / 1e3
        if tr.communication and scope in tr.communication:
            metrics[f"kernels/communication_exposed_ms_{scope}"] = tr.communication[scope][1] / 1e3
    inter = tr.interference
    if inter is not None:
        metrics["kernels/compute_beside_comm_ms_step"] = inter.beside_us / 1e3
        metrics["kernels/compute_beside_comm_unjudged_ms_step"] = inter.unmatched_us / 1e3
        if inter.slowdown is not None:  # else nothing could be compared: no figure, rather than a 0 that reads "fine"
            metrics["kernels/compute_beside_comm_slowdown"] = inter.slowdown
            metrics["kernels/compute_beside_comm_excess_ms_step"] = inter.excess_us / 1e3
    if tr.step_wall_us > 0:
        metrics["kernels/step_wall_ms"] = tr.step_wall_us / 1e3
        tl = tr.timeline
        # The union of the kernels' intervals on a GPU (kernels on several streams, NCCL beside compute, count
        # once); the CPU has no timeline: its operators' time
        busy_us = tl.busy_us if tl is not None else summary.total_us
        metrics["kernels/busy_share"] = busy_us / tr.step_wall_us
    tl = tr.timeline
    if tl is not None and tl.span_us > 0:
        metrics.update({"kernels/gpu_span_ms_per_step": tl.span_us / 1e3,
                        "kernels/gpu_busy_ms_per_step": tl.busy_us / 1e3,
                        "kernels/gpu_idle_ms_per_step": tl.idle_us / 1e3,
                        "kernels/gpu_idle_share": tl.idle_us / tl.span_us})
    return metrics


def step_comparison(metrics: dict[str, float], timer_step_ms: float | None, timer_steps: int = 0,
                    profiled_step_ms: float | None = None, profiled_steps: int = 0) -> tuple[dict[str, float], str]:
    """The profiled steps' GPU time next to a timer's step: on the unprofiled steps, and on the profiled ones.

    Three times per profiled step, from the trace: kernel busy time (union of kernel intervals), the GPU span
    (first kernel start to last kernel end of the active steps; busy + idle, by construction) and the profiled
    step's own wall time (``ProfilerStep#`` ranges, profiler overhead included). Each is set against two steps of
    the timer: its median over the steps outside every measurement window (``timer step``), and its mean over the
    very steps that were profiled (``timer, profiled steps``; a mean, as the trace's per-step values are totals
    over those steps divided by their number). How to read the ratios:

    - ``busy / timer step``: how much of an ordinary step the GPU works. Far below 1 with ``wall / timer step``
      near 1: the unprofiled steps wait for the host too (host-bound), not a misfiled kernel.
    - ``span / timer, profiled steps``: whether the trace accounts for the whole of the steps it profiled (busy +
      idle against the timer's own clock on the same steps); within a few % of 1.
    - ``wall / timer step`` (and ``timer, profiled steps / timer step``): how much the profiler slowed the profiled
      steps (its per-launch host cost); well above 1 means their idle time overstates an ordinary step's host wait.

    Args:
        metrics: a window's ``kernels/*`` metrics (:func:`trace_metrics`).
        timer_step_ms: the timer's median step in ms over the unprofiled steps (``CudaSyncTimer.summary()``),
            None without a timer or without such steps.
        timer_steps: how many steps that median is over.
        profiled_step_ms: the timer's mean step in ms over the profiled (active) steps
            (``CudaSyncTimer.step_ms``), None without a timer or without its times of every one of them.
        profiled_steps: how many steps that mean is over.

    Returns:
        ``(scalars, markdown)``: ``kernels/timer_step_ms`` and ``kernels/{busy,span,wall}_to_timer_step`` when
        ``timer_step_ms`` is given; ``kernels/timer_profiled_step_ms`` and
        ``kernels/{busy,span,wall}_to_timer_profiled`` when ``profiled_step_ms`` is (each ratio whose time
        exists); and a table of the times over both.
    """
    times = {"busy": metrics.get("kernels/gpu_busy_ms_per_step", metrics.get("kernels/total_ms_per_step")),
             "span": metrics.get("kernels/gpu_span_ms_per_step"), "wall": metrics.get("kernels/step_wall_ms")}
    scalars: dict[str, float] = {}
    for reference, tag, ratio in ((timer_step_ms, "timer_step_ms", "timer_step"),
                                  (profiled_step_ms, "timer_profiled_step_ms", "timer_profiled")):
        if reference:
            scalars[f"kernels/{tag}"] = reference
            scalars.update({f"kernels/{key}_to_{ratio}": v / reference for key, v in times.items() if v is not None})
    rows_in = [("kernel busy time", times["busy"]), ("GPU span (first kernel to last)", times["span"]),
               ("profiled step, wall time", times["wall"]),
               (f"timer step, median of {timer_steps} unprofiled steps", timer_step_ms),
               (f"timer step, mean of {profiled_steps} profiled steps", profiled_step_ms)]

    def cell(value: float | None, reference: float | None = 1.0) -> str:
        return "-" if value is None or not reference else f"{value / reference:.3f}"

    rows = [[name, cell(v), cell(v, timer_step_ms), cell(v, profiled_step_ms)] for name, v in rows_in]
    text = markdown_table(["per step", "ms", "/ timer step", "/ timer, profiled steps"], rows)
    if not timer_step_ms and not profiled_step_ms:
        text += ("\n\nNo timer step to compare with (attach CudaSyncTimer; its summary needs steps outside every "
                 "window).")
    elif not timer_step_ms:
        text += "\n\nNo unprofiled timer step to compare with (the timer's summary needs steps outside every window)."
    elif not profiled_step_ms:
        text += "\n\nThe timer did not measure every profiled step: nothing to compare with on those steps."
    else:
        text += ("\n\nbusy / timer step: the GPU's share of an ordinary step. span / timer, profiled steps: near 1 "
                 "when the trace accounts for the whole profiled step. wall / timer step: how much the profiler "
                 "slowed the profiled steps.")
    return scalars, text


@dataclass
class TraceAnalysis:
    """Everything :func:`analyze_trace` finds in one trace."""

    records: TraceRecords
    summary: KernelSummary
    metrics: dict[str, float]
    report: str
    breakdown: str = ""  # the temporal breakdown, idle split, overlap and launch statistics (Markdown)

    @property
    def cuda(self) -> bool:
        return self.records.device == "cuda"

    def tables(self, top_k: int = 15) -> dict[str, str]:
        """``{"step" or phase: Markdown table of its top kernels}`` for the scopes that have kernels."""
        return {scope: kernel_table_markdown(self.summary, scope, top_k)
                for scope in ("step", *PHASES) if self.summary.rows.get(scope)}


def merge_rank_metrics(per_rank: dict[int, dict[str, float]]) -> dict[str, float]:
    """What rank 0 logs from the ``kernels/...`` scalars of every profiling rank (rank -> :func:`trace_metrics`).

    The lowest profiling rank's scalars as they are (rank 0's when it profiles), and with several profiling ranks
    the maximum over them of the step's communication time, exposed communication time and compute time slowed
    beside communication (``kernels/communication_ms_step_max``, ``kernels/communication_exposed_ms_step_max``: the
    rank that waited longest on collectives; ``kernels/compute_beside_comm_excess_ms_step_max``) and the profiling
    rank with the most kernel time (``kernels/busiest_rank``).
    """
    if not per_rank:
        return {}
    out = dict(per_rank[min(per_rank)])
    if len(per_rank) > 1:
        for key in ("kernels/communication_ms_step", "kernels/communication_exposed_ms_step",
                    "kernels/compute_beside_comm_excess_ms_step"):
            values = [m[key] for m in per_rank.values() if key in m]
            if values:
                out[f"{key}_max"] = max(values)
        out["kernels/busiest_rank"] = float(max(sorted(per_rank),
                                                key=lambda r: per_rank[r].get("kernels/total_ms_per_step", 0.0)))
    return out


def analyze_trace(trace: dict, device: str = "auto", head_dim: int | None = None, top_k: int = 15,
                  device_name: str = "", precision: str = "", batches: str = "",
                  ceilings: dict[str, float] | None = None, model_flops_per_step: float | None = None,
                  category_flops_per_step: dict[str, float] | None = None) -> TraceAnalysis:
    """Records, summary, scalars and report of a Chrome trace: what ``KernelShare`` logs, for any trace.

    Args:
        trace: the trace object (:func:`load_trace`).
        device: ``cuda``, ``cpu`` or ``auto`` (see :func:`records_from_trace`).
        head_dim: attention head dimension for the softmax/matmul FLOP ratio.
        top_k: rows of the kernel tables.
        device_name: the device, for the report's first line.
        precision: the trainer's precision, for the report.
        batches: which steps the trace covers, for the report.
        ceilings: this GPU's ``bf16_matmul_tflops`` and ``copy_gbps`` (``lmtrain.analysis.ceilings``), for the
            ``roofline/*_of_peak`` scalars; the achieved TFLOP/s and GB/s are computed without them.
        model_flops_per_step: the model's FLOPs per step, charged to the gemm and attention kernels (``model``).
        category_flops_per_step: the model's FLOPs per step per kernel category, for a trace without operators'
            FLOPs (``lmtrain.analysis.ceilings.achieved``).
    """
    tr = records_from_trace(trace, device)

    summary = summarize(tr.records, tr.steps)
    report = build_report(summary, head_dim=head_dim, cuda=tr.device == "cuda", top_k=top_k,
                          device=device_name or ("GPU" if tr.device == "cuda" else "CPU"), precision=precision,
                          batches=batches, step_wall_ms=tr.step_wall_us / 1e3, unattributed=tr.unattributed_kernels,
                          unattributed_ms=tr.unattributed_us / 1e3, timeline=tr.timeline)
    acts, steps = temporal.activities(trace, tr.device)
    window = temporal.temporal_breakdown(acts, steps)
    launch = temporal.launch_stats(acts, window)
    metrics = trace_metrics(summary, tr, head_dim) | temporal.temporal_metrics(window, launch)
    if tr.device == "cuda":
        found = roofline.achieved(trace, tr.steps, model_flops_per_step, category_flops_per_step)
        metrics |= roofline.ceiling_metrics(found, ceilings or {})
    breakdown = temporal.temporal_text(window, launch, "GPU" if tr.device == "cuda" else "CPU")
    if tr.interference is not None and (tr.interference.beside_us or tr.interference.unmatched_us):
        breakdown += "\n\n" + interference_text(tr.interference)
    return TraceAnalysis(tr, summary, metrics, report, breakdown)


# -- presentation -----------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def kernel_table_markdown(summary: KernelSummary, scope: str = "step", top_k: int = 15) -> str:
    """Markdown table of a scope's top kernels: name, category, calls/step, ms/step, mean µs, share."""
    rows = summary.rows.get(scope, [])
    body = [[f"`{short_name(r.name)}`", CATEGORY_LABELS[r.category], f"{r.calls:g}", f"{r.total_us / 1e3:.3f}",
             f"{r.mean_us:.1f}", _pct(r.share)] for r in rows[:top_k]]
    rest = rows[top_k:]
    if rest:
        us = sum(r.total_us for r in rest)
        total = summary.scope_us(scope)
        body.append([f"({len(rest)} more kernels)", "", f"{sum(r.calls for r in rest):g}", f"{us / 1e3:.3f}", "",
                     _pct(us / total if total else None)])
    return markdown_table(["kernel", "category", "calls/step", "total ms/step", "mean µs", "share"], body)


def category_table_markdown(summary: KernelSummary) -> str:
    """Category shares per phase (columns: each phase with kernels, then the whole step)."""
    scopes = [p for p in summary.phase_us if summary.phase_us[p] > 0] + ["step"]
    header = ["category", *[f"{s} ({summary.scope_us(s) / 1e3:.2f} ms)" for s in scopes]]
    body = []
    for cat in CATEGORIES:
        if any(summary.category_us.get(s, {}).get(cat) for s in scopes):
            body.append([CATEGORY_LABELS[cat], *[_pct(summary.share(cat, s)) for s in scopes]])
    return markdown_table(header, body)


def build_report(summary: KernelSummary, head_dim: int | None = None, cuda: bool = True, top_k: int = 15,
                 device: str = "", precision: str = "", batches: str = "", step_wall_ms: float = 0.0,
                 unattributed: int = 0, unattributed_ms: float = 0.0, timeline: GpuTimeline | None = None) -> str:
    """The Markdown report answering the usual questions of a kernel profiling study (works on any summary).

    ``batches`` names the steps the trace covers (``KernelShare``: ``trainer.global_step`` of the first and
    last active step, e.g. ``5..7``).
    """
    what = "kernel" if cuda else "CPU op"
    context = ", ".join(x for x in (device, f"precision {precision}" if precision else "",
                                    f"steps {batches}" if batches else "") if x)
    lines = [f"## Where the {'GPU' if cuda else 'CPU'} time goes",
             f"{context + ', ' if context else ''}{summary.steps} profiled steps."
             + ("" if cuda else " No CUDA device: CPU operator self times stand in for kernel times."), ""]
    parts = ", ".join(f"{p} {summary.phase_us[p] / 1e3:.2f} ms" for p in summary.phase_us if summary.phase_us[p])
    line = f"**{'Kernel' if cuda else 'CPU op self'} time per step:** {summary.total_us / 1e3:.2f} ms ({parts})."
    if step_wall_ms > 0:
        # Busy is the union of the activities' intervals where a GPU timeline exists (kernels running side by side,
        # compute beside NCCL, count once, as in kernels/busy_share); the sum of self times otherwise.
        busy_us = timeline.busy_us if timeline is not None and timeline.span_us > 0 else summary.total_us
        line += (f" Wall time per profiled step: {step_wall_ms:.2f} ms, so the {'GPU' if cuda else 'CPU'} is busy "
                 f"{100 * busy_us / 1e3 / step_wall_ms:.0f}% of it (profiler overhead included).")
    if unattributed:
        line += (f" Left out: {unattributed} GPU activities ({unattributed_ms:.2f} ms in all) whose launch is not "
                 "in the trace (launched before the window).")
    lines += [line, ""]
    if timeline is not None and timeline.span_us > 0:
        lines += [timeline_text(timeline), ""]

    # (b) top kernel, forward vs full step
    top_f, top_s = summary.top("forward"), summary.top("step")
    if top_s is not None:
        lines.append("**Top kernel.** " + (
            f"Forward: `{short_name(top_f.name)}` ({CATEGORY_LABELS[top_f.category]}), {_pct(top_f.share)} of the "
            f"forward {what} time, {top_f.calls:g} calls per step. " if top_f else "No forward phase seen. ")
            + f"Full step: `{short_name(top_s.name)}` ({CATEGORY_LABELS[top_s.category]}), {_pct(top_s.share)} of "
            f"the step, {top_s.calls:g} calls per step"
            + ((" — the same kernel." if top_f.name == top_s.name else " — a different kernel from the forward's.")
               if top_f else "."))
        lines.append("")
    # (d) GEMM share
    shares = [f"{s} {_pct(summary.share('gemm', s))}" for s in ("forward", "backward", "optimizer", "step")
              if summary.scope_us(s) > 0]
    lines += [f"**GEMM share** of {what} time: " + ", ".join(shares) + ".", ""]
    # (c) non-GEMM kernels that matter in the forward pass (and the step)
    for scope in ("forward", "step"):
        notable = [r for r in summary.rows.get(scope, []) if r.category != "gemm" and r.share >= 0.01][:8]
        if notable:
            lines.append(f"**Non-GEMM {what}s with ≥ 1% of the {scope if scope == 'step' else 'forward'} time:**")
            lines.append(markdown_table(["kernel", "category", "calls/step", "share"],
                                        [[f"`{short_name(r.name)}`", CATEGORY_LABELS[r.category], f"{r.calls:g}",
                                          _pct(r.share)] for r in notable]))
            lines.append("")
    # (e) softmax vs matmul inside attention
    lines.append("**Softmax vs matmul inside attention (forward).** " + _softmax_answer(summary, head_dim, what))
    lines += ["", "**Categories per phase** (share of each phase's time):", category_table_markdown(summary), ""]
    lines += [f"**Top {what}s, full step:**", kernel_table_markdown(summary, "step", top_k)]
    return "\n".join(lines)


def interference_text(inter: Interference) -> str:
    """One paragraph: how much slower the compute beside communication ran than the same kernels alone."""
    if inter.slowdown is None:
        return (f"**Compute beside communication:** {inter.unmatched_us / 1e3:.2f} ms per step of compute ran beside "
                "communication kernels; none of those kernels also ran alone often enough to compare.")
    text = (f"**Compute beside communication:** {inter.beside_us / 1e3:.2f} ms per step ({inter.kernels:g} kernels) "
            f"ran beside communication kernels; the same kernels alone (same name, phase, grid and block) take "
            f"{inter.alone_us / 1e3:.2f} ms, so beside communication they ran {inter.slowdown:.2f}x as long: "
            f"{inter.excess_us / 1e3:+.2f} ms per step that overlap did not hide.")
    if inter.unmatched_us > 0:
        text += f" Not judged (too few twins alone): {inter.unmatched_us / 1e3:.2f} ms per step."
    return text


def timeline_text(tl: GpuTimeline) -> str:
    """One paragraph: how much of the GPU timeline ran kernels, and where the GPU waited."""
    text = (f"**GPU timeline:** {tl.span_us / 1e3:.2f} ms per step from the first kernel to the last; a kernel was "
            f"running for {tl.busy_us / 1e3:.2f} ms of it ({100 * tl.busy_us / tl.span_us:.1f}%), and the GPU "
            f"waited {tl.idle_us / 1e3:.2f} ms per step in gaps between kernels")
    phases = sorted(((p, us) for p, us in tl.idle_by_phase_us.items() if us > 0), key=lambda x: -x[1])
    if phases:
        text += " (before " + ", ".join(f"{p} kernels {us / 1e3:.2f} ms" for p, us in phases) + ")"
    text += (". Gaps mean the host did not launch work fast enough (many small kernels, Python overhead, "
             "profiler overhead inside this window) or waited for the GPU (a synchronisation).")
    if tl.largest_gaps:
        text += " Longest gaps: " + "; ".join(
            f"{gap / 1e3:.3f} ms before `{short_name(after, 40)}` ({phase}, after `{short_name(before, 40)}`)"
            for gap, phase, before, after in tl.largest_gaps[:3]) + "."
    return text


def _softmax_answer(summary: KernelSummary, head_dim: int | None, what: str) -> str:
    soft, mat = summary.stage_total_us([SOFTMAX_STAGE]), summary.stage_total_us(MATMUL_STAGES)
    if soft <= 0 and mat <= 0:
        fused = summary.share("attention", "forward")
        return ("No `attention/...` stage ranges were seen: the attention backend is not `naive` (fused kernels "
                f"have no separate softmax), so there is nothing to split; fused attention kernels take "
                f"{_pct(fused)} of the forward time. Use `model.attention: naive` to answer this question.")
    soft_core = summary.stage_us.get(SOFTMAX_STAGE, {}).get("softmax", 0.0)
    mat_core = sum(summary.stage_us.get(s, {}).get("gemm", 0.0) for s in MATMUL_STAGES)
    text = (f"`attention/softmax` range: {soft / 1e3:.3f} ms/step, of which softmax {what}s {soft_core / 1e3:.3f} ms "
            f"(the rest: causal mask, fp32 casts); `attention/qk_matmul` + `attention/pv_matmul` ranges: "
            f"{mat / 1e3:.3f} ms/step, of which GEMM {what}s {mat_core / 1e3:.3f} ms (the rest: the score scale)")
    if mat > 0:
        text += f". Time ratio softmax/matmul: {soft / mat:.2f} for the ranges"
        if mat_core > 0:
            text += f", {soft_core / mat_core:.2f} for the softmax and GEMM {what}s alone"
    if head_dim:
        flops = softmax_matmul_flop_ratio(head_dim)
        text += (f". FLOP ratio = {SOFTMAX_FLOPS_PER_ELEMENT}/(4·d) = {flops:.4f} for head dim d = {head_dim} "
                 "(5 FLOPs per score element for softmax: max, subtract, exp, sum, divide; 2·d for each matmul)")
        if mat_core > 0 and soft_core > 0:
            text += (f". Per FLOP the softmax {what}s are {soft_core / mat_core / flops:.0f}x slower than the "
                     "GEMMs: softmax is bound by memory traffic over the N×N scores, the matmuls by arithmetic")
    return text + "."


def write_csv(summary: KernelSummary, path: str) -> None:
    """Every kernel per scope (step and each phase), full names, per-step values."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["scope", "name", "short_name", "category", "calls_per_step", "total_ms_per_step", "mean_us",
                    "share_of_scope"])
        for scope in ("step", *[p for p in summary.phase_us]):
            for r in summary.rows.get(scope, []):
                w.writerow([scope, r.name, short_name(r.name), r.category, f"{r.calls:g}", f"{r.total_us / 1e3:.6f}",
                            f"{r.mean_us:.3f}", f"{r.share:.6f}"])


def category_chart(summary: KernelSummary, cuda: bool = True) -> Any:
    """Horizontal stacked bars: time per step of each phase, split by category (a matplotlib Figure)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:  # pragma: no cover - matplotlib is a dependency
        return None
    scopes = [p for p in summary.phase_us if summary.phase_us[p] > 0]
    if not scopes:
        return None
    fig = Figure(figsize=(8, 0.6 * len(scopes) + 1.6))
    ax = fig.add_subplot(1, 1, 1)
    left = [0.0] * len(scopes)
    for cat in CATEGORIES:
        widths = [summary.category_us.get(s, {}).get(cat, 0.0) / 1e3 for s in scopes]
        if any(w > 0 for w in widths):
            ax.barh(scopes, widths, left=left, label=CATEGORY_LABELS[cat])
            left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel(("kernel" if cuda else "CPU operator self") + " time per step (ms)")
    ax.legend(loc="lower right", fontsize="small", ncol=2)
    fig.tight_layout()
    return fig
