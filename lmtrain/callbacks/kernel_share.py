"""KernelShare: where the GPU time goes, per kernel, per category and per phase, from ``torch.profiler``.

The callback profiles a window of training steps (``wait`` steps skipped, ``warmup`` steps profiled and
discarded, ``active`` steps kept) and turns the trace into the tables people otherwise read off Nsight
Systems' "CUDA GPU Kernel Summary": every kernel (and memcpy / memset) with its calls, total and mean
device time and share of the kernel time, grouped into categories and split by phase (forward,
backward, optimizer). On a machine without CUDA it reports CPU operator self time instead.

How kernels are assigned to phases
----------------------------------
While the window is open the callback wraps each training step's phases in ``record_function`` ranges
named ``forward`` (``on_train_batch_start`` -> ``on_before_backward``), ``backward``
(``on_before_backward`` -> ``on_after_backward``) and ``optimizer`` (``on_before_optimizer_step`` ->
``on_train_batch_end``), and switches on ``lmtrain.annotate``'s profiler ranges (for example the naive
attention's ``attention/qk_matmul``, ``attention/softmax``, ``attention/pv_matmul``).

After the window the profiler's Chrome trace (Kineto's JSON, written the same way by torch 2.11 and
2.13) is read. Each GPU activity (``cat`` ``kernel``, ``gpu_memcpy``, ``gpu_memset``) carries a
``correlation`` id shared with the CUDA runtime or driver call that launched it (``cudaLaunchKernel``,
``cuLaunchKernel``, ``cudaMemcpyAsync`` ...: the trace's ``ac2g`` flow arrows join the same pair). The
launch call has a CPU timestamp; the kernel belongs to the phase range whose CPU interval contains that
timestamp. The GPU runs behind the CPU, so the callback synchronises the device when the active steps
start and before they end: the trace then holds exactly the kernels launched in the active steps (any
activity whose launch is not in the trace is left out and counted in the report).

Time containment, not the parent chain of ``prof.events()``, is used on purpose: the
autograd engine runs CUDA backward ops on its own device thread, so backward kernels have no CPU parent
inside the ``backward`` range (which lives on the main thread, blocked in ``loss.backward()`` while the
device thread works), yet their launches fall inside its interval. If no launch call is found for a
kernel, the CPU op whose ``External id`` the kernel carries stands in for it. Kernels launched outside
the three ranges (the batch's host-to-device copy, logging, a validation loop inside the window) form
the phase ``outside``. The attention stages are found the same way (launch inside an ``attention/...``
range of the same thread); only forward stages are used for the softmax-versus-matmul answer.

Kernel categories
-----------------
``CATEGORY_RULES`` is an ordered list of (category, regex); the first regex that matches a kernel
(or CPU operator) name decides its category, and names no rule matches are ``other``. The order
matters: fused attention kernels mention ``cutlass`` and must be caught before GEMMs; torch.compile's
``triton_poi_fused__to_copy_...`` kernels are fused elementwise work, caught before the copy rule.

==============  ====================================================================================
category        what falls in it
==============  ====================================================================================
attention       fused attention: FlashAttention (``flash_fwd_kernel``, ``pytorch_flash::...``),
                cuDNN SDPA (``cudnn_generated_fort_native_sdpa_...``), memory-efficient attention
                (``fmha_cutlassF...``), lmtrain's Triton kernels (``_fwd_kernel``, ``_bwd_dq_kernel``,
                ``_bwd_dkdv_kernel``) and Triton-style ``_attn_fwd``/``_attn_bwd...``, ``aten::_scaled_dot_product...``
gemm            cuBLAS / cuBLASLt / CUTLASS matrix products (``sm90_xmma_gemm_...``, ``nvjet_...``,
                ``ampere_sgemm_...``, ``cutlass::Kernel2<cutlass_80_wmma_tensorop...>``, gemv,
                cuBLASLt's split-K reduction), compiled ``triton_tem_...mm`` templates, ``aten::mm`` ...
softmax         softmax and log-softmax forward and backward, the attention's and the loss's
                (``cunn_SoftMaxForward``, ``softmax_warp_forward``, ``triton_per_fused__softmax...``)
optimizer       multi-tensor (foreach) and fused optimizer kernels (``multi_tensor_apply_kernel``,
                ``fused_adamw``, ``FusedAdamMathFunctor``), ``aten::_foreach_*``, ``aten::_fused_adamw_``
elementwise     torch.compile pointwise kernels (``triton_poi_...``), ATen elementwise kernels
                (``vectorized_elementwise_kernel``, ``elementwise_kernel``, ``unrolled_elementwise_kernel``
                that do arithmetic), activations, masks, ``aten::add``, ``aten::mul`` ...
reduction       torch.compile reductions (``triton_red_...``, ``triton_per_...``), ``reduce_kernel``,
                norms, the loss's NLL (``cunn_ClassNLLCriterion...``, ``nll_loss...``), ``aten::sum`` ...
copy            data movement: ``Memcpy``/``Memset``, copy and cast kernels (``direct_copy_kernel``,
                ``..._copy_kernel``), ``cat``/``stack``, index gathers and scatters (the embedding's
                ``indexSelectLargeIndex``, ``embedding_backward...``), ``aten::copy_``, ``aten::to`` ...
other           everything else
==============  ====================================================================================

Softmax versus matmul FLOPs
---------------------------
For one score element of the (N_q x N_k) attention matrix, ``Q K^T`` costs ``2 d`` FLOPs (d = head
dim) and ``P V`` another ``2 d``. Softmax costs 5 FLOPs per element: running max, subtract, exp, sum,
divide (exp counted as one FLOP, the causal mask and the score scale not counted). So
``softmax FLOPs / matmul FLOPs = 5 / (4 d)``: 1.95 % at d = 64. The time ratio comes from the kernels
launched inside the ``attention/softmax`` range against those inside ``attention/qk_matmul`` and
``attention/pv_matmul`` (naive backend only: fused backends have no such stages).

Every metric the callback logs, with its unit, is listed in the docstring of :class:`KernelShare`.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import re
import shutil
import tempfile
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lmtrain.annotate import disable_ranges, enable_ranges
from lmtrain.callbacks._common import (
    StepWindow,
    WarnOnce,
    check_int,
    log_dir,
    log_image,
    log_scalars,
    log_text,
    markdown_table,
)

__all__ = [
    "CATEGORIES",
    "CATEGORY_RULES",
    "PHASES",
    "KernelRow",
    "KernelShare",
    "KernelSummary",
    "categorize",
    "records_from_trace",
    "short_name",
    "softmax_matmul_flop_ratio",
    "summarize",
]

#: Phases of a training step, in order; ``outside`` holds kernels launched outside the three ranges.
PHASES: tuple[str, ...] = ("forward", "backward", "optimizer", "outside")
#: Range names that open a phase (``record_function`` names, also the NVTX convention of the project).
PHASE_RANGES: tuple[str, ...] = ("forward", "backward", "optimizer")
#: Kernel categories, in report order.
CATEGORIES: tuple[str, ...] = ("gemm", "attention", "softmax", "elementwise", "reduction", "optimizer", "copy",
                               "other")
#: Display names of the categories.
CATEGORY_LABELS: dict[str, str] = {
    "gemm": "GEMM", "attention": "attention", "softmax": "softmax", "elementwise": "elementwise",
    "reduction": "reduction", "optimizer": "optimizer", "copy": "copy/cast", "other": "other",
}
#: Attention stage ranges of the naive backend (``lmtrain.attention``).
STAGE_PREFIX = "attention/"
SOFTMAX_STAGE = "attention/softmax"
MATMUL_STAGES: tuple[str, ...] = ("attention/qk_matmul", "attention/pv_matmul")
#: FLOPs per attention score element counted for softmax (max, subtract, exp, sum, divide).
SOFTMAX_FLOPS_PER_ELEMENT = 5

_I = re.IGNORECASE
#: Ordered (category, pattern) rules; the first match wins. See the module docstring for the reasons.
CATEGORY_RULES: list[tuple[str, re.Pattern[str]]] = [
    # Fused attention. Before GEMM: FlashAttention-3 and xformers kernels mention cutlass.
    ("attention", re.compile(r"flash|fmha|_sdpa_|native_sdpa|scaled_dot_product|efficient_attention|"
                             r"attention|_attn_(fwd|bwd)|^_(fwd|bwd_dq|bwd_dkdv|bwd_preprocess)_kernel$|"
                             r"cudnn::fusion::(compute_dot_do_o|convert_dq)", _I)),
    # Matrix products: cuBLAS(Lt) / CUTLASS / cuDNN tensor-core and SIMT kernels, compiled mm templates.
    ("gemm", re.compile(r"gemm|gemv|xmma|nvjet|cutlass|wgmma|hmma|_tensorop_|splitKreduce|"
                        r"[sh](884|1688|16816)|^triton_tem_|cublas|^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|"
                        r"linear|_addmm_activation|addmv|mv|dot)$", _I)),
    ("softmax", re.compile(r"softmax", _I)),
    ("optimizer", re.compile(r"multi_tensor_apply|fused_adam|fusedadam|adamw?_?math|fused_sgd|_foreach_|"
                             r"^aten::_fused_", _I)),
    # torch.compile (Inductor) kernels, by prefix: pointwise, reduction, persistent reduction.
    ("elementwise", re.compile(r"^triton_poi_")),
    ("reduction", re.compile(r"^triton_(red|per)_")),
    ("copy", re.compile(r"^memcpy|^memset|copy|catarraybatched|^aten::(cat|stack|to|_to_copy|clone|contiguous|"
                        r"index_select|embedding|embedding_dense_backward|index|index_put_|gather|scatter|"
                        r"scatter_add_|repeat)$|"
                        r"index_?select|indexselect|embedding|index_elementwise|indexing_backward|gather|scatter|"
                        r"compute_grad_weight|sum_and_scatter|krn_partials|_to_copy", _I)),
    ("reduction", re.compile(r"reduce|reduction|welford|norm(?!al)|nll|criterion|cross_entropy|argmax|argmin|cumsum|"
                             r"^aten::(sum|mean|max|min|amax|amin|var|std|prod|all|any|logsumexp)$", _I)),
    ("elementwise", re.compile(r"elementwise|pointwise|functor|silu|gelu|relu|sigmoid|tanh|log|sqrt|"
                               r"triu|tril|where|masked|fill|neg|pow|sin|cos|clamp|dropout|exp(?!and)|"
                               r"^aten::(add|add_|sub|sub_|mul|mul_|div|div_|lerp_|addcmul_|addcdiv_|abs|sign|"
                               r"maximum|minimum|ge|gt|le|lt|eq|ne|bitwise_not|logical_not|reciprocal|"
                               r"threshold_backward|unsqueeze_copy)$", _I)),
]


def categorize(kernel_name: str) -> str:
    """Category of a CUDA kernel or CPU operator name by the first matching rule of ``CATEGORY_RULES``.

    Args:
        kernel_name: the kernel's full (demangled) name as the profiler reports it, or an ``aten::`` op.

    Returns:
        One of ``CATEGORIES``.
    """
    for category, pattern in CATEGORY_RULES:
        if pattern.search(kernel_name):
            return category
    return "other"


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
        for phase in PHASES:
            if self.phase_us.get(phase, 0.0) > 0:
                out[f"kernels/{phase}_ms_per_step"] = self.phase_us[phase] / 1e3
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
    """Kernel tables and shares from ``(name, phase, duration_us[, stage])`` records.

    Each record is one kernel execution (or one CPU operator's self time) with the phase that launched
    it and, optionally, the attention stage range it was launched in (``attention/softmax`` ...; None
    or "" for none). Pure: no profiler, no GPU; tests assert exact values.

    Args:
        records: kernel executions.
        steps: number of steps the records cover; every time and call count is divided by it.

    Returns:
        The summary; shares are fractions in [0, 1].
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    time: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # scope -> name -> us
    calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    stage_us: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    categories: dict[str, str] = {}
    for rec in records:
        name, phase, dur = rec[0], rec[1], float(rec[2])
        stage = rec[3] if len(rec) > 3 else None
        cat = categories.get(name) or categories.setdefault(name, categorize(name))
        for scope in ("step", phase):
            time[scope][name] += dur
            calls[scope][name] += 1
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
        for name, us in per_name.items():
            by_cat[categories[name]] += us / steps
            rows.append(KernelRow(name=name, category=categories[name], calls=calls[scope][name] / steps,
                                  total_us=us / steps, share=us / total if total > 0 else 0.0))
        rows.sort(key=lambda r: (-r.total_us, r.name))
        summary.rows[scope] = rows
        summary.category_us[scope] = {c: by_cat[c] for c in CATEGORIES if c in by_cat}
    summary.stage_us = {s: dict(v) for s, v in stage_us.items()}
    return summary


# -- trace parsing ----------------------------------------------------------------------------------

_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver", "runtime", "driver")


class _Intervals:
    """Named CPU intervals; ``find(t)`` returns the latest-starting one that contains t (the innermost)."""

    _LOOKBACK = 64  # intervals scanned backwards: enough for nesting, duplicates and other threads' ranges

    def __init__(self, items: Iterable[tuple[float, float, str, Any]]) -> None:
        self.items = sorted(items, key=lambda x: (x[0], -x[1]))
        self.starts = [it[0] for it in self.items]

    def find(self, t: float, tid: Any = None) -> str | None:
        i = bisect_right(self.starts, t) - 1
        for j in range(i, max(-1, i - self._LOOKBACK), -1):
            start, end, name, itid = self.items[j]
            if t <= end and (tid is None or itid == tid):
                return name
        return None


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

    records: list[tuple[str, str, float, str | None]]
    steps: int
    step_wall_us: float  # mean ProfilerStep duration
    device: str  # "cuda" or "cpu"
    unattributed_kernels: int = 0  # GPU activities with no launch record in the trace (left out)
    unattributed_us: float = 0.0  # their total duration
    timeline: GpuTimeline | None = None  # busy and idle time of the GPU over the active steps (CUDA only)


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


def records_from_trace(trace: dict, device: str = "cuda") -> TraceRecords:
    """Kernel records ``(name, phase, duration_us, stage)`` from a Kineto Chrome trace (``json.load``-ed).

    Args:
        trace: the trace object (``{"traceEvents": [...]}``).
        device: ``cuda`` to read GPU activities (kernels, memcpy, memset); ``cpu`` to read CPU operator
            self times instead.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    phases, stages, steps = [], [], []
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
    phase_iv, stage_iv = _Intervals(phases), _Intervals(stages)
    n_steps = max(1, len(steps))
    wall = sum(steps) / len(steps) if steps else 0.0
    records: list[tuple[str, str, float, str | None]] = []
    intervals: list[tuple[float, float, str, str]] = []
    missing, missing_us = 0, 0.0
    if device == "cpu":
        ops = [e for e in events if e.get("cat") == "cpu_op"]
        for e, self_us in _self_times(ops):
            t = float(e["ts"])
            records.append((e["name"], phase_iv.find(t) or "outside", self_us, stage_iv.find(t, e.get("tid"))))
        return TraceRecords(records, n_steps, wall, "cpu")
    launches: dict[int, tuple[float, Any]] = {}
    by_external: dict[int, tuple[float, Any]] = {}
    for e in events:
        cat, args = e.get("cat", ""), e.get("args") or {}
        if cat in _LAUNCH_CATS and "correlation" in args:
            launches[int(args["correlation"])] = (float(e["ts"]), e.get("tid"))
        elif cat in ("cpu_op", "user_annotation") and "External id" in args:
            by_external.setdefault(int(args["External id"]), (float(e["ts"]), e.get("tid")))
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
        phase = phase_iv.find(launch[0]) or "outside"
        stage = stage_iv.find(launch[0], launch[1])
        records.append((e.get("name", "?"), phase, float(e.get("dur", 0)), stage))
        intervals.append((float(e["ts"]), float(e.get("dur", 0)), e.get("name", "?"), phase))
    return TraceRecords(records, n_steps, wall, "cuda", missing, missing_us, gpu_timeline(intervals, n_steps))


# -- the callback -----------------------------------------------------------------------------------


def request_cupti_teardown() -> bool:
    """Ask Kineto to tear CUPTI down when the profiler stops (``TEARDOWN_CUPTI=1``), unless the variable is set.

    Returns whether this call set it. Kineto reads the variable when a trace stops, so it must be set before.
    """
    if "TEARDOWN_CUPTI" in os.environ:
        return False
    os.environ["TEARDOWN_CUPTI"] = "1"
    return True


class KernelShare(Callback):
    """Profile a window of training steps and report where the kernel time goes (see the module docstring).

    The window is training batches ``wait`` .. ``wait + warmup + active - 1`` (counted from 0 at the start
    of the fit). Before and after it the callback costs nothing (no profiler, no ranges, no hooks, no
    device synchronisation); inside it the profiler slows steps down. After the window, NVIDIA's CUPTI
    (the library the profiler records kernels with) stays attached to the process unless it is torn down,
    and every later kernel launch pays for it (2.7B bf16 on an H100: +3.8% per step for the rest of the
    run). ``release_cupti`` (default on) has the profiler tear it down when the window closes.

    Metrics (TensorBoard scalars, all at the trainer's global step when the window closes; per-step values
    are means over the active steps; phases: forward, backward, optimizer, outside; on CPU every "kernel"
    value is CPU operator self time):

        kernels/total_ms_per_step                   ms: kernel device time per step (memcpy / memset included)
        kernels/{phase}_ms_per_step                 ms: kernel time per step launched in that phase
        kernels/{category}_share_step               fraction in [0, 1]: category's share of the step's kernel
                                                    time, for gemm, attention, softmax, elementwise,
                                                    reduction, optimizer, copy, other
        kernels/gemm_share_forward                  fraction: GEMM share of the forward phase's kernel time
        kernels/gemm_share_backward                 fraction: same for backward
        kernels/gemm_share_optimizer                fraction: same for the optimizer phase
        kernels/gemm_share_step                     fraction: same for the whole step (= the category share)
        kernels/top_kernel_share_forward            fraction: the forward phase's top kernel (by total time)
        kernels/top_kernel_share_backward           fraction: same for backward
        kernels/top_kernel_share_step               fraction: same for the whole step
        kernels/top_kernel_calls_forward            calls per step of the forward phase's top kernel
        kernels/top_kernel_calls_backward           calls per step: same for backward
        kernels/top_kernel_calls_step               calls per step of the step's top kernel (all phases)
        kernels/attn_softmax_ms_per_step            ms: forward kernel time inside ``attention/softmax`` ranges
        kernels/attn_matmul_ms_per_step             ms: forward kernel time inside ``attention/qk_matmul`` and
                                                    ``attention/pv_matmul`` ranges
        kernels/attn_softmax_to_matmul_time_ratio   ratio (no unit): the two above divided
        kernels/attn_softmax_to_matmul_flop_ratio   ratio (no unit): 5 / (4 head_dim), when head_dim is known
        kernels/step_wall_ms                        ms: mean wall time of the profiled steps (``ProfilerStep#``
                                                    ranges, profiler overhead included)
        kernels/busy_share                          fraction: total_ms_per_step / step_wall_ms
        kernels/gpu_span_ms_per_step                ms: GPU timeline from the first kernel of the active steps
                                                    to the last, per step (CUDA only)
        kernels/gpu_busy_ms_per_step                ms: time per step with at least one kernel running (the
                                                    union of kernel intervals: concurrent kernels count once)
        kernels/gpu_idle_ms_per_step                ms: span minus busy: gaps in which the GPU waited for work
                                                    (host-bound launches, synchronisations)
        kernels/gpu_idle_share                      fraction: gpu_idle_ms_per_step / gpu_span_ms_per_step

    Values that do not exist in a run (a phase with no kernels, attention stages without the naive
    backend) are not logged. Also logged: text ``kernels/report`` (Markdown answering the seeds'
    questions), ``kernels/table_step`` and ``kernels/table_{phase}`` (top kernels), image
    ``kernels/categories`` (bar chart of category time per phase); written to the log dir:
    ``kernel_table.csv`` (every kernel, full names, per phase) and, with ``export_trace``,
    ``kernel_trace.json.gz`` (open in Perfetto or chrome://tracing).

    Args:
        wait: training batches to skip before profiling (compilation, cuDNN/cuBLAS autotuning).
        warmup: batches profiled but discarded (the profiler's own start-up cost).
        active: batches whose kernels are reported (averaged per step).
        top_k: rows in the kernel tables logged as text.
        export_trace: also write the Chrome trace, gzipped, to ``<log_dir>/kernel_trace.json.gz``.
        chart: log the category bar chart (matplotlib).
        head_dim: attention head dimension for the softmax/matmul FLOP ratio (default: the module's
            ``config.head_dim`` when it has one).
        record_shapes: ask the profiler to record input shapes (bigger trace, slower).
        release_cupti: tear CUPTI down when the window closes, by setting the environment variable
            ``TEARDOWN_CUPTI=1`` that PyTorch's profiler (Kineto) reads when it stops. Left alone when the
            variable is already set (``torch.compile`` with CUDA graphs sets it to ``0``: tearing down and
            re-attaching CUPTI can crash CUDA graph replays on older CUDA versions). The variable stays set
            for the rest of the process, so later profiler sessions release CUPTI too.
    """

    def __init__(
        self,
        wait: int = 5,
        warmup: int = 2,
        active: int = 3,
        top_k: int = 15,
        export_trace: bool = False,
        chart: bool = True,
        head_dim: int | None = None,
        record_shapes: bool = False,
        release_cupti: bool = True,
    ) -> None:
        super().__init__()
        self.wait = wait
        self.warmup = warmup
        self.active = active
        self.top_k = top_k
        self.export_trace = export_trace
        self.chart = chart
        self.head_dim = head_dim
        self.record_shapes = record_shapes
        self.release_cupti = release_cupti
        self._reset()

    def _reset(self) -> None:
        self._warn = WarnOnce()
        self._prof: torch.profiler.profile | None = None
        self._ranges_on = False
        self._open: list[torch.profiler.record_function] = []
        self._window = StepWindow(None)  # the real one is made in setup, once the arguments are checked
        self._window_steps = 0  # batches ended since the profiler started
        self._cuda = False
        self._trace_path: str | None = None
        self._tmpdir: str | None = None
        self._done = False
        self.summary: KernelSummary | None = None  # the last window's summary (for scripts and tests)
        self.timeline: GpuTimeline | None = None  # the last window's GPU busy/idle time (CUDA only)
        self.report: str | None = None

    # -- validation and cleanup ------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return  # validate / test after a fit must not clear that fit's summary and report
        for name, low in (("wait", 0), ("warmup", 0), ("active", 1), ("top_k", 1)):
            check_int("KernelShare", name, getattr(self, name), low)
        check_int("KernelShare", "head_dim", self.head_dim, 1, allow_none=True,
                  fix="leave it unset to take the model's config.head_dim.")
        self._reset()
        self._window = StepWindow(self.wait, self.warmup + self.active)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and not self._done:  # the window was cut short, or never reached
            self._warn(f"KernelShare: training stopped after {self._window.batches_seen} batches, before the profiling "
                       f"window (wait={self.wait} + warmup={self.warmup} + active={self.active}) was complete; "
                       "nothing was reported. Lower wait/warmup/active or train for more steps.")
        self._stop()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        """Close ranges, stop the profiler, withdraw the annotate request, delete temporary files."""
        self._close_ranges()
        if self._prof is not None:
            prof, self._prof = self._prof, None
            try:
                prof.stop()
            except Exception:  # noqa: BLE001 (stopping a profiler that already stopped itself)
                pass
        if self._ranges_on:
            disable_ranges(nvtx=False, profiler=True)
            self._ranges_on = False
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # -- phase ranges ----------------------------------------------------------------------------

    def _open_range(self, name: str) -> None:
        self._close_ranges()
        rf = torch.profiler.record_function(name)
        rf.__enter__()
        self._open.append(rf)

    def _close_ranges(self) -> None:
        while self._open:
            self._open.pop().__exit__(None, None, None)

    # -- hooks -----------------------------------------------------------------------------------

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        index = self._window.next_batch()
        if self._done:
            return
        if self._prof is None and self._window.is_first(index):
            self._start(pl_module)
        if self._prof is not None:
            self._open_range("forward")

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._prof is not None:
            self._open_range("backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._prof is not None:
            self._close_ranges()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self._prof is not None:
            self._open_range("optimizer")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._done or self._prof is None:
            return
        self._close_ranges()
        self._window_steps += 1
        if self._cuda and self._window_steps in (self.warmup, self.warmup + self.active):
            # Let the GPU finish this step's kernels before the active steps start / the trace closes, so the
            # trace holds exactly the active steps' kernels.
            torch.cuda.synchronize(pl_module.device)
        self._prof.step()
        if self._trace_path is not None:  # the schedule's active steps are over
            self._finish(trainer, pl_module)

    # -- window ----------------------------------------------------------------------------------

    def _start(self, pl_module: pl.LightningModule) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self._cuda = torch.cuda.is_available() and pl_module.device.type == "cuda"
        if not self._cuda:
            self._warn("KernelShare: no CUDA device in use; reporting CPU operator self time instead of GPU "
                       "kernel time (categories apply to aten:: operator names).")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
        self._tmpdir = tempfile.mkdtemp(prefix="lmtrain_kernels_")

        def on_ready(prof: torch.profiler.profile) -> None:
            path = os.path.join(self._tmpdir, "trace.json")
            prof.export_chrome_trace(path)
            self._trace_path = path

        if self._cuda and self.release_cupti:
            request_cupti_teardown()
        if self._cuda and self.warmup == 0:
            torch.cuda.synchronize(pl_module.device)
        enable_ranges(nvtx=False, profiler=True)
        self._ranges_on = True
        self._prof = profile(activities=activities, schedule=schedule(wait=0, warmup=self.warmup,
                                                                      active=self.active, repeat=1),
                             on_trace_ready=on_ready, record_shapes=self.record_shapes)
        self._prof.start()

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = self._trace_path
        self._close_ranges()
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()
        if self._ranges_on:
            disable_ranges(nvtx=False, profiler=True)
            self._ranges_on = False
        self._done = True
        try:
            with open(path) as f:
                trace = json.load(f)
            self._report(trainer, pl_module, trace, path)
        finally:
            self._stop()

    def _report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, trace: dict, path: str) -> None:
        tr = records_from_trace(trace, "cuda" if self._cuda else "cpu")
        if self._cuda and not tr.records:
            self._warn("KernelShare: the profiler recorded no CUDA kernels (CUPTI unavailable?); nothing reported.")
            return
        summary = summarize(tr.records, tr.steps)
        head_dim = self.head_dim or getattr(getattr(pl_module, "config", None), "head_dim", None)
        metrics = summary.metrics(head_dim if isinstance(head_dim, int) else None)
        if tr.step_wall_us > 0:
            metrics["kernels/step_wall_ms"] = tr.step_wall_us / 1e3
            metrics["kernels/busy_share"] = summary.total_us / tr.step_wall_us
        tl = tr.timeline
        if tl is not None and tl.span_us > 0:
            metrics.update({"kernels/gpu_span_ms_per_step": tl.span_us / 1e3,
                            "kernels/gpu_busy_ms_per_step": tl.busy_us / 1e3,
                            "kernels/gpu_idle_ms_per_step": tl.idle_us / 1e3,
                            "kernels/gpu_idle_share": tl.idle_us / tl.span_us})
        step = trainer.global_step
        last = self._window.batches_seen - 1
        first = last - self.active + 1
        context = {
            "device": torch.cuda.get_device_name(pl_module.device) if self._cuda else "CPU",
            "precision": str(trainer.precision),
            "batches": f"{first}..{last}",
            "step_wall_ms": tr.step_wall_us / 1e3,
            "unattributed": tr.unattributed_kernels,
            "unattributed_ms": tr.unattributed_us / 1e3,
            "timeline": tl,
        }
        self.summary, self.timeline = summary, tl
        self.report = build_report(summary, head_dim=head_dim, cuda=self._cuda, top_k=self.top_k, **context)
        log_scalars(trainer, metrics, step)
        log_text(trainer, "kernels/report", self.report, step)
        for scope in ("step", *PHASES):
            if summary.rows.get(scope):
                log_text(trainer, f"kernels/table_{scope}", kernel_table_markdown(summary, scope, self.top_k), step)
        out_dir = log_dir(trainer)
        if out_dir and trainer.global_rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            write_csv(summary, os.path.join(out_dir, "kernel_table.csv"))
            if self.export_trace:
                with open(path, "rb") as src, gzip.open(os.path.join(out_dir, "kernel_trace.json.gz"), "wb") as dst:
                    shutil.copyfileobj(src, dst)
        if self.chart:
            fig = category_chart(summary, cuda=self._cuda)
            if fig is not None:
                log_image(trainer, "kernels/categories", fig, step)


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
    """The Markdown report answering the seeds' kernel questions (also usable on a saved summary)."""
    what = "kernel" if cuda else "CPU op"
    lines = [f"## Where the {'GPU' if cuda else 'CPU'} time goes",
             f"{device}, precision {precision}, training batches {batches} ({summary.steps} profiled steps)."
             + ("" if cuda else " No CUDA device: CPU operator self times stand in for kernel times."), ""]
    parts = ", ".join(f"{p} {summary.phase_us[p] / 1e3:.2f} ms" for p in summary.phase_us if summary.phase_us[p])
    line = f"**{'Kernel' if cuda else 'CPU op self'} time per step:** {summary.total_us / 1e3:.2f} ms ({parts})."
    if step_wall_ms > 0:
        line += (f" Wall time per profiled step: {step_wall_ms:.2f} ms, so the {'GPU' if cuda else 'CPU'} is busy "
                 f"{100 * summary.total_us / 1e3 / step_wall_ms:.0f}% of it (profiler overhead included).")
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
