"""Where a step's time goes on the GPU's timeline: the temporal breakdown, idle split, overlap and launch statistics.

Pure functions of a ``torch.profiler`` Chrome trace (any trace: lmtrain's, or a plain script's
``prof.export_chrome_trace``), answering what HolisticTraceAnalysis (HTA 0.5, ``hta/analyzers``) answers, with the
same definitions, per trace (one profiled window) and per phase:

Window (HTA's ``include_last_profiler_step=True``)
    With two or more profiled steps (``ProfilerStep#`` ranges), an activity counts when the CPU call that launched
    it (same correlation id) is in the trace and started before the last step ended (the later end of its CPU
    range and its GPU annotation). So the GPU work still running from before the window opened (its launch is not
    in the trace) and work launched after the last step are left out. With fewer steps every activity counts.
    HTA run with its default ``include_last_profiler_step=False`` also leaves out the last step.
Temporal breakdown (HTA ``get_temporal_breakdown``)
    The span runs from the start of the window's first GPU activity (kernel, memcpy, memset) to the end of the
    last. Every instant of it is one of: *compute* (some compute kernel runs), else *communication* (an NCCL kernel
    runs), else *memory* (a memcpy / memset runs), else *idle*. So compute is the union of the compute kernels'
    intervals, and communication + memory is HTA's "non-compute" time; the four add up to the span. Kinds follow
    HTA's name patterns (``hta/utils/utils.py``): ``nccl...Kernel`` is communication, ``Memcpy...`` /
    ``Memset...`` (and any name holding ``Memcpy``) memory, everything else compute.
Phases
    An activity belongs to the phase range (``forward``, ``backward``, ``optimizer``, ``cuda graph``: see
    ``lmtrain.analysis.kernels``) in which the CPU launched it, found through the launch's correlation id; a trace
    without lmtrain's ranges has one phase, ``unknown``; activities launched outside them are ``outside``. A busy
    instant goes to the phase of an activity running then, an idle gap to the phase of the activity that ends it
    (the work the GPU waited for).
Idle split (HTA ``get_idle_time_breakdown``)
    Each idle gap is *host wait* when the CUDA runtime call that launched the activity ending the gap started after
    the gap began (the CPU had not enqueued the work yet), else *kernel wait* when the gap is shorter than
    ``kernel_wait_us`` (HTA's ``consecutive_kernel_delay``: 30 µs as HTA applies it; the overhead between queued
    kernels), else *other* (the queued work waited longer: on another stream, an event, a synchronisation). The
    kernels of a CUDA graph replay share the one ``cudaGraphLaunch`` (one correlation id), so only a gap before
    the graph's first kernel can be host wait. HTA splits each stream's gaps; :func:`idle_split` does that with
    ``per_stream=True``, and by default splits the gaps of the whole GPU, which add up to the breakdown's idle
    time. On CPU traces the "activities" are the CPU operators (nested ones included: a busy instant goes to the
    innermost operator of each thread, so an all-reduce called inside a gradient hook is communication, not the
    hook's compute; communication overlaps compute only on another thread) and every gap is host time (Python
    between operators).
Communication–computation overlap (HTA ``get_comm_comp_overlap``)
    The time both an NCCL kernel and a compute kernel run, over the communication time: the share of
    communication hidden behind compute.
Launch statistics
    Kernels per step, kernels shorter than :data:`SHORT_KERNEL_US` (10 µs), and the launch delay: kernel start
    minus the start of the ``cudaLaunchKernel`` (or driver) call with its correlation id. Kernels replayed from a
    CUDA graph share one ``cudaGraphLaunch`` and are left out of the delay statistics. A window is *launch-bound*
    when the GPU waited for the host for more than :data:`LAUNCH_BOUND_SHARE` of its span. Inside a profiled window
    the profiler's own cost per launch (a few µs) adds to the host time, so small steps read more host-bound there
    than they run.

Where lmtrain deliberately differs from HTA 0.5 (``docs/callbacks.md`` shows the size of each):

- Timestamps: HTA rounds every event of a trace with sub-µs timestamps inward to whole µs (start up, end down;
  its ``HTA_DISABLE_NS_ROUNDING`` turns that off). Each activity loses up to 2 µs and each gap gains as much, so
  on steps of many few-µs kernels (CUDA graphs) HTA reads several points more idle and more kernel wait. A
  sub-µs activity even gets a negative duration, which trips HTA's own check (``non_compute_time >= 0``) when
  it is a memset alone on the timeline. lmtrain keeps the profiler's timestamps.
- Overlapping activities on one stream (parallel branches of a CUDA graph, reported on the launch stream): HTA
  measures each gap from the previous activity's end and adds the negative "gaps" of overlaps into its split;
  lmtrain measures from the latest end so far, so an overlap is no idle time.
- Names: HTA also counts kernels whose name holds ``Sync``, and ``cuda_sync`` events that carry a stream (only
  recorded with the profiler's experimental ``enable_cuda_sync_events``), as non-compute time; lmtrain counts
  such kernels as compute and leaves synchronisation events out (they are the host waiting, not GPU work).

All results are per step (divided by the number of profiled steps, the distinct ``ProfilerStep#`` ranges of the
CPU, at least 1).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lmtrain.analysis.trace import _GPU_CATS, _LAUNCH_CATS, PHASE_RANGES, _Intervals, trace_device

__all__ = ["KINDS", "LAUNCH_BOUND_SHARE", "SHORT_KERNEL_US", "Activity", "LaunchStats", "Temporal", "activities",
           "idle_split", "launch_stats", "temporal_breakdown", "temporal_metrics", "temporal_text"]

#: Kinds of GPU time, in the order a busy instant is given to one of them.
KINDS: tuple[str, ...] = ("compute", "communication", "memory")
#: Kernels shorter than this (µs) count as short in the launch statistics.
SHORT_KERNEL_US = 10.0
#: A window whose GPU waited for the host more than this share of its span is launch-bound.
LAUNCH_BOUND_SHARE = 0.10
#: HTA's default ``consecutive_kernel_delay``: shorter gaps with the work queued are kernel waits. HTA documents it
#: in ns but compares it with the trace's timestamps, which are µs; this is what HTA computes.
KERNEL_WAIT_US = 30.0
#: HTA's name patterns (``hta/utils/utils.py``): NCCL kernels communicate, memcpy / memset / DMA move memory
#: (HTA calls a name holding ``Memcpy`` anywhere non-compute too); everything else computes. On CPU traces the
#: collectives' operators (``nccl:all_reduce``, ``gloo:...``, ``c10d::...``) communicate.
_COMM = re.compile(r"^nccl.*Kernel|^nccl:|^hccl|^gloo:|^_?c10d(_functional)?::|^record_param_comms$")
_MEMORY = re.compile(r"^(hip)?Memset|^dma|Memcpy")


@dataclass(frozen=True)
class Activity:
    """One GPU activity (or, in a CPU trace, one CPU operator) on the timeline, times in µs."""

    start: float
    end: float
    name: str
    kind: str  # one of KINDS
    stream: Any
    launch: float | None  # start of the CPU call that launched it (None: not in the trace)
    phase: str
    graphed: bool = False  # replayed from a CUDA graph (one launch for all its kernels)
    nested: bool = False  # a CPU operator: operators nest on their thread, and the innermost one is what runs


def kind_of(name: str) -> str:
    """``communication``, ``memory`` or ``compute`` for an activity name (HTA's patterns)."""
    return "communication" if _COMM.search(name) else "memory" if _MEMORY.search(name) else "compute"


def activities(trace: dict, device: str = "auto") -> tuple[list[Activity], int]:
    """The activities of a trace and the number of profiled steps (``ProfilerStep#`` ranges, at least 1).

    Args:
        trace: a Chrome trace (``lmtrain.analysis.kernels.load_trace``).
        device: ``cuda`` (GPU activities), ``cpu`` (CPU operators) or ``auto`` (cuda when there are any).
    """
    device = trace_device(trace) if device == "auto" else device
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    ranges = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"], e.get("tid")) for e in events
              if e.get("cat") in ("user_annotation", "cpu_op") and e.get("name") in PHASE_RANGES]
    step_events = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    # the GPU annotation of a step carries the step's name too: count the CPU's ranges
    steps = max(1, len({e["name"] for e in step_events if e.get("cat") in ("user_annotation", "cpu_op")}))
    phases = _Intervals(ranges)

    def phase(t: float | None) -> str:
        if not ranges:
            return "unknown"
        return (phases.find(t) if t is not None else None) or "outside"

    out: list[Activity] = []
    if device == "cpu":
        for e in (e for e in events if e.get("cat") == "cpu_op"):
            ts = float(e["ts"])
            out.append(Activity(ts, ts + float(e.get("dur", 0)), e["name"], kind_of(e["name"]), e.get("tid"), ts,
                                phase(ts), nested=True))
        return out, steps
    launches = {int(e["args"]["correlation"]): (float(e["ts"]), "GraphLaunch" in e.get("name", ""))
                for e in events if e.get("cat") in _LAUNCH_CATS and "correlation" in (e.get("args") or {})}
    last_step_end = window_end(step_events)
    for e in events:
        if e.get("cat") not in _GPU_CATS:
            continue
        args = e.get("args") or {}
        launch, graphed = launches.get(int(args.get("correlation", -1)), (None, False))
        if last_step_end is not None and (launch is None or launch > last_step_end):
            continue  # outside the window: still running from before it, or launched after its last step
        ts = float(e["ts"])
        # a negative duration (no profiler writes one; a trace rounded to whole µs can hold one) is an instant
        out.append(Activity(ts, ts + max(0.0, float(e.get("dur", 0))), e.get("name", "?"), kind_of(e.get("name", "")),
                            args.get("stream", e.get("tid")), launch, phase(launch), graphed or "graph id" in args))
    return out, steps


def window_end(step_events: Sequence[dict]) -> float | None:
    """The end of the window's last step (its CPU range or its GPU annotation, whichever ends later), or None when
    the trace has fewer than two steps (then, as in HTA, the window is the whole trace)."""
    if len({e["name"] for e in step_events}) < 2:
        return None
    return max(float(e["ts"]) + float(e.get("dur", 0)) for e in step_events)


@dataclass
class Temporal:
    """The temporal breakdown of one window, per step (µs); see the module docstring."""

    steps: int
    span_us: float = 0.0
    kind_us: dict[str, float] = field(default_factory=dict)  # compute / communication / memory / idle
    by_phase: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> the same four
    idle_us: dict[str, float] = field(default_factory=dict)  # host_wait / kernel_wait / other
    idle_stream_us: dict[str, float] = field(default_factory=dict)  # the same summed over streams (HTA's split)
    communication_us: float = 0.0  # union of the communication kernels (overlapped or not)
    overlap_us: float = 0.0  # communication and compute at once

    @property
    def overlap_share(self) -> float | None:
        """Communication time hidden behind compute, as a fraction of the communication time (None without any)."""
        return self.overlap_us / self.communication_us if self.communication_us > 0 else None

    def share(self, kind: str) -> float:
        return self.kind_us.get(kind, 0.0) / self.span_us if self.span_us > 0 else 0.0


def temporal_breakdown(acts: Sequence[Activity], steps: int = 1,
                       kernel_wait_us: float = KERNEL_WAIT_US) -> Temporal:
    """Compute / communication / memory / idle time over the span, per phase, the idle split and the overlap.

    A sweep over the activities' start and end points: between two consecutive points the GPU is in one state.
    """
    steps = max(1, steps)
    out = Temporal(steps=steps, kind_us=dict.fromkeys((*KINDS, "idle"), 0.0))
    if not acts:
        return out
    points = sorted({a.start for a in acts} | {a.end for a in acts})
    nested = any(a.nested for a in acts)
    starts, ends = defaultdict(list), defaultdict(list)
    for a in acts:
        starts[a.start].append(a)
        ends[a.end].append(a)
    running: dict[str, dict[int, Activity]] = {k: {} for k in KINDS}
    by_phase: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys((*KINDS, "idle"), 0.0))
    for t0, t1 in zip(points, points[1:], strict=False):
        for a in ends[t0]:
            running[a.kind].pop(id(a), None)
        for a in starts[t0]:
            if a.end > a.start:
                running[a.kind][id(a)] = a
        dt = t1 - t0
        now = _innermost(running) if nested else running
        if now["communication"]:
            out.communication_us += dt
            if now["compute"]:
                out.overlap_us += dt
        kind = next((k for k in KINDS if now[k]), None)
        if kind is not None:
            out.kind_us[kind] += dt
            by_phase[next(reversed(now[kind].values())).phase][kind] += dt  # the innermost (latest) one
        else:  # idle: charged to the work that ends the gap
            nxt = min(starts[t1], key=lambda a: (a.launch is None, a.launch or 0.0))
            out.kind_us["idle"] += dt
            by_phase[nxt.phase]["idle"] += dt
    out.span_us = points[-1] - points[0]
    out.idle_us = idle_split(acts, kernel_wait_us=kernel_wait_us)
    out.idle_stream_us = idle_split(acts, per_stream=True, kernel_wait_us=kernel_wait_us)
    out.span_us /= steps
    out.communication_us /= steps
    out.overlap_us /= steps
    out.kind_us = {k: v / steps for k, v in out.kind_us.items()}
    out.by_phase = {p: {k: v / steps for k, v in d.items()} for p, d in by_phase.items()}
    out.idle_us = {k: v / steps for k, v in out.idle_us.items()}
    out.idle_stream_us = {k: v / steps for k, v in out.idle_stream_us.items()}
    return out


def _innermost(running: dict[str, dict[int, Activity]]) -> dict[str, dict[int, Activity]]:
    """Of nested CPU operators, only the innermost of each thread runs: its latest-started one (of those started
    together, the shorter). ``running`` and the result map each kind to its activities (in start order)."""
    inner: dict[Any, Activity] = {}
    for acts in running.values():
        for a in acts.values():
            held = inner.get(a.stream)
            if held is None or (a.start, -a.end) > (held.start, -held.end):
                inner[a.stream] = a
    out: dict[str, dict[int, Activity]] = {k: {} for k in running}
    for a in sorted(inner.values(), key=lambda a: a.start):
        out[a.kind][id(a)] = a
    return out


def idle_split(acts: Sequence[Activity], per_stream: bool = False,
               kernel_wait_us: float = KERNEL_WAIT_US) -> dict[str, float]:
    """Idle time split into ``host_wait``, ``kernel_wait`` and ``other`` (µs, whole window; module docstring).

    Args:
        acts: the window's activities.
        per_stream: split each stream's gaps and add them up (HTA's way) instead of the gaps of the whole GPU.
        kernel_wait_us: gaps shorter than this, with the work already launched, are kernel waits.
    """
    out = {"host_wait": 0.0, "kernel_wait": 0.0, "other": 0.0}
    groups: dict[Any, list[Activity]] = defaultdict(list)
    for a in acts:
        groups[a.stream if per_stream else None].append(a)
    for group in groups.values():
        group = sorted(group, key=lambda a: (a.start, a.launch is None, a.launch or 0.0))
        busy_until = group[0].end
        for a in group[1:]:
            if a.start > busy_until:
                gap = a.start - busy_until
                if a.launch is not None and a.launch > busy_until:
                    out["host_wait"] += gap
                elif gap < kernel_wait_us:
                    out["kernel_wait"] += gap
                else:
                    out["other"] += gap
            busy_until = max(busy_until, a.end)
    return out


@dataclass
class LaunchStats:
    """Kernel launch statistics of one window (see the module docstring)."""

    kernels_per_step: float
    short_per_step: float  # kernels under SHORT_KERNEL_US
    delays_us: list[float]  # kernel start - launch call start, eagerly launched kernels
    host_wait_share: float  # idle time waiting for the host / span
    launch_bound: bool

    @property
    def short_share(self) -> float:
        return self.short_per_step / self.kernels_per_step if self.kernels_per_step else 0.0

    def delay(self, q: float) -> float | None:
        """The ``q`` quantile of the launch delays (0.5: the median, else the nearest rank), or None without any."""
        if not self.delays_us:
            return None
        if q == 0.5:
            return statistics.median(self.delays_us)
        values = sorted(self.delays_us)
        return values[max(0, math.ceil(q * len(values)) - 1)]


def launch_stats(acts: Sequence[Activity], temporal: Temporal) -> LaunchStats:
    """Kernels per step, short kernels, launch delays and whether the window is launch-bound."""
    kernels = [a for a in acts if a.kind != "memory"]
    delays = [a.start - a.launch for a in kernels if a.launch is not None and not a.graphed]
    host = temporal.idle_us.get("host_wait", 0.0) / temporal.span_us if temporal.span_us > 0 else 0.0
    return LaunchStats(kernels_per_step=len(kernels) / temporal.steps,
                       short_per_step=sum(1 for a in kernels if a.end - a.start < SHORT_KERNEL_US) / temporal.steps,
                       delays_us=delays, host_wait_share=host, launch_bound=host > LAUNCH_BOUND_SHARE)


def _key(phase: str) -> str:
    return phase.replace(" ", "_")


def temporal_metrics(t: Temporal, launch: LaunchStats) -> dict[str, float]:
    """The ``breakdown/``, ``idle/`` and ``launch/`` scalars (names and units in ``KernelShare``'s docstring)."""
    if t.span_us <= 0:
        return {}
    out = {"breakdown/span_ms_per_step": t.span_us / 1e3}
    for kind in (*KINDS, "idle"):
        out[f"breakdown/{kind}_ms_per_step"] = t.kind_us.get(kind, 0.0) / 1e3
        out[f"breakdown/{kind}_share"] = t.share(kind)
        for phase, values in t.by_phase.items():
            if values.get(kind, 0.0) > 0:
                out[f"breakdown/{_key(phase)}_{kind}_ms_per_step"] = values[kind] / 1e3
    if t.overlap_share is not None:
        out["breakdown/comm_overlap_share"] = t.overlap_share
    idle = sum(t.idle_us.values())
    for name, us in t.idle_us.items():
        out[f"idle/{name}_ms_per_step"] = us / 1e3
        if idle > 0:
            out[f"idle/{name}_share"] = us / idle
    out.update({"launch/kernels_per_step": launch.kernels_per_step, "launch/short_kernels_per_step":
                launch.short_per_step, "launch/short_kernel_share": launch.short_share,
                "launch/host_wait_share": launch.host_wait_share, "launch/bound": float(launch.launch_bound)})
    for q, name in ((0.5, "median"), (0.9, "p90")):
        value = launch.delay(q)
        if value is not None:
            out[f"launch/delay_{name}_us"] = value
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _split_text(idle_us: dict[str, float]) -> str:
    total = sum(idle_us.values())
    return ", ".join(f"{k.replace('_', ' ')} {_pct(v / total if total else None)}" for k, v in idle_us.items())


def temporal_text(t: Temporal, launch: LaunchStats, what: str = "GPU") -> str:
    """Markdown: the breakdown per phase, the idle split, the overlap and the launch statistics."""
    from lmtrain.analysis.tables import markdown_table

    if t.span_us <= 0:
        return f"**Temporal breakdown:** no {what} activity in the trace."
    cols = [*KINDS, "idle"]
    rows = [[p, *[f"{v.get(k, 0.0) / 1e3:.3f}" for k in cols]] for p, v in sorted(t.by_phase.items())]
    rows.append(["**window**", *[f"{t.kind_us.get(k, 0.0) / 1e3:.3f} ({_pct(t.share(k))})" for k in cols]])
    idle = sum(t.idle_us.values())
    split = _split_text(t.idle_us)
    median, p90 = launch.delay(0.5), launch.delay(0.9)
    lines = [f"**Temporal breakdown** ({what} timeline, ms per step; span {t.span_us / 1e3:.3f} ms):", "",
             markdown_table(["phase", *cols], rows), "",
             f"**Idle split** ({idle / 1e3:.3f} ms per step): {split}; each stream's gaps summed (HTA's split): "
             f"{_split_text(t.idle_stream_us)}.",
             f"**Communication hidden behind compute:** {_pct(t.overlap_share)}"
             + ("" if t.overlap_share is not None else " (no communication)") + ".",
             f"**Launches:** {launch.kernels_per_step:g} kernels per step, {launch.short_per_step:g} under "
             f"{SHORT_KERNEL_US:g} µs ({_pct(launch.short_share)}); launch delay median "
             + ("-" if median is None else f"{median:.1f} µs") + ", p90 " + ("-" if p90 is None else f"{p90:.1f} µs")
             + f"; the {what} waited for the host {_pct(launch.host_wait_share)} of the span: "
             + ("**launch-bound**" if launch.launch_bound else "not launch-bound")
             + f" (threshold {_pct(LAUNCH_BOUND_SHARE)})."]
    return "\n".join(lines)

