"""MemorySnapshot: per-phase memory peaks, allocation-history window, timeline PNG, top allocations, OOM dump.

This module captures (allocator counters, allocation history, snapshots); what a snapshot means is worked
out by ``lmtrain.analysis.memory``, which ``python -m lmtrain analyze memory`` uses too.
"""

from __future__ import annotations

import pickle
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lmtrain.analysis import memory as analysis
from lmtrain.analysis.memory import GIB, MEMORY_VIZ_URL
from lmtrain.callbacks._common import (
    StepPhases,
    StepWindow,
    WarnOnce,
    check_int,
    check_ranks,
    gather_values,
    host_group,
    log_dir,
    log_image,
    log_scalars,
    log_text,
    waits_after,
    world_size,
)


class AllocatorHistory:
    """The one place that uses ``torch.cuda.memory``'s semi-private allocation-history API.

    ``_record_memory_history``, ``_snapshot`` (and ``_dump_snapshot``, which pickles ``_snapshot()``)
    are underscore-named but documented in PyTorch's "Understanding CUDA Memory Usage" guide and used
    by torchtitan; keeping every call here makes a future rename a one-line change.
    """

    @staticmethod
    def start(max_entries: int) -> None:
        """Record every allocation and free with its Python stack, keeping the last ``max_entries``."""
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                 max_entries=max_entries)

    @staticmethod
    def stop() -> None:
        torch.cuda.memory._record_memory_history(enabled=None)

    @staticmethod
    def snapshot() -> dict[str, Any]:
        """The allocator state and the recorded trace (the dict that ``_dump_snapshot`` pickles)."""
        return torch.cuda.memory._snapshot()

    @staticmethod
    def dump(snapshot: dict[str, Any], path: Path) -> Path:
        """Write ``snapshot`` exactly as ``torch.cuda.memory._dump_snapshot`` does (memory_viz opens it)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            pickle.dump(snapshot, f)
        return path


class MemorySnapshot(pl.Callback):
    """Where GPU memory goes: peaks per phase every logged step, and a full allocation history in a window.

    Every logged step (``global_step`` a multiple of ``log_every_n_steps``, by default the trainer's; host-side
    allocator counters, no device synchronisation): the peak is reset at the step's start
    (``torch.cuda.reset_peak_memory_stats``) and read at the end of each phase (``torch.cuda.max_memory_allocated``),
    so ``peak_after_backward`` is the highest point from the step's start to the end of backward. Steps that are not
    logged read nothing. Logging every step cost the host about 2.5 ms per step on two ranks of the small model's eager
    fit on H200s (measured with ``benchmarks/scripts/hook_cost.py``), and a host-bound step is longer by that much:
    hence the default follows the trainer's cadence rather than logging every step.

    Under CUDA graphs (``LMModule(cuda_graphs=True)``) a replayed step makes no allocator calls: the counters see
    neither its intermediates nor its gradients, so its peaks would be the static memory alone. Replayed steps
    therefore log no ``peak_after_*`` tag but ``memory/graph_capture_peak_gib``, the peak of the step that captured
    the graph (the memory every replay reuses), besides ``allocated_gib`` and ``reserved_gib`` (which holds the
    graph's private pool). The window's steps run eagerly (``needs_eager_step``), so the snapshot sees their
    allocations. One line at setup says so.

    In the window (``start_step``, ``num_steps``) the allocator records every allocation and free with
    its Python stack (``stacks="python"``, at most ``max_entries`` entries). At the window's end this
    callback writes, into the logger's folder:

    - ``memory_snapshot_steps_<a>-<b>.pickle``: open it at https://pytorch.org/memory_viz (drag and drop);
    - ``memory_timeline_steps_<a>-<b>.png``: live bytes over allocation events, forward / backward /
      optimizer shaded, the peak marked (also logged as the TensorBoard image ``memory/timeline``);
    - the ``top_n`` largest allocations live at the peak, with the Python frame that made them and
      the phase they were made in, or the parameter / gradient / optimizer state they hold (TensorBoard
      text ``memory/top_allocations``).

    ``on_oom=True``: recording runs from ``setup`` on (every allocation then pays for a Python stack
    capture, for the whole run), and a CUDA out-of-memory error dumps the snapshot
    (``memory_snapshot_oom_step<k>.pickle``) and prints a one-screen summary of what was live by
    category (parameters, gradients, optimizer state, activations and other), also logged as text
    ``memory/oom_summary``; the error is then re-raised by Lightning as usual.

    Without CUDA there is nothing to measure: one warning, and no memory metrics.

    Metrics (TensorBoard scalars, GiB = 2**30 bytes, every ``log_every_n_steps`` steps):

    - ``memory/peak_after_forward_gib``: peak allocated from step start to the end of forward (to the end
      of the step when it has no backward).
    - ``memory/peak_after_backward_gib``: ... to the end of backward (steps with a backward).
    - ``memory/peak_after_optimizer_gib``: ... to the end of the step (steps with an optimizer step).
    - ``memory/allocated_gib``: allocated by tensors at the end of the step.
    - ``memory/reserved_gib``: held by PyTorch's caching allocator at the end of the step.
    - ``memory/graph_capture_peak_gib``: under CUDA graphs, at the capture step and every logged replayed step:
      the peak allocated over the step that captured the graph (its dry-run pass, the capture and the first replay).
    - ``memory/timeline`` (image), ``memory/top_allocations`` and ``memory/oom_summary`` (text).

    Several ranks: the values above are rank 0's; every rank's peak of the logged step (the step's highest
    allocated memory) is gathered (one small ``all_gather`` of a host-side float over a gloo group on logged steps,
    ``lmtrain.callbacks._common.host_group``: it does not wait for the GPU) and rank 0 also logs
    ``memory/peak_gib_max`` (GiB, the highest over the ranks) and ``memory/peak_gib_rank{r}`` (GiB, each rank).
    Allocation history (window and ``on_oom``) is recorded on the ``ranks`` only; each writes its own files, with
    the rank in the name (``memory_snapshot_rank{r}_steps_<a>-<b>.pickle``, ``memory_timeline_rank{r}_...png``,
    ``memory_snapshot_oom_rank{r}_step<k>.pickle``); the TensorBoard image and texts come from rank 0 when it
    records.

    Args:
        start_step: first step of the history window, on Lightning's ``global_step`` axis (see
            ``lmtrain.callbacks._common.StepPhases``; every micro-batch of a step is in it); None: no window,
            only the per-step peaks.
        num_steps: steps (optimizer steps) in the window.
        max_entries: most trace entries kept (a ring buffer); each costs some hundred bytes plus
            its stack.
        top_n: rows of the top-allocation table.
        on_oom: record from the start and dump the snapshot and a summary on CUDA out-of-memory.
        log_every_n_steps: log the per-step scalars of every n-th step; None (default): the trainer's
            ``log_every_n_steps`` (Lightning's default 50; 10 in lmtrain's configs; 0, as for the trainer, logs
            none of them).
        ranks: the ranks that record allocation history (default ``[0]``).
    """

    def __init__(self, start_step: int | None = 5, num_steps: int = 1, max_entries: int = 1_000_000, top_n: int = 10,
                 on_oom: bool = False, log_every_n_steps: int | None = None, ranks: list[int] | None = None) -> None:
        super().__init__()
        self.ranks = [0] if ranks is None else ranks
        self.start_step = start_step
        self.num_steps = num_steps
        self.max_entries = max_entries
        self.top_n = top_n
        self.on_oom = on_oom
        self.log_every_n_steps = log_every_n_steps
        self.files: list[Path] = []  # files written (pickles, PNGs), for scripts and tests
        self._warn = WarnOnce()
        self._cuda = False
        self._device: torch.device | None = None
        self._recording = False
        self._window = StepWindow(start_step, num_steps)
        self._beyond = False  # the window lies beyond max_steps (warned in setup)
        self._phases = StepPhases()
        self._phase_start_us = 0
        self._measure = False  # this step's peaks are read and logged
        self._window_first: int | None = None  # first step of the window in this fit
        self._window_done = False
        self._marks: list[analysis.PhaseMark] = []
        self._labels_before: dict[int, str] = {}
        self._values: dict[str, float] = {}
        self._records = True  # this rank records allocation history (it is in ``ranks``)
        self._rank = ""  # file-name part: "" on one process, "rank<r>_" on several
        self._world = 1  # processes of the fit (set in setup)
        self._log_now = False  # this step's values are logged (a logged step)
        self._log_every = 1  # steps between logged steps (log_every_n_steps, or the trainer's; set in setup)
        self._graphed_steps = 0  # steps replayed as a CUDA graph in this fit (the first one captures the graph)
        self._capture_peak: float | None = None  # GiB, the peak of the step that captured the CUDA graph

    def in_window(self, step: int) -> bool:
        """Step ``step`` lies in the allocation-history window."""
        return self._cuda and self._window.contains(step)

    def perturbs_timing(self, step: int) -> bool:
        """Yes inside the history window: every allocation pays for a Python stack capture. On several ranks also
        the step after it: the ranks in ``ranks`` write their snapshot and timeline when the window ends, and the
        others wait for them in that step's first collective (0.4 s at 2.7B on 4 GPUs). The per-step peaks do not:
        on a logged step, one reset of the peak counter and up to three ``torch.cuda.memory_stats()`` reads
        (after forward, after backward, at the end; host-side, a few tens of microseconds each), plus on several
        ranks one gather of one float over gloo, none of them waiting for the GPU. ``on_oom`` recording slows every
        step alike (said once at setup)."""
        return self.in_window(step) or (self._cuda and waits_after(self._window, step, self._world))

    def needs_eager_step(self, step: int) -> bool:
        """The window's steps: a CUDA graph replay (``LMModule(cuda_graphs=True)``) makes no allocator calls, so
        the allocation history would hold almost nothing; they run eagerly."""
        return self.in_window(step)

    # -- setup / teardown -----------------------------------------------------------------------

    def check_arguments(self, world_size: int = 1) -> None:
        """Check the arguments: ``setup`` calls it, and the command line before any log folder exists.

        Args:
            world_size: the number of processes of the run.

        Raises:
            LmtrainError: an argument is out of range, naming it.
        """
        check_int("MemorySnapshot", "start_step", self.start_step, 0, allow_none=True,
                  fix="use start_step >= 0, or None for the per-step peaks alone.")
        for name in ("num_steps", "max_entries", "top_n"):
            check_int("MemorySnapshot", name, getattr(self, name), 1)
        check_int("MemorySnapshot", "log_every_n_steps", self.log_every_n_steps, 1, allow_none=True,
                  fix="use log_every_n_steps >= 1, or None for the trainer's.")
        check_ranks("MemorySnapshot", self.ranks, world_size)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.check_arguments(world_size(trainer))
        log_dir(trainer)  # on several ranks a collective: read it now, on every rank (see _common.log_dir)
        self._records = trainer.global_rank in self.ranks
        self._world = world_size(trainer)
        self._rank = "" if self._world == 1 else f"rank{trainer.global_rank}_"
        self._device = trainer.strategy.root_device
        self._cuda = self._device.type == "cuda"
        self._window = StepWindow(self.start_step, self.num_steps)
        self._phases.reset()
        self._marks, self.files, self._window_done, self._window_first = [], [], False, None
        self._graphed_steps, self._capture_peak = 0, None
        # The trainer's cadence by default; Lightning's log_every_n_steps=0 logs nothing (and neither does this)
        self._log_every = (self.log_every_n_steps if self.log_every_n_steps is not None
                           else getattr(trainer, "log_every_n_steps", 1))
        host_group(trainer)  # a collective the first time: made now, on every rank together
        if not self._cuda:
            self._warn("MemorySnapshot: memory peaks, snapshots and OOM dumps need a CUDA device; on "
                       f"{self._device.type} nothing is measured or logged.")
            return
        self._beyond = self._records and self._window.beyond(getattr(trainer, "max_steps", None))
        if self._beyond:  # said now, once, rather than after the whole run
            self._warn(f"MemorySnapshot: the snapshot window ({self._window.describe()}) ends after the last step of "
                       f"max_steps {trainer.max_steps}; no snapshot will be written. Lower start_step or train for "
                       "more steps.")
        if getattr(pl_module, "graphed_step", None) is not None:
            rank_zero_info("MemorySnapshot: under model.cuda_graphs a replayed step makes no allocator calls; replayed "
                           "steps log memory/graph_capture_peak_gib (the capture step's peak, which every replay "
                           "reuses), allocated_gib and reserved_gib (graph pool included), no peak_after_*; the "
                           "snapshot window's steps run eagerly.")
        if self.on_oom and self._records:
            rank_zero_info("MemorySnapshot: on_oom records allocation history from the start; every step pays for it "
                           "alike, and CudaSyncTimer's times include that cost.")
            self._start_recording()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if (stage == "fit" and self._cuda and self._records and self.start_step is not None and not self._window_done
                and not self._beyond):
            self._warn(f"MemorySnapshot: training stopped after {self._phases.batches_seen} batches, before the end of "
                       f"the snapshot window ({self._window.describe()}; last step run: {self._phases.step}); no "
                       "snapshot was written. Lower start_step or train for more steps.")
        self._stop_recording()

    def _start_recording(self) -> None:
        if not self._recording:
            AllocatorHistory.start(self.max_entries)
            self._recording = True

    def _stop_recording(self) -> None:
        if self._recording:
            AllocatorHistory.stop()
            self._recording = False

    # -- Lightning hooks ------------------------------------------------------------------------

    def _boundary(self) -> None:
        """The phase in progress ends now: read its peak, and in the window keep its host times (µs)."""
        phase = self._phases.phase
        if self._measure and phase in ("forward", "backward"):
            # Every micro-batch overwrites: the value covers the step's start to the end of its last forward
            # (backward) pass.
            self._values[f"memory/peak_after_{phase}_gib"] = torch.cuda.max_memory_allocated(self._device) / GIB
        if self._window.contains(self._phases.step):
            now = time.time_ns() // 1000
            self._marks.append(analysis.PhaseMark(self._phases.step, phase or "forward", self._phase_start_us, now))
            self._phase_start_us = now

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = self._phases.batch_start(trainer)
        if not self._cuda:
            return
        if self._records and not self._window_done and self._phases.starts_fit_after(self._window.last_step):
            self._window_done = True  # a resumed fit, its first step after the window
            self._warn(f"MemorySnapshot: this fit starts at step {step} (resumed), after the snapshot window "
                       f"({self._window.describe()}); no snapshot is written in it. Set start_step to a step from "
                       f"{step} on to snapshot this run.")
        if self._phases.first_batch:
            # Each read of the counters builds torch.cuda.memory_stats' whole dict: read only what is logged, and
            # the step that captures a CUDA graph (the first replayed step: its peak is what every replay reuses).
            self._log_now = bool(self._log_every) and step % self._log_every == 0
            capture = self._phases.graphed and self._graphed_steps == 0
            self._graphed_steps += self._phases.graphed
            self._measure = self._log_now or capture
            if self._measure:
                torch.cuda.reset_peak_memory_stats(self._device)
                self._values = {}
        if self._phases.enters(self._window) and not self._window_done:
            self._marks, self._window_first = [], step
            # Tensors that exist before the recording starts have no trace entry: name them now.
            self._labels_before = analysis.tensor_labels(pl_module, trainer.optimizers)
            if self._records:
                self._start_recording()
        self._phase_start_us = time.time_ns() // 1000

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._cuda:
            self._boundary()
        self._phases.before_backward()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._cuda:
            self._boundary()
        self._phases.after_backward()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._cuda and not self._phases.graphed:  # a replayed step is one phase, start to end
            self._boundary()
        self._phases.before_optimizer_step()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._cuda:
            self._phases.batch_end(trainer)
            return
        stepped = self._phases.stepped
        self._boundary()
        if not self._phases.batch_end(trainer):
            return  # a micro-batch: the step goes on
        step = self._phases.step
        if self._measure:
            stats = torch.cuda.memory_stats(self._device)  # one read for the peak, allocated and reserved
            peak = stats.get("allocated_bytes.all.peak", 0) / GIB
            if not self._phases.graphed:
                self._values.setdefault("memory/peak_after_forward_gib", peak)  # a step without backward
                if stepped:
                    self._values["memory/peak_after_optimizer_gib"] = peak
            else:  # the replay allocated nothing: the peak that holds for it is the capture step's
                if self._capture_peak is None:
                    self._capture_peak = peak
                peak = self._capture_peak
                self._values["memory/graph_capture_peak_gib"] = peak
            self._values["memory/allocated_gib"] = stats.get("allocated_bytes.all.current", 0) / GIB
            self._values["memory/reserved_gib"] = stats.get("reserved_bytes.all.current", 0) / GIB
            if self._log_now and world_size(trainer) > 1:  # every rank logs the same steps
                peaks = [row[0] for row in gather_values(trainer, [peak])]
                self._values["memory/peak_gib_max"] = max(peaks)
                self._values.update({f"memory/peak_gib_rank{r}": v for r, v in enumerate(peaks)})
            if self._log_now:
                log_scalars(trainer, self._values, step=step)
        if self._recording and self._phases.leaves(self._window) and not self._window_done:
            self._finish_window(trainer, pl_module)

    def _finish_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._window_done = True
        snapshot = AllocatorHistory.snapshot()
        if not self.on_oom:
            self._stop_recording()
        first, last = self._window_first, self._phases.step
        folder = Path(log_dir(trainer) or ".")
        name = f"memory_snapshot_{self._rank}steps_{first}-{last}.pickle"
        pickle_path = AllocatorHistory.dump(snapshot, folder / name)
        self.files.append(pickle_path)
        device = self._device.index if self._device.index is not None else torch.cuda.current_device()
        title = f"{_model_name(pl_module)}: active memory, steps {first}-{last}"
        fig = analysis.render_timeline(snapshot, device, self._marks, title=title)
        png_path = folder / f"memory_timeline_{self._rank}steps_{first}-{last}.png"
        fig.savefig(png_path, dpi=110)
        self.files.append(png_path)
        log_image(trainer, "memory/timeline", fig, step=last)
        text = analysis.peak_report(snapshot, device, self.top_n, self._marks, self._labels_before,
                           analysis.tensor_labels(pl_module, trainer.optimizers), where=f"steps {first}-{last}",
                           snapshot_name=pickle_path.name)
        log_text(trainer, "memory/top_allocations", text, step=last)
        message = f"MemorySnapshot: wrote {pickle_path} (open at {MEMORY_VIZ_URL}) and {png_path}."
        print(message, file=sys.stderr) if self._rank else rank_zero_info(message)

    # -- out of memory --------------------------------------------------------------------------

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:
            if self._recording and self.on_oom and isinstance(exception, torch.OutOfMemoryError):
                self._dump_oom(trainer, pl_module)
        finally:
            self._stop_recording()  # Lightning skips teardown after an exception; it re-raises the error

    def _dump_oom(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        snapshot = AllocatorHistory.snapshot()  # on whichever rank ran out (it records: see ``ranks``)
        folder = Path(log_dir(trainer) or ".")
        name = f"memory_snapshot_oom_{self._rank}step{self._phases.step}.pickle"
        path = AllocatorHistory.dump(snapshot, folder / name)
        self.files.append(path)
        device = self._device.index if self._device.index is not None else torch.cuda.current_device()
        categories = analysis.memory_by_category(pl_module, trainer.optimizers,
                                                 torch.cuda.memory_allocated(self._device), self._device)
        live = analysis.live_at_end(snapshot, device)
        free, total = torch.cuda.mem_get_info(self._device)
        top = analysis.top_allocations_table(live, min(self.top_n, 5), self._marks, self._labels_before,
                                             analysis.tensor_labels(pl_module, trainer.optimizers))
        text = analysis.oom_summary(categories, step=self._phases.step, phase=self._phases.phase or "between batches",
                                    reserved=torch.cuda.memory_reserved(self._device), device_total=total,
                                    device_free=free, top=top, snapshot_name=str(path))
        print(text, file=sys.stderr)
        log_text(trainer, "memory/oom_summary", text, step=self._phases.step)


def _model_name(pl_module: pl.LightningModule) -> str:
    size = getattr(getattr(pl_module, "hparams", None), "size", None)
    return str(size) if size is not None else type(pl_module).__name__
