"""CudaSyncTimer: per-phase step times measured correctly on the GPU, tokens/s, MFU and a summary table."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from typing_extensions import override

from lmtrain.analysis.timing import (
    MARKS,
    clock_name,
    elapsed_ms,
    phase_statistics,
    phase_times,
    step_metrics,
    summary_text,
    tokens_in_batch,
)
from lmtrain.callbacks._common import (
    StepPhases,
    WarnOnce,
    check_int,
    gather_values,
    host_group,
    log_scalars,
    log_text,
    timing_perturbed_by,
)
from lmtrain.errors import LmtrainError
from lmtrain.flops import float8_step_peak_flops
from lmtrain.flops import peak_flops as peak_flops_for

SyncMode = Literal["events", "synchronize"]

#: Phase keys of :attr:`CudaSyncTimer.step_times` and :meth:`CudaSyncTimer.summary`, in display order.
PHASES = ("forward_ms", "backward_ms", "optimizer_ms", "step_ms")

#: Events mode: steps left unread when a step starts. Step N is read when step N + 2 starts (its events have been
#: passed by a whole step's work, so reading them almost never waits), on every rank alike.
READ_LAG = 1

_START, _BEFORE_BWD, _AFTER_BWD, _BEFORE_OPT, _END = MARKS  # marks of one batch, in the order the hooks fire


@dataclass
class _Step:
    """Marks of the batches of one optimizer step (several with gradient accumulation)."""

    index: int
    warmup: bool
    batches: list[dict[str, Any]] = field(default_factory=list)  # mark name -> CUDA event or seconds
    tokens: int | None = 0
    flops: float | None = 0.0
    float8_flops: float = 0.0  # the part of flops run as float8 GEMMs (the module's float8_flops_per_batch)
    graphed: bool = False  # replayed as a CUDA graph: only the whole step has host-side marks
    graph_marks: dict[str, Any] | None = None  # marks recorded inside the graph (the module's graph_phase_marks)


class CudaSyncTimer(pl.Callback):
    """Times forward, backward, optimizer step and the whole step, every step, without distorting them.

    CUDA kernels run asynchronously: a host clock read right after ``loss.backward()`` returns measures
    the launch, not the work. With ``sync="events"`` (default) a CUDA event is recorded on the current
    stream at each phase boundary and read when the step after next starts, after the GPU has passed it
    (almost always: the host rarely runs more than a step ahead), so the host does not wait. With
    ``sync="synchronize"`` each boundary calls ``torch.cuda.synchronize()`` and reads ``time.perf_counter``
    (exact, but it drains the queue at every boundary and so adds idle gaps; use it to cross-check). Without
    CUDA the host clock ``time.perf_counter`` is used (a message says so once).

    Phases and steps are those of ``lmtrain.callbacks._common.StepPhases`` (forward from the batch start,
    ``zero_grad`` included; backward; optimizer: the optimizer step, gradient clipping, the LR scheduler;
    step: batch start -> batch end; data loading and validation between batches are outside every phase).
    Every value is logged at its step's ``trainer.global_step``, for steps whose index is a multiple of
    ``log_every_n_steps``. Gradient accumulation: one step is one optimizer step; its forward and backward
    times are sums over its micro-batches, its step time the sum of their batch times (gaps between them
    excluded), and tokens/s and MFU count all of them.

    The first ``warmup_steps`` steps of the fit (CUDA context, cuBLAS autotuning, allocator growth: the
    first step is often ~20x slower) are logged only as ``time/warmup_step_ms`` and kept out of the summary.
    Steps whose timing another callback perturbs (its ``perturbs_timing(step)``; ``docs/callbacks.md`` lists which
    windows do and why) are logged as usual but kept out of the summary's statistics and reported apart. At their
    defaults the five callbacks leave out 3 steps (KernelShare's profiler, steps 5..7).

    Metrics (TensorBoard scalars at the step they belong to; every ``log_every_n_steps`` steps):

    - ``time/forward_ms``, ``time/backward_ms``, ``time/optimizer_ms``, ``time/step_ms``: milliseconds. A step
      replayed as a CUDA graph has ``time/step_ms`` only, unless the module has ``graph_phase_marks()``: a dict
      mark name (``lmtrain.analysis.timing.MARKS``) -> ``torch.cuda.Event(enable_timing=True, external=True)``
      recorded inside the graph, read when the step after next starts (valid until the replay after next).
      ``LMModule`` has it (``lmtrain.graphs.WholeStepGraph``); its replayed steps then have every phase, and
      ``time/step_ms`` is still timed from the host's marks around the replay.
    - ``time/warmup_step_ms``: milliseconds per warm-up step.
    - ``throughput/tokens_per_s``: tokens per second (inputs of (B, T + 1) windows count B * T tokens); on
      several ranks the tokens of all ranks over the slowest rank's step time.
    - ``throughput/mfu``: model FLOPs utilisation per device in [0, 1], from ``pl_module.flops_per_batch`` and
      the peak FLOP/s of one device and precision (``lmtrain.flops.PEAK_FLOPS``) or ``peak_flops``; on several
      ranks the mean model FLOPs of one rank / (slowest rank's step time x peak of one device). Float8 runs are
      measured against the bf16 peak too, so that recipes compare on one scale.
    - ``throughput/mfu_float8_peak``: float8 runs only (``pl_module.float8_flops_per_batch`` > 0): the same MFU
      against the step's own ceiling, its float8 GEMMs at the device's float8 peak and the rest at the bf16 peak
      (``lmtrain.flops.float8_step_peak_flops``).

    On several ranks the ``time/*_ms`` tags above are rank 0's own; every logged step's times of all ranks are
    gathered (one small ``all_gather`` of host-side floats over a gloo group, ``lmtrain.callbacks._common.host_group``;
    in events mode when the step after next starts, on every rank), and rank 0 logs:

    - ``time/step_ms_slowest``, ``time/step_ms_fastest``: ms, the slowest (what the run waits on) and fastest
      rank's step time; ``time/straggler_ratio``: slowest / fastest (ratio, >= 1); ``time/slowest_rank``: the
      rank with the slowest step (lowest on ties).
    - ``time/forward_ms_max``, ``time/backward_ms_max``, ``time/optimizer_ms_max``: ms, over the ranks.
    - ``time/summary`` (text, at the end): per-phase mean ± std, median, min and max in ms, and the
      same in the ``Model  Params  Forward (s)  Backward (s)`` format of the reference profiling study's
      timing tables; then the steps other callbacks perturbed, apart, with their own statistics.

    Attributes:
        step_times: one dict per measured (post-warm-up) step: ``step`` (index) and the phase keys among
            ``forward_ms``, ``backward_ms``, ``optimizer_ms``, ``step_ms`` that the step has.
        excluded_steps: step index -> class names of the other callbacks that perturbed its timing
            (those steps are in ``step_times`` but not in the summary's statistics).
        warmup_times: step time in ms of each warm-up step.

    :meth:`step_ms` gives the step time of any measured step by index (warm-up and excluded steps included): what
    KernelShare sets its profiled steps' GPU span against.

    Args:
        warmup_steps: steps measured and logged separately, not summarised.
        sync: ``events`` (CUDA events, no host sync inside the step) or ``synchronize``.
        peak_flops: peak FLOP/s for MFU; None looks the device and precision up in the table.
        float8_peak_flops: the device's float8 peak FLOP/s for ``throughput/mfu_float8_peak``; None looks the device
            up in the table (its ``fp8`` column).
        log_every_n_steps: log the scalars of every n-th step (all steps are still measured).
        print_summary: print the summary tables at the end of training.
    """

    def __init__(self, warmup_steps: int = 5, sync: SyncMode = "events", peak_flops: float | None = None,
                 log_every_n_steps: int = 1, print_summary: bool = True, float8_peak_flops: float | None = None
                 ) -> None:
        super().__init__()
        self.warmup_steps = warmup_steps
        self.sync = sync
        self.peak_flops = peak_flops
        self.float8_peak_flops = float8_peak_flops
        self.log_every_n_steps = log_every_n_steps
        self.print_summary = print_summary
        self.step_times: list[dict[str, float]] = []
        self.excluded_steps: dict[int, list[str]] = {}
        self.warmup_times: list[float] = []
        self._step_ms: dict[int, float] = {}  # every measured step's time (warm-up and excluded ones too), by index
        self._phases = StepPhases()
        self._warn = WarnOnce()
        self._cuda = False
        self._pending: list[_Step] = []  # steps whose CUDA events are not read yet (events mode)
        self._current: _Step | None = None
        self._batch: dict[str, Any] | None = None
        self._peak: float | None = None
        self._float8_peak: float | None = None
        self._event_pool: list[torch.cuda.Event] = []
        self._summarised = False
        self._model_row: tuple[str, int] | None = None

    # -- setup / teardown -----------------------------------------------------------------------

    def check_arguments(self, world_size: int = 1) -> None:
        """Check the arguments: ``setup`` calls it, and the command line before any log folder exists.

        Args:
            world_size: the number of processes of the run (unused here).

        Raises:
            LmtrainError: an argument is out of range, naming it.
        """
        if self.sync not in ("events", "synchronize"):
            raise LmtrainError("callbacks.CudaSyncTimer.sync", f"unknown mode {self.sync!r}.",
                               "use events or synchronize.")
        check_int("CudaSyncTimer", "warmup_steps", self.warmup_steps, 0)
        check_int("CudaSyncTimer", "log_every_n_steps", self.log_every_n_steps, 1)
        for name, example in (("peak_flops", "989.4e12"), ("float8_peak_flops", "1978.9e12")):
            peak = getattr(self, name)
            if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float)) or peak <= 0):
                raise LmtrainError(f"callbacks.CudaSyncTimer.{name}", f"{peak!r} is not a positive number.",
                                   f"give the device's peak FLOP/s, e.g. {example}, or leave it unset.")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.check_arguments()
        peak = self.peak_flops
        self.step_times, self.excluded_steps, self.warmup_times, self._summarised = [], {}, [], False
        self._step_ms = {}
        self._pending, self._current, self._batch = [], None, None
        self._phases.reset()
        host_group(trainer)  # a collective the first time: made now, on every rank together
        self._cuda = trainer.strategy.root_device.type == "cuda"
        if not self._cuda:
            rank_zero_info("CudaSyncTimer: no CUDA device; timing with the host clock time.perf_counter.")
        name = torch.cuda.get_device_name(trainer.strategy.root_device) if self._cuda else None
        self._peak = peak if peak is not None else peak_flops_for(name, trainer.precision) if name else None
        self._float8_peak = (self.float8_peak_flops if self.float8_peak_flops is not None
                             else peak_flops_for(name, "fp8") if name else None)
        if self._peak is None:
            self._warn(f"CudaSyncTimer: no peak FLOP/s known for {name or 'a CPU'!r} at precision "
                       f"{trainer.precision!r}; throughput/mfu is not logged. Pass peak_flops=... .")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        size = getattr(pl_module.hparams, "size", None) if hasattr(pl_module, "hparams") else None
        name = str(size) if size is not None else type(pl_module).__name__
        self._model_row = (name, sum(p.numel() for p in pl_module.parameters()))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # A failed step leaves open marks; drop them (steps already read stay in step_times).
        self._pending, self._current, self._batch = [], None, None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            # Normally on_train_end has summarised already. (After an exception Lightning calls
            # on_exception instead of teardown, so this does not cover a crashed run.)
            self._finish(trainer, log=False)
            self._event_pool.clear()

    # -- marks ----------------------------------------------------------------------------------

    def _mark(self, name: str) -> None:
        if self._batch is None:
            return
        if self._cuda and self.sync == "events":
            event = self._event_pool.pop() if self._event_pool else torch.cuda.Event(enable_timing=True)
            event.record()
            self._batch[name] = event
        else:
            if self._cuda:
                torch.cuda.synchronize()
            self._batch[name] = perf_counter()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # The step before the previous one, read now that the GPU has (almost surely) passed its events; every rank
        # reads (and gathers) the same steps here, whether or not its events have completed.
        self._collect(trainer, lag=READ_LAG)
        index = self._phases.batch_start(trainer)
        if self._current is None:
            self._current = _Step(index=index, warmup=self._phases.steps_started <= self.warmup_steps,
                                  graphed=self._phases.graphed)
            if self._phases.graphed and not callable(getattr(pl_module, "graph_phase_marks", None)):
                self._warn("CudaSyncTimer: steps replayed as a CUDA graph (model.cuda_graphs) have time/step_ms only: "
                           "the module records no phase marks inside its graph (graph_phase_marks). The eager "
                           "warm-up steps before the capture still have every phase.")
        self._batch = {}
        self._current.batches.append(self._batch)
        tokens = tokens_in_batch(batch)
        if tokens is None:
            self._warn("CudaSyncTimer: cannot count tokens in this batch type; throughput/tokens_per_s is not logged.")
        self._current.tokens = None if tokens is None or self._current.tokens is None else self._current.tokens + tokens
        self._mark(_START)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._phases.before_backward()
        self._mark(_BEFORE_BWD)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phases.after_backward()
        self._mark(_AFTER_BWD)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._phases.before_optimizer_step()
        if not self._phases.graphed:  # a replay has run its update already
            self._mark(_BEFORE_OPT)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        ended = self._phases.batch_end(trainer)
        if self._batch is None or self._current is None:
            return
        self._mark(_END)
        self._batch = None
        step = self._current
        flops = getattr(pl_module, "flops_per_batch", None)
        step.flops = None if flops is None or step.flops is None else step.flops + float(flops)
        step.float8_flops += float(getattr(pl_module, "float8_flops_per_batch", None) or 0.0)
        if step.graphed and callable(getattr(pl_module, "graph_phase_marks", None)):
            step.graph_marks = pl_module.graph_phase_marks()
        if ended:  # the optimizer stepped (StepPhases: every batch is a step without accumulation)
            self._current = None
            self._pending.append(step)
            if not (self._cuda and self.sync == "events"):
                self._collect(trainer, lag=0)  # host-clock values are final already

    # -- reading and logging --------------------------------------------------------------------

    def _collect(self, trainer: pl.Trainer, lag: int) -> None:
        """Read the oldest ended steps until ``lag`` stay unread (0: every step, as at the end of the fit).

        Which steps are read depends on the step count alone, never on whether their events have completed, so
        that every rank reads and gathers the same steps at the same hook. A step whose last event has not
        completed yet is waited for (its last kernel only, not the steps after it).
        """
        while len(self._pending) > lag:
            step = self._pending.pop(0)
            end = step.batches[-1].get(_END)
            if isinstance(end, torch.cuda.Event) and not end.query():
                end.synchronize()
            self._record(trainer, step)

    def _record(self, trainer: pl.Trainer, step: _Step) -> None:
        times, seen = phase_times(step.batches, elapsed_ms)
        if step.graphed:  # the phases from the marks inside the graph, if any; the step from the host's marks
            inner, inner_seen = phase_times([step.graph_marks], elapsed_ms) if step.graph_marks else ({}, set())
            seen = {"step_ms"} | (inner_seen - {"step_ms"})
            times.update({k: inner[k] for k in seen - {"step_ms"}})
        for marks in step.batches:
            self._event_pool.extend(m for m in marks.values() if isinstance(m, torch.cuda.Event))
        if "step_ms" not in seen:
            return
        step_ms = times["step_ms"]
        self._step_ms[step.index] = step_ms
        log_now = step.index % self.log_every_n_steps == 0
        if step.warmup:
            self.warmup_times.append(step_ms)
            if log_now:
                log_scalars(trainer, {"time/warmup_step_ms": step_ms}, step=step.index)
            return
        row: dict[str, float] = {"step": step.index}
        row.update({k: times[k] for k in PHASES if k in seen})
        self.step_times.append(row)
        if windows := timing_perturbed_by(trainer, step.index, exclude=self):
            self.excluded_steps[step.index] = windows
        if not log_now:
            return
        per_rank = None
        if trainer.world_size > 1:  # every rank gets here on the same steps (see _collect)
            mine = [times[k] if k in seen else math.nan for k in PHASES]
            per_rank = gather_values(trainer, mine + [math.nan if v is None else v for v in (step.tokens, step.flops)])
        metrics, raw = step_metrics(row, per_rank, step.tokens, step.flops, self._peak)
        if raw is not None and raw > 1.0:
            self._warn(f"CudaSyncTimer: MFU {raw:.2f} > 1 means the peak FLOP/s ({self._peak:.3g}) or the "
                       "measured time is wrong; throughput/mfu is clipped to 1.")
        if step.flops is None:
            self._warn("CudaSyncTimer: the module has no flops_per_batch; throughput/mfu is not logged.")
        elif raw is not None and step.float8_flops > 0:
            own = float8_step_peak_flops(step.flops, min(step.float8_flops, step.flops), self._peak, self._float8_peak)
            if own is not None:
                metrics["throughput/mfu_float8_peak"] = min(1.0, raw * self._peak / own)
        log_scalars(trainer, metrics, step=step.index)

    def _finish(self, trainer: pl.Trainer, log: bool = True) -> None:
        self._collect(trainer, lag=0)  # at the fit's end, on every rank
        if log and not self._summarised and not self.step_times and self.warmup_times:
            self._warn(f"CudaSyncTimer: every step of this fit ({len(self.warmup_times)}) was a warm-up step "
                       f"(warmup_steps={self.warmup_steps}); no summary. Lower warmup_steps or train for more steps.")
        if self._summarised or not self.step_times:
            return
        self._summarised = True
        text = self.summary_text()
        if self.print_summary:
            rank_zero_only(print)(text)
        if log:
            # at the last step of the fit (the step axis of every value; global_step has moved past it)
            log_text(trainer, "time/summary", text, step=max(self._phases.step, 0))

    # -- results --------------------------------------------------------------------------------

    def summary(self, excluded: bool = False) -> dict[str, dict[str, float]]:
        """Statistics of the summarised steps (``excluded``: of the steps other callbacks perturbed): phase key ->
        mean, std (sample; 0 for one step), median, min, max (ms) and count."""
        return phase_statistics(self._rows(excluded), PHASES)

    def step_ms(self, steps: Iterable[int]) -> dict[int, float]:
        """The step time in ms of each of ``steps`` that this fit measured, by step index (``global_step`` axis).

        Warm-up steps and the steps other callbacks perturbed are included: this is the timer's own measurement of
        those very steps, whatever the summary leaves out. In events mode a step is read two steps later, and the
        last ones in ``on_train_end``: after the fit, every step is here. A step not measured (not run yet, or cut
        short by an exception) is absent.

        Args:
            steps: step indices, e.g. ``range(6, 8)``.
        """
        return {step: self._step_ms[step] for step in steps if step in self._step_ms}

    def _rows(self, excluded: bool) -> list[dict[str, float]]:
        return [row for row in self.step_times if (row["step"] in self.excluded_steps) == excluded]

    def summary_text(self) -> str:
        """The summary as Markdown (see ``lmtrain.analysis.timing.summary_text``)."""
        clock = clock_name(self._cuda, self.sync)
        excluded = [{**row, "windows": self.excluded_steps[row["step"]]} for row in self._rows(True)]
        return summary_text(self._rows(False), excluded, self.warmup_times, clock,
                            self._model_row or ("model", 0), PHASES)

