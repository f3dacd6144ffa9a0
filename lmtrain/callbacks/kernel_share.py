"""KernelShare: where the GPU time goes, per kernel, per category and per phase, from ``torch.profiler``.

The callback profiles a window of training steps (``record_function`` ranges ``forward``, ``backward``,
``optimizer`` from ``StepPhases``' hooks, ``lmtrain.annotate``'s profiler ranges on) and hands the trace to
``lmtrain.analysis`` (``kernels``, ``temporal``, ``ceilings``; ``python -m lmtrain analyze kernels TRACE.json`` runs
the same analysis offline). Every metric it logs, with its unit, is listed in the docstring of :class:`KernelShare`.
"""

from __future__ import annotations

import gzip
import os
import shutil
import statistics
import warnings
from pathlib import Path
from time import perf_counter
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lmtrain.analysis import ceilings
from lmtrain.analysis import kernels as analysis
from lmtrain.callbacks._common import (
    StepPhases,
    StepWindow,
    WarnOnce,
    check_int,
    check_ranks,
    gather_objects,
    gather_values,
    log_dir,
    log_image,
    log_scalars,
    log_text,
    request_cupti_teardown,
    timing_perturbed_by,
)
from lmtrain.callbacks._profiler import ProfilerSession
from lmtrain.callbacks.timer import CudaSyncTimer
from lmtrain.errors import LmtrainError

__all__ = ["KernelShare", "request_cupti_teardown"]


#: How many window starts, from the configured one on, KernelShare tries for one that no other callback perturbs.
_WINDOW_SEARCH = 64


class KernelShare(Callback):
    """Profile a window of training steps and report where the kernel time goes (see the module docstring).

    The window is steps ``wait`` .. ``wait + warmup + active - 1`` on Lightning's ``global_step`` axis (see
    ``lmtrain.callbacks._common.StepPhases``: 0 is the first step of a fresh fit; a step is one optimizer step
    with all its micro-batches; after a resume past ``wait`` the window does not open). Before and after it the
    callback costs nothing (no profiler, no ranges, no hooks, no device synchronisation); inside it the profiler
    slows steps down. After the window, NVIDIA's CUPTI (the library the profiler records kernels with) stays
    attached to the process unless it is torn down, and every later kernel launch pays for it (2.7B bf16 on an
    H100: +3.8% per step for the rest of the run). ``release_cupti`` (default on) has the profiler tear it down
    when the window closes.

    Metrics (TensorBoard scalars, all at the window's last step; every ``*_share*`` is a fraction in [0, 1],
    not a percentage; per-step values are means over the active steps; phases: forward, backward,
    optimizer, outside; on CPU every "kernel" value is CPU operator self time; the ``optimizer`` category
    holds everything torch.optim's own ``Optimizer.step`` ran, see ``records_from_trace``):

        kernels/total_ms_per_step                   ms: kernel device time per step (memcpy / memset included)
        kernels/{phase}_ms_per_step                 ms: kernel time per step launched in that phase
        kernels/cuda_graph_ms_per_step              ms: kernel time per step of steps replayed as a CUDA graph
                                                    (``LMModule(cuda_graphs=True)``: one phase, no boundaries)
        kernels/{category}_share_step               fraction in [0, 1]: category's share of the step's kernel
                                                    time, for each of ``lmtrain.analysis.categories.CATEGORIES``
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
        kernels/busy_share                          fraction: gpu_busy_ms_per_step (the union of the kernels'
                                                    intervals) / step_wall_ms; on CPU total_ms_per_step / step_wall_ms
        kernels/gpu_span_ms_per_step                ms: GPU timeline from the first kernel of the active steps
                                                    to the last, per step (CUDA only)
        kernels/gpu_busy_ms_per_step                ms: time per step with at least one kernel running (the
                                                    union of kernel intervals: concurrent kernels count once)
        kernels/gpu_idle_ms_per_step                ms: span minus busy: gaps in which the GPU waited for work
                                                    (host-bound launches, synchronisations)
        kernels/gpu_idle_share                      fraction: gpu_idle_ms_per_step / gpu_span_ms_per_step
        kernels/timer_step_ms                       ms: with a CudaSyncTimer attached, its median step over the
                                                    steps outside every measurement window (logged at the fit's
                                                    end, at its last step, with the three ratios below)
        kernels/{busy,span,wall}_to_timer_step      ratio: gpu_busy_ms_per_step, gpu_span_ms_per_step and
                                                    step_wall_ms over kernels/timer_step_ms (see
                                                    ``kernels/step_comparison`` and ``docs/callbacks.md``)
        kernels/timer_profiled_step_ms              ms: with a CudaSyncTimer attached, its mean step over this
                                                    window's active steps (the profiled ones it measured but left
                                                    out of its statistics; at the fit's end; less ``close_ms``
                                                    where the timer stands after KernelShare, see ``on_fit_end``)
        kernels/{busy,span,wall}_to_timer_profiled  ratio: the same three over kernels/timer_profiled_step_ms
                                                    (span: busy + idle, so near 1 when the trace accounts for the
                                                    whole of the steps it profiled; span is CUDA only)
        kernels/communication_ms_{scope}            ms per step: collective time (NCCL; on CPU gloo/c10d op self
                                                    time) in ``step`` or a phase, where there is some
        kernels/communication_exposed_ms_{scope}    ms per step: the part no compute kernel overlaps (CUDA only)
        kernels/compute_beside_comm_ms_step         ms per step: compute kernels that ran beside communication
                                                    kernels (at least half covered) and have twins that ran alone
                                                    (same name, phase, grid and block; CUDA only)
        kernels/compute_beside_comm_slowdown        ratio: their time over their twins' median time alone
        kernels/compute_beside_comm_excess_ms_step  ms per step: the difference, step time that overlapping
                                                    communication cost although none of it is exposed (these two
                                                    only where some kernel beside communication has twins)
        kernels/compute_beside_comm_unjudged_ms_step  ms per step: compute beside communication without twins
        kernels/communication[_exposed]_ms_step_max ms: maximum of communication_ms_step and
                                                    communication_exposed_ms_step over the profiling ranks
        kernels/compute_beside_comm_excess_ms_step_max  ms: the same for compute_beside_comm_excess_ms_step
        kernels/busiest_rank                        the profiling rank with the most kernel time (these two
                                                    with several profiling ranks only)

    The GPU timeline of the window (``lmtrain.analysis.temporal``: HolisticTraceAnalysis' definitions; on CPU the
    operators' timeline), per step; ``{kind}``: compute, communication, memory, idle; ``{phase}`` as above, or
    ``cuda_graph``:

        breakdown/span_ms_per_step                  ms: first activity's start to the last one's end
        breakdown/{kind}_ms_per_step                ms: time in that state (compute first, then communication,
                                                    then memory; the four add up to the span)
        breakdown/{kind}_share                      fraction of the span
        breakdown/{phase}_{kind}_ms_per_step        ms: the same per phase (an idle gap goes to the phase of the
                                                    work that ends it)
        breakdown/comm_overlap_share                fraction of the communication time that compute overlaps
        idle/{host_wait,kernel_wait,other}_ms_per_step  ms: idle time waiting for the host to launch, between
                                                    back-to-back kernels, on another kernel / stream / event
        idle/{host_wait,kernel_wait,other}_share    fraction of the idle time
        launch/kernels_per_step                     kernels (memcpy / memset apart) per step
        launch/short_kernels_per_step               kernels under 10 µs per step
        launch/short_kernel_share                   fraction of the kernels under 10 µs
        launch/delay_median_us, launch/delay_p90_us µs: kernel start minus its launch call's start (eager launches)
        launch/host_wait_share                      fraction of the span the GPU waited for the host
        launch/bound                                1 when launch/host_wait_share > 0.10, else 0
        roofline/{category}_tflops[_of_peak]        TFLOP/s of the category's kernels (the model's FLOPs of that
                                                    category, gemm and attention; with ``with_flops`` the profiler's
                                                    FLOPs of matrix products and convolutions instead, each spread
                                                    over the kernels its operator launched; ``model``: model FLOPs
                                                    over gemm + attention time) [/ bf16 matmul ceiling]; CUDA
        roofline/{category}_gbps[_of_peak]          GB/s of its device-to-device memcpy activities (bytes read
                                                    plus written, over their own time) [/ copy ceiling]; CUDA only
        roofline/{category}_transfer_gbps           GB/s of its host<->device and peer memcpy activities (one-way
                                                    bytes over their own time; no ceiling); CUDA only

    Several ranks: the ``ranks`` profile; at the window's last step every rank takes part in one gather of the
    results, and rank 0 logs those of the lowest profiling rank (``analysis.kernels.merge_rank_metrics``).

    Values that do not exist in a run (a phase with no kernels, attention stages without the naive
    backend) are not logged. Also logged: text ``kernels/step_comparison`` (at the fit's end: busy, GPU span and
    profiled step wall time per step, over the timer's median unprofiled step and over its mean on the profiled
    steps), ``kernels/report`` (Markdown answering the usual questions of a kernel profiling study),
    ``kernels/breakdown`` (the timeline tables above, per phase), ``kernels/table_step`` and
    ``kernels/table_{phase}`` (top kernels), image ``kernels/categories`` (bar chart of category time per phase);
    written to the log dir: ``kernel_table.csv`` (every kernel, full names, per phase) and, with ``export_trace``,
    ``kernel_trace.json.gz`` (open in Perfetto or chrome://tracing).

    Args:
        wait: first step of the window (``global_step``): the steps before it are skipped (compilation,
            cuDNN/cuBLAS autotuning). Where another callback perturbs the timing of an active step, the window
            starts later (:meth:`on_fit_start`, said in one line).
        warmup: steps profiled but discarded (the profiler's own start-up cost).
        active: steps whose kernels are reported (averaged per step).
        top_k: rows in the kernel tables logged as text.
        export_trace: also write the Chrome trace, gzipped, to ``<log_dir>/kernel_trace.json.gz``.
        chart: log the category bar chart (matplotlib).
        head_dim: attention head dimension for the softmax/matmul FLOP ratio (default: the module's
            ``config.head_dim`` when it has one).
        operators: on a CUDA device, record every operator (``aten::mm``, ...) in the trace too, as
            ``torch.profiler`` does by default. Off (the default), the host side of the trace holds only the
            ranges (phases, steps, the optimizer's step) and the CUDA runtime's launch calls, which is all the
            analysis reads: recording thousands of operators per step costs the host enough to change the step
            it measures (an eager 2.7B step at context 512 ran 1.75x as long profiled with them, its GPU waiting
            for the host, on an H200). On a CPU the operators are always recorded: they are what is measured there.
        record_shapes: ask the profiler to record input shapes (bigger trace, slower; needs ``operators``, also
            on a CPU, where the operators are recorded anyway: set ``operators: true`` with it).
        with_flops: ask the profiler for the FLOPs of each matrix product and convolution (written into the trace
            as the operators' ``flops`` argument) for ``roofline/{category}_tflops``; needs ``operators``.
            None (the default): as ``operators``. Without it, ``roofline/gemm_tflops`` and
            ``roofline/attention_tflops`` come from the module's model FLOPs per category
            (``flops_by_category_per_batch``: the linear layers' products and attention's QK^T and PV, no
            recomputation counted), and ``roofline/model_*`` from its model FLOPs. Its cost falls on the profiled
            steps and on the window's end (reading the profiler's events and rewriting the trace once).
        release_cupti: tear CUPTI down when the window closes, by setting the environment variable
            ``TEARDOWN_CUPTI=1`` that PyTorch's profiler (Kineto) reads when it stops. Left alone when the
            variable is already set (``torch.compile`` with CUDA graphs sets it to ``0``: tearing down and
            re-attaching CUPTI can crash CUDA graph replays on older CUDA versions). The variable stays set
            for the rest of the process, so later profiler sessions release CUPTI too.
        ranks: the ranks that profile (default ``[0]``); with ``export_trace`` on several ranks each writes
            ``kernel_trace_rank{r}.json.gz``.
        ceilings: this GPU's ceilings for the ``roofline/*_of_peak`` scalars: a dict (``bf16_matmul_tflops``,
            ``copy_gbps``), the path of a JSON cache, or None: measured once per device and cached in
            ``~/.cache/lmtrain/ceilings.json`` (``lmtrain.analysis.ceilings``; about a second, after the window).
    """

    def __init__(self, wait: int = 5, warmup: int = 1, active: int = 2, top_k: int = 15, export_trace: bool = False,
                 chart: bool = True, head_dim: int | None = None, record_shapes: bool = False,
                 release_cupti: bool = True, ranks: list[int] | None = None,
                 ceilings: dict[str, float] | str | None = None, with_flops: bool | None = None,
                 operators: bool = False) -> None:
        super().__init__()
        self.ranks = [0] if ranks is None else ranks
        self.wait, self.warmup, self.active, self.top_k = wait, warmup, active, top_k
        self.export_trace = export_trace
        self.chart = chart
        self.head_dim = head_dim
        self.record_shapes = record_shapes
        self.operators = operators
        self.with_flops = operators if with_flops is None else with_flops
        self.release_cupti = release_cupti
        self.ceilings = ceilings
        self._reset()

    def _reset(self) -> None:
        self._warn = WarnOnce()
        self._prof: ProfilerSession | None = None  # on the profiling ranks, while the window runs
        self._window = StepWindow(None)  # the real one is made in setup, once the arguments are checked
        self._beyond = False  # the window lies beyond max_steps (warned in setup)
        self._passed = False  # the fit started past the window's first step (a resume): nothing is profiled
        self._phases = StepPhases()
        self._window_steps = 0  # steps ended since the window opened (on every rank, profiling or not)
        self._running = False  # the window is open in this fit (every rank; the profiler runs on ``ranks`` only)
        self._first_active: int | None = None
        self._active_steps: range | None = None  # the steps whose kernels are reported, once the window has closed
        #: Host time in ms spent closing the window in the last active step's ``on_train_batch_end``, after the
        #: device synchronisation: the profiler's stop, the trace's export and analysis, the ranks' gather and the
        #: logging. A CudaSyncTimer standing after KernelShare in the callbacks list ends that step only after it.
        self.close_ms: float | None = None
        self._cuda = False
        self._done = False
        self.summary: analysis.KernelSummary | None = None  # the last window's summary (for scripts and tests)
        self.timeline: analysis.GpuTimeline | None = None  # the last window's GPU busy/idle time (CUDA only)
        self.report: str | None = None
        self.metrics: dict[str, float] | None = None  # the last window's metrics of this rank
        self._logged: dict[str, float] | None = None  # rank 0: the metrics it logged (merged over profiling ranks)
        #: Rank 0, after the fit: the profiled steps' GPU time next to the timer's step (``step_comparison``).
        self.comparison: dict[str, float] | None = None

    def in_window(self, step: int) -> bool:
        """Step ``step`` runs under the profiler (warm-up and active steps; on every rank)."""
        return self._window.contains(step)

    def perturbs_timing(self, step: int) -> bool:
        """Yes inside the window: the profiler records every operator and kernel launch (host time per launch).
        No step of a fit that started past the window's first step (a resume): the profiler never runs in it."""
        return self.in_window(step) and not self._passed

    def check_arguments(self, world_size: int = 1) -> None:
        """Check the arguments: ``setup`` calls it, and the command line before any log folder exists.

        Args:
            world_size: the number of processes of the run.

        Raises:
            LmtrainError: an argument is out of range, naming it.
        """
        for name, low in (("wait", 0), ("warmup", 0), ("active", 1), ("top_k", 1)):
            check_int("KernelShare", name, getattr(self, name), low)
        check_int("KernelShare", "head_dim", self.head_dim, 1, allow_none=True,
                  fix="leave it unset to take the model's config.head_dim.")
        check_ranks("KernelShare", self.ranks, world_size)
        for name in ("with_flops", "record_shapes"):
            if getattr(self, name) and not self.operators:
                raise LmtrainError(f"KernelShare.{name}", "is a fact of each operator, and operators=false leaves "
                                   "the operators out of the trace.", f"set operators: true with {name}: true, or "
                                   f"leave {name} unset.")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return  # validate / test after a fit must not clear that fit's summary and report
        self.check_arguments(trainer.world_size)
        self._reset()
        self._window = StepWindow(self.wait, self.warmup + self.active)
        self._beyond = self._window.beyond(getattr(trainer, "max_steps", None))
        if self._beyond:  # said now, once, rather than after the whole run
            self._warn(f"KernelShare: the profiling window ({self._window.describe()}: wait={self.wait} + "
                       f"warmup={self.warmup} + active={self.active}) ends after the last step of max_steps "
                       f"{trainer.max_steps}; nothing will be reported. Lower wait/warmup/active or train for more "
                       "steps.")
        log_dir(trainer)  # on several ranks a collective: read it now, on every rank (see _common.log_dir)
        if getattr(getattr(pl_module, "config", None), "optimizer_in_backward", False):
            rank_zero_info("KernelShare: with model.optimizer_in_backward the optimizer's updates run inside the "
                           "backward pass: their kernels count in the backward phase; there is no separate optimizer "
                           "phase.")
        if getattr(pl_module, "cuda_graphs", False):
            rank_zero_info("KernelShare: a step replayed as a CUDA graph is one phase, 'cuda graph'; its kernels keep "
                           "their own categories, but no forward/backward/optimizer split exists inside it.")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Move the window later while another callback perturbs the timing of one of its active steps, so that
        the reported steps hold the training step alone: that work would be in the trace (a memory snapshot's
        stack captures, the precision inspector's hooks), or, on several ranks, the other ranks' wait for it (the
        step after a window whose files some ranks write). The warm-up steps may overlap such work: nothing of
        them is reported. Said in one line when the window moves; where no later window fits before
        ``max_steps``, said too, and the window stays. Runs after every callback's ``setup`` (their windows are
        known by then), on every rank alike. The module's CUDA-graph warm-up is not consulted: it is known only
        once the graphs are captured, and the default window starts after it."""
        if self._beyond:
            return
        length = self.warmup + self.active
        first = self._window.start_step
        if first is None:
            return

        def others(start: int) -> list[str]:
            return sorted({name for step in range(start + self.warmup, start + length)
                           for name in timing_perturbed_by(trainer, step, exclude=self, module=False)})

        # Every rank must profile the same steps (the window's end gathers the ranks' results), and a callback may
        # perturb a step on some ranks only. So every rank marks which of the same candidate starts are clear for
        # it (nothing perturbs their active steps), the marks are gathered (over gloo), and the window starts at
        # the first candidate clear on every rank.
        busy = others(first)
        limit = first + _WINDOW_SEARCH
        max_steps = getattr(trainer, "max_steps", None)
        if max_steps is not None and max_steps >= 0:
            limit = min(limit, max_steps - length + 1)  # the last start whose window ends by max_steps, plus one
        candidates = range(first, max(first + 1, limit))
        marks = [float(not others(step)) for step in candidates]
        rows = gather_values(trainer, marks)
        clear = next((step for i, step in enumerate(candidates) if all(row[i] == 1.0 for row in rows)), None)
        agreed = first if clear is None else clear
        old = self._window.describe()
        if clear is None:
            who = ", ".join(busy) if busy else "other ranks' callbacks"
            self._warn(f"KernelShare: the profiling window ({old}) reports steps that {who} perturb, and no "
                       "later window of the same length ends before max_steps (or within "
                       f"{_WINDOW_SEARCH} steps) on every rank; the profiled steps include their work. Set wait to "
                       "place the window.")
        if agreed == first:
            return
        self._window = StepWindow(agreed, length)
        why = ", ".join(busy) if busy else "another rank's callbacks"
        rank_zero_info(f"KernelShare: profiling {self._window.describe()} instead of {old} (wait={agreed}, not "
                       f"{self.wait}): {why} perturb the timing of a step it would report. Set wait to place the "
                       "window.")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and not self._done and not self._beyond:  # cut short, or never reached
            self._warn(f"KernelShare: training stopped after {self._phases.batches_seen} batches, before the profiling "
                       f"window (wait={self.wait} + warmup={self.warmup} + active={self.active}: "
                       f"{self._window.describe()}; last step run: {self._phases.step}) was complete; nothing was "
                       "reported. Lower wait/warmup/active or train for more steps.")
        self._stop()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Put the window's GPU time next to the timer's step (``analysis.kernels.step_comparison``): its median
        over the unprofiled steps, and its mean over the very steps this window profiled (the active ones, which
        the timer measures but leaves out of its statistics: ``CudaSyncTimer.step_ms``). Where the timer stands
        after KernelShare in the callbacks list, its last profiled step ended only after KernelShare closed the
        window (``close_ms``): that time is taken out of it, and the text says so.

        ``on_fit_end`` runs after every callback's ``on_train_end`` (where a CudaSyncTimer reads its last steps),
        and before the loggers are finalised: the comparison is the same wherever the two stand in the callbacks
        list. Rank 0 only reads the timer's own results (no collective): with several ranks, the timer's times are
        rank 0's, the trace's those of the lowest profiling rank (the same steps)."""
        if self._logged is None or trainer.global_rank != 0:
            return
        timer = next((c for c in trainer.callbacks if isinstance(c, CudaSyncTimer)), None)
        stats = timer.summary().get("step_ms") if timer is not None else None
        step_ms, count = (stats["median"], int(stats["count"])) if stats else (None, 0)
        steps = self._active_steps or range(0)
        profiled = timer.step_ms(steps) if timer is not None else {}
        note = ""
        if steps and steps[-1] in profiled and self.close_ms and \
                trainer.callbacks.index(timer) > trainer.callbacks.index(self):
            # The timer's hooks run after this callback's: its last profiled step ended after the window's closing,
            # host time with the GPU idle that is no part of the step; take it out again.
            profiled[steps[-1]] -= self.close_ms
            note = (f"\n\nThe timer's last profiled step (step {steps[-1]}) is taken less the {self.close_ms:.1f} ms "
                    "KernelShare spent closing its window (profiler stop, trace export and analysis), which the "
                    "timer counted: it stands after KernelShare in the callbacks list.")
        profiled_ms = statistics.fmean(profiled.values()) if profiled and len(profiled) == len(steps) else None
        self.comparison, text = analysis.step_comparison(self._logged, step_ms, count, profiled_ms, len(steps))
        text += note
        step = max(self._phases.step, 0)
        log_scalars(trainer, self.comparison, step)
        log_text(trainer, "kernels/step_comparison", text, step)

    def _stop(self) -> None:
        """Close ranges, stop the profiler, withdraw the annotate request, delete temporary files."""
        if self._prof is not None:
            self._prof.close()
            self._prof = None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = self._phases.batch_start(trainer)
        if not self._done and self._phases.starts_fit_after(self._window.start_step):
            # resumed inside or after the window: its warm-up (or all of it) is behind this fit
            self._passed = self._done = True
            self._warn(f"KernelShare: this fit starts at step {step} (resumed), past the start of the profiling "
                       f"window ({self._window.describe()}); nothing is profiled in it. Set wait to a step from "
                       f"{step} on to profile this run.")
        if self._done:
            return
        if not self._running and self._phases.enters(self._window):
            self._running = True
            if trainer.global_rank in self.ranks:
                self._start(pl_module)
        if self._prof is not None:
            self._prof.open_range(self._phases.phase)  # forward, or "cuda graph" for a replayed step

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._phases.before_backward()
        if self._prof is not None:
            self._prof.open_range("backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phases.after_backward()
        if self._prof is not None:
            self._prof.close_ranges()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self._phases.before_optimizer_step()
        if self._prof is not None and not self._phases.graphed:
            self._prof.open_range("optimizer")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        ended = self._phases.batch_end(trainer)
        if self._done or not self._running:
            return
        if self._prof is not None:
            self._prof.close_ranges()
        if not ended:
            return  # one profiler step is one optimizer step, all its micro-batches
        self._window_steps += 1
        if self._window_steps == self.warmup + 1:
            self._first_active = self._phases.step
        last = self._window_steps == self.warmup + self.active  # the same step on every rank
        if (last or (self._prof is not None and self._window_steps == self.warmup)) and \
                pl_module.device.type == "cuda":
            # Let the GPU finish this step's kernels before the active steps start / the trace closes, so the
            # trace holds exactly the active steps' kernels, and the window's closing below runs (and is timed)
            # with the GPU idle, on every rank (see close_ms).
            torch.cuda.synchronize(pl_module.device)
        closing = perf_counter()
        if self._prof is not None:
            self._prof.prof.step()
        if last:
            self._active_steps = range(self._first_active, self._phases.step + 1)
            self._finish(trainer, pl_module)
            self.close_ms = (perf_counter() - closing) * 1e3

    def _start(self, pl_module: pl.LightningModule) -> None:
        self._cuda = torch.cuda.is_available() and pl_module.device.type == "cuda"
        if not self._cuda:
            self._warn("KernelShare: no CUDA device in use; reporting CPU operator self time instead of GPU "
                       "kernel time (categories apply to aten:: operator names), the CPU operators' timeline, and no "
                       "roofline/* (no GPU ceilings to measure).")
        # On a CPU the operators are the measurement: always recorded there
        self._prof = ProfilerSession(self._cuda, self.warmup, self.active, self.record_shapes, self.release_cupti,
                                     pl_module.device if self._cuda else None, with_flops=self.with_flops,
                                     operators=self.operators or not self._cuda)

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._done = True
        try:
            found = None
            try:
                path = self._prof.finish() if self._prof is not None else None
                if self._cuda and not self.operators and self._prof is not None and not self._prof.ranges_only:
                    self._warn(f"KernelShare: torch {torch.__version__} cannot leave the operators out of the trace "
                               "(no scoped _enable_profiler): the profiled steps carry the cost of recording each "
                               "one, and their idle time overstates an ordinary step's.")
                found = self._analyze(trainer, pl_module, path) if path is not None else None
            except Exception as error:  # noqa: BLE001 (any failure: the other ranks wait in _report's gather)
                warnings.warn(f"KernelShare: rank {trainer.global_rank}: the profiled window could not be analysed "
                              f"({type(error).__name__}: {error}); this rank reports nothing.", stacklevel=1)
            self._report(trainer, found)  # on every rank, whatever happened above: it holds the collective
        finally:
            self._stop()

    def _analyze(self, trainer: pl.Trainer, pl_module: pl.LightningModule, path: str) -> dict | None:
        """Analyse this rank's trace (``lmtrain.analysis.kernels``); what rank 0 needs to log it, picklable."""
        head_dim = self.head_dim or getattr(getattr(pl_module, "config", None), "head_dim", None)
        found = analysis.analyze_trace(
            analysis.load_trace(path), "cuda" if self._cuda else "cpu",
            head_dim=head_dim if isinstance(head_dim, int) else None, top_k=self.top_k,
            device_name=torch.cuda.get_device_name(pl_module.device) if self._cuda else "CPU",
            precision=str(trainer.precision), batches=f"{self._first_active}..{self._phases.step}",
            ceilings=self._ceilings(pl_module) if self._cuda else None,
            model_flops_per_step=(getattr(pl_module, "flops_per_batch", None) or 0) * trainer.accumulate_grad_batches,
            category_flops_per_step={c: f * trainer.accumulate_grad_batches for c, f in
                                     (getattr(pl_module, "flops_by_category_per_batch", None) or {}).items()})
        if self._cuda and not found.records.records:
            self._warn("KernelShare: the profiler recorded no CUDA kernels (CUPTI unavailable?); nothing reported.")
            return None
        self.summary, self.timeline, self.report = found.summary, found.records.timeline, found.report
        self.metrics = found.metrics  # this rank's (rank 0 logs the merged metrics of the profiling ranks)
        out_dir = log_dir(trainer)
        if out_dir and self.export_trace:
            os.makedirs(out_dir, exist_ok=True)
            name = f"kernel_trace{'' if trainer.world_size == 1 else f'_rank{trainer.global_rank}'}.json.gz"
            with open(path, "rb") as src, gzip.open(os.path.join(out_dir, name), "wb") as dst:
                shutil.copyfileobj(src, dst)
        return {"metrics": found.metrics, "report": found.report, "tables": found.tables(self.top_k),
                "summary": found.summary, "cuda": found.cuda, "breakdown": found.breakdown}

    def _ceilings(self, pl_module: pl.LightningModule) -> dict[str, float] | None:
        """The ceilings passed in, or this GPU's, measured on the module's own device (cached per device name and
        torch version); None, said once, when there is nothing to compare with."""
        if isinstance(self.ceilings, dict):
            return self.ceilings
        cache = Path(self.ceilings) if isinstance(self.ceilings, str) else None
        found = ceilings.device_ceilings(pl_module.device, cache)
        if found is None:
            self._warn(f"KernelShare: no ceilings measured on {pl_module.device} (a CUDA device is needed); no "
                       "roofline/*_of_peak.")
        return found

    def _report(self, trainer: pl.Trainer, found: dict | None) -> None:
        """Gather the profiling ranks' results (every rank takes part) and log them on rank 0."""
        per_rank = {r: f for r, f in enumerate(gather_objects(trainer, found)) if f is not None}
        if trainer.global_rank != 0 or not per_rank:
            return
        step, first = self._phases.step, per_rank[min(per_rank)]  # the window's last step; the lowest profiler
        self._logged = analysis.merge_rank_metrics({r: f["metrics"] for r, f in per_rank.items()})
        log_scalars(trainer, self._logged, step)
        log_text(trainer, "kernels/report", first["report"], step)
        log_text(trainer, "kernels/breakdown", first["breakdown"], step)
        for scope, table in first["tables"].items():
            log_text(trainer, f"kernels/table_{scope}", table, step)
        out_dir = log_dir(trainer)
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            analysis.write_csv(first["summary"], os.path.join(out_dir, "kernel_table.csv"))
        if self.chart:
            fig = analysis.category_chart(first["summary"], cuda=first["cuda"])
            if fig is not None:
                log_image(trainer, "kernels/categories", fig, step)
