"""MemorySnapshot: per-phase memory peaks, allocation-history window, timeline PNG, top allocations, OOM dump."""

from __future__ import annotations

import bisect
import os
import pickle
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from typing_extensions import override

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

GIB = 1024**3
MIB = 1024**2

#: Phase names marked on the timeline, with their colours.
PHASE_COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "after backward": "tab:gray",
                 "optimizer": "tab:green"}

#: Link printed next to every snapshot file.
MEMORY_VIZ_URL = "https://pytorch.org/memory_viz"


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


@dataclass
class PhaseMark:
    """A phase of a step in the window, as host times (µs since the epoch, the trace's ``time_us``)."""

    step: int
    phase: str
    start_us: int
    end_us: int


@dataclass
class LiveAllocation:
    """One block that was live at the chosen point of the trace."""

    size: int
    address: int
    frames: list[dict[str, Any]]
    time_us: int | None  # when it was allocated; None: before the recording started
    survives: bool = True  # still the same block at the snapshot (its address can name a tensor then)


class MemorySnapshot(pl.Callback):
    """Where GPU memory goes: peaks per phase every step, and a full allocation history in a window.

    Every logged step (every ``log_every_n_steps``-th; host-side allocator counters, no device
    synchronisation): the peak is reset at the step's start (``torch.cuda.reset_peak_memory_stats``) and
    read at the end of each phase (``torch.cuda.max_memory_allocated``), so ``peak_after_backward`` is the
    highest point from the step's start to the end of backward. Steps that are not logged read nothing.

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
    - ``memory/timeline`` (image), ``memory/top_allocations`` and ``memory/oom_summary`` (text).

    Args:
        start_step: first step of the history window (training batches since the fit started);
            None: no window, only the per-step peaks.
        num_steps: steps in the window.
        max_entries: most trace entries kept (a ring buffer); each costs some hundred bytes plus
            its stack.
        top_n: rows of the top-allocation table.
        on_oom: record from the start and dump the snapshot and a summary on CUDA out-of-memory.
        log_every_n_steps: log the per-step scalars of every n-th step.
    """

    def __init__(
        self,
        start_step: int | None = 5,
        num_steps: int = 1,
        max_entries: int = 1_000_000,
        top_n: int = 10,
        on_oom: bool = False,
        log_every_n_steps: int = 1,
    ) -> None:
        super().__init__()
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
        self._index = 0
        self._phase = "forward"
        self._stepped = False
        self._phase_start_us = 0
        self._measure = False  # this step's peaks are read and logged
        self._window_done = False
        self._marks: list[PhaseMark] = []
        self._labels_before: dict[int, str] = {}
        self._values: dict[str, float] = {}

    # -- setup / teardown -----------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        check_int("MemorySnapshot", "start_step", self.start_step, 0, allow_none=True,
                  fix="use start_step >= 0, or None for the per-step peaks alone.")
        for name in ("num_steps", "max_entries", "top_n", "log_every_n_steps"):
            check_int("MemorySnapshot", name, getattr(self, name), 1)
        self._device = trainer.strategy.root_device
        self._cuda = self._device.type == "cuda"
        self._window = StepWindow(self.start_step, self.num_steps)
        self._marks, self.files, self._window_done = [], [], False
        if not self._cuda:
            self._warn("MemorySnapshot: memory peaks, snapshots and OOM dumps need a CUDA device; on "
                       f"{self._device.type} nothing is measured or logged.")
            return
        if self.on_oom:
            self._start_recording()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._cuda and self.start_step is not None and not self._window_done:
            self._warn(f"MemorySnapshot: training stopped after {self._window.batches_seen} batches, before the "
                       f"end of the snapshot window (start_step={self.start_step}, num_steps={self.num_steps}); "
                       "no snapshot was written. Lower start_step or train for more steps.")
        self._stop_recording()

    def _start_recording(self) -> None:
        if not self._recording:
            AllocatorHistory.start(self.max_entries)
            self._recording = True

    def _stop_recording(self) -> None:
        if self._recording:
            AllocatorHistory.stop()
            self._recording = False

    # -- window ---------------------------------------------------------------------------------

    def _phase_boundary(self, next_phase: str | None) -> None:
        """Close the current phase and open ``next_phase``; in the window, keep its host times (µs)."""
        if self._window.contains(self._index):
            now = time.time_ns() // 1000
            self._marks.append(PhaseMark(self._index, self._phase, self._phase_start_us, now))
            self._phase_start_us = now
        if next_phase is not None:
            self._phase = next_phase

    # -- Lightning hooks ------------------------------------------------------------------------

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._index = self._window.next_batch()
        if not self._cuda:
            return
        self._phase, self._stepped = "forward", False
        # Each read of the counters builds torch.cuda.memory_stats' whole dict: read only what is logged.
        self._measure = self._index % self.log_every_n_steps == 0
        if self._measure:
            torch.cuda.reset_peak_memory_stats(self._device)
            self._values = {}
        if self._window.contains(self._index):
            if self._window.is_first(self._index):
                self._marks = []
                # Tensors that exist before the recording starts have no trace entry: name them now.
                self._labels_before = tensor_labels(pl_module, trainer.optimizers)
                self._start_recording()
            self._phase_start_us = time.time_ns() // 1000

    def _peak(self, key: str) -> None:
        if self._measure:
            self._values[key] = torch.cuda.max_memory_allocated(self._device) / GIB

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._cuda:
            self._peak("memory/peak_after_forward_gib")
            self._phase_boundary("backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._cuda:
            self._peak("memory/peak_after_backward_gib")
            self._phase_boundary("after backward")

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._cuda:
            self._phase_boundary("optimizer")
            self._stepped = True

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._cuda:
            return
        if self._measure:
            stats = torch.cuda.memory_stats(self._device)  # one read for the peak, allocated and reserved
            peak = stats.get("allocated_bytes.all.peak", 0) / GIB
            self._values.setdefault("memory/peak_after_forward_gib", peak)  # a step without backward
            if self._stepped:
                self._values["memory/peak_after_optimizer_gib"] = peak
            self._values["memory/allocated_gib"] = stats.get("allocated_bytes.all.current", 0) / GIB
            self._values["memory/reserved_gib"] = stats.get("reserved_bytes.all.current", 0) / GIB
            log_scalars(trainer, self._values, step=self._index)
        self._phase_boundary(None)
        if self._window.is_last(self._index):
            self._finish_window(trainer, pl_module)

    def _finish_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._window_done = True
        snapshot = AllocatorHistory.snapshot()
        if not self.on_oom:
            self._stop_recording()
        if not rank_zero_only.rank == 0:
            return
        first, last = self.start_step, self._index
        folder = Path(log_dir(trainer) or ".")
        pickle_path = AllocatorHistory.dump(snapshot, folder / f"memory_snapshot_steps_{first}-{last}.pickle")
        self.files.append(pickle_path)
        device = self._device.index if self._device.index is not None else torch.cuda.current_device()
        trace = device_trace(snapshot, device)
        title = f"{_model_name(pl_module)}: active memory, steps {first}-{last}"
        fig = render_timeline(snapshot, device, self._marks, title=title)
        png_path = folder / f"memory_timeline_steps_{first}-{last}.png"
        fig.savefig(png_path, dpi=110)
        self.files.append(png_path)
        log_image(trainer, "memory/timeline", fig, step=last)
        live, peak_bytes = live_at_peak(snapshot, device)
        after = tensor_labels(pl_module, trainer.optimizers)
        in_window = [x for x in live if x.time_us is not None]
        text = "\n".join([
            f"Live at the peak of steps {first}-{last}: {peak_bytes / GIB:.2f} GiB allocated ({len(trace)} trace "
            f"entries; snapshot `{pickle_path.name}`, open at {MEMORY_VIZ_URL}).", "",
            live_by_category_table(live, self._marks, self._labels_before, after), "",
            f"Largest blocks allocated in the window and live at the peak ({len(in_window)} blocks):", "",
            top_allocations_table(in_window, self.top_n, self._marks, self._labels_before, after), "",
            "Largest live blocks overall:", "",
            top_allocations_table(live, min(5, self.top_n), self._marks, self._labels_before, after),
        ])
        log_text(trainer, "memory/top_allocations", text, step=last)
        rank_zero_info(f"MemorySnapshot: wrote {pickle_path} (open at {MEMORY_VIZ_URL}) and {png_path}.")

    # -- out of memory --------------------------------------------------------------------------

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:
            if self._cuda and self.on_oom and isinstance(exception, torch.OutOfMemoryError):
                self._dump_oom(trainer, pl_module)
        finally:
            self._stop_recording()  # Lightning skips teardown after an exception; it re-raises the error

    def _dump_oom(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        snapshot = AllocatorHistory.snapshot()
        if rank_zero_only.rank != 0:
            return
        folder = Path(log_dir(trainer) or ".")
        path = AllocatorHistory.dump(snapshot, folder / f"memory_snapshot_oom_step{self._index}.pickle")
        self.files.append(path)
        device = self._device.index if self._device.index is not None else torch.cuda.current_device()
        categories = memory_by_category(pl_module, trainer.optimizers, torch.cuda.memory_allocated(self._device),
                                        self._device)
        live = live_at_end(snapshot, device)
        free, total = torch.cuda.mem_get_info(self._device)
        text = oom_summary(categories, step=self._index, phase=self._phase,
                           reserved=torch.cuda.memory_reserved(self._device), device_total=total, device_free=free,
                           top=top_allocations_table(live, min(self.top_n, 5), self._marks, self._labels_before,
                                                     tensor_labels(pl_module, trainer.optimizers)),
                           snapshot_name=str(path))
        print(text, file=sys.stderr)
        log_text(trainer, "memory/oom_summary", text, step=self._index)


# -- snapshot analysis (pure functions of the snapshot dict; tested on synthetic snapshots) --------


def device_trace(snapshot: dict[str, Any], device: int) -> list[dict[str, Any]]:
    """Trace entries of one device (empty if none were recorded)."""
    traces = snapshot.get("device_traces") or []
    return traces[device] if device < len(traces) else []


def _active_blocks(snapshot: dict[str, Any], device: int) -> Iterable[dict[str, Any]]:
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        for block in seg.get("blocks", []):
            if block.get("state") == "active_allocated":
                yield block


def _replay(snapshot: dict[str, Any], device: int) -> tuple[list[int], list[int], dict[int, int], dict[int, int]]:
    """Replay alloc / free_completed entries.

    Returns the trace positions of those entries, the live bytes after each, and the blocks that were
    live before the recording started: {address: size} of those freed during the trace (keyed by the
    position of their free) and of those still live at the snapshot.
    """
    trace = device_trace(snapshot, device)
    live: dict[int, int] = {}
    freed_before: dict[int, int] = {}  # position of the free -> size, for blocks allocated before recording
    positions: list[int] = []
    deltas: list[int] = []
    for i, e in enumerate(trace):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e["size"]
            positions.append(i)
            deltas.append(e["size"])
        elif action == "free_completed":
            if e["addr"] in live:
                del live[e["addr"]]
            else:
                freed_before[i] = e["size"]
            positions.append(i)
            deltas.append(-e["size"])
    still_live = {b["address"]: b["size"] for b in _active_blocks(snapshot, device) if b["address"] not in live}
    baseline = sum(freed_before.values()) + sum(still_live.values())
    totals, running = [], baseline
    for d in deltas:
        running += d
        totals.append(running)
    return positions, [baseline, *totals], freed_before, still_live


def memory_curve(snapshot: dict[str, Any], device: int) -> tuple[list[int], list[int]]:
    """(trace position, live bytes) after each alloc / free_completed entry, starting with the bytes that
    were live when the recording started (position -1): the active-memory timeline of memory_viz."""
    positions, totals, _, _ = _replay(snapshot, device)
    return [-1, *positions], totals


def _live_until(snapshot: dict[str, Any], device: int, stop: int) -> list[LiveAllocation]:
    """Blocks live just after trace position ``stop`` (``len(trace)``: at the snapshot)."""
    trace = device_trace(snapshot, device)
    _, _, freed_before, still_live = _replay(snapshot, device)
    frames_by_addr = {b["address"]: b.get("frames", []) for b in _active_blocks(snapshot, device)}
    live: dict[int, LiveAllocation] = {}
    for e in trace[: stop + 1]:
        if e.get("action") == "alloc":
            live[e["addr"]] = LiveAllocation(e["size"], e["addr"], e.get("frames", []), e.get("time_us"))
        elif e.get("action") == "free_completed":
            live.pop(e["addr"], None)
    for e in trace[stop + 1:]:
        if e.get("action") == "free_completed" and e["addr"] in live:
            live[e["addr"]].survives = False
    out = list(live.values())
    out += [LiveAllocation(size, trace[i]["addr"], [], None, survives=False)
            for i, size in freed_before.items() if i > stop]
    out += [LiveAllocation(size, addr, frames_by_addr.get(addr, []), None) for addr, size in still_live.items()]
    return out


def live_at_peak(snapshot: dict[str, Any], device: int) -> tuple[list[LiveAllocation], int]:
    """Blocks live at the trace's highest point, and that many bytes."""
    positions, totals = memory_curve(snapshot, device)
    k = max(range(len(totals)), key=totals.__getitem__)
    return _live_until(snapshot, device, positions[k]), totals[k]


def live_at_end(snapshot: dict[str, Any], device: int) -> list[LiveAllocation]:
    """Blocks live at the snapshot (after an OOM: what filled the device)."""
    return _live_until(snapshot, device, len(device_trace(snapshot, device)))


_LIBRARY_PARTS = ("site-packages", "dist-packages", f"{os.sep}lib{os.sep}python")
_LMTRAIN_DIR = str(Path(__file__).resolve().parents[1])


def _is_library(filename: str) -> bool:
    if filename.startswith(_LMTRAIN_DIR):
        return False
    return filename.startswith("<") or any(part in filename for part in _LIBRARY_PARTS)


def _is_lightning(filename: str) -> bool:
    return f"{os.sep}lightning{os.sep}" in filename or f"{os.sep}pytorch_lightning{os.sep}" in filename


def informative_frame(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The frame that says *why* a block was allocated. Frames are innermost first.

    1. the innermost frame of model code (lmtrain or the user's own files) reached before any Lightning
       frame: e.g. ``lmtrain/model.py:91 forward`` for an MLP activation. (Below Lightning lies only
       the script that called ``trainer.fit``, which says nothing about the allocation.)
    2. otherwise the innermost frame in ``torch/optim`` or ``torch/nn`` (optimizer state, a module);
    3. otherwise the innermost frame; None when there is no Python frame (e.g. autograd's backward
       runs on its own C++ thread).
    """
    for f in frames:
        name = f.get("filename", "")
        if _is_lightning(name):
            break
        if not _is_library(name):
            return f
    for f in frames:
        name = f.get("filename", "")
        if f"torch{os.sep}optim{os.sep}" in name or f"torch{os.sep}nn{os.sep}" in name:
            return f
    return frames[0] if frames else None


def _short_path(filename: str) -> str:
    parts = Path(filename).parts
    for anchor in ("lmtrain", "torch", "lightning"):
        if anchor in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(anchor) - 1:])
    return "/".join(parts[-2:])


def describe_frame(frame: dict[str, Any] | None) -> str:
    if frame is None:
        return "(no Python frame: autograd backward or C++)"
    return f"{_short_path(frame.get('filename', '?'))}:{frame.get('line', '?')} {frame.get('name', '')}".strip()


def _phase_of(time_us: int | None, marks: list[PhaseMark]) -> str:
    if time_us is None:
        return "before window"
    for m in marks:
        if m.start_us <= time_us <= m.end_us:
            return f"step {m.step} {m.phase}"
    return "-"


def _label(a: LiveAllocation, labels_before: dict[int, str], labels_after: dict[int, str]) -> str | None:
    """What tensor a block holds: named at the snapshot if it survived until then, else (for blocks from
    before the recording) by the tensors that existed when the window opened."""
    if a.survives and a.address in labels_after:
        return labels_after[a.address]
    if a.time_us is None and a.address in labels_before:
        return f"{labels_before[a.address]} (from before the window)"
    return None


def _category(a: LiveAllocation, marks: list[PhaseMark], labels_before: dict[int, str],
              labels_after: dict[int, str]) -> str:
    label = _label(a, labels_before, labels_after)
    if label is not None:
        kind = label.split(" ", 1)[0]
        return {"parameter": "parameters", "gradient": "gradients", "optimizer": "optimizer state"}.get(kind, kind)
    if a.time_us is None:
        return "other, allocated before the window"
    phase = _phase_of(a.time_us, marks)
    return f"allocated in {phase.split(' ', 2)[-1] if phase.startswith('step ') else phase}"


def live_by_category_table(live: list[LiveAllocation], marks: list[PhaseMark],
                           labels_before: dict[int, str] | None = None,
                           labels_after: dict[int, str] | None = None) -> str:
    """Markdown table: live blocks grouped by what they hold (parameters, gradients, optimizer state) or,
    for the rest, by the phase that allocated them (activations: forward)."""
    groups: dict[str, list[int]] = {}
    for a in live:
        groups.setdefault(_category(a, marks, labels_before or {}, labels_after or {}), []).append(a.size)
    total = sum(a.size for a in live) or 1
    rows = [[name, len(sizes), f"{sum(sizes) / GIB:.2f}", f"{100 * sum(sizes) / total:.0f}%"]
            for name, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1]))]
    return markdown_table(["live at the peak", "blocks", "GiB", "share"], rows)


def top_allocations_table(live: list[LiveAllocation], top_n: int, marks: list[PhaseMark],
                          labels_before: dict[int, str] | None = None,
                          labels_after: dict[int, str] | None = None) -> str:
    """Markdown table of the ``top_n`` largest live blocks: size, phase, what holds it or where it was made."""
    rows = []
    for rank, a in enumerate(sorted(live, key=lambda a: -a.size)[:top_n], start=1):
        label = _label(a, labels_before or {}, labels_after or {})
        origin = describe_frame(informative_frame(a.frames)) if a.frames or a.time_us is not None else None
        origin = f"{label} ({origin})" if label and origin else (label or origin or "(allocated before recording)")
        rows.append([rank, f"{a.size / MIB:,.1f}", _phase_of(a.time_us, marks), origin])
    return markdown_table(["#", "size (MiB)", "allocated in", "tensor / Python frame"], rows)


def render_timeline(snapshot: dict[str, Any], device: int, marks: list[PhaseMark], title: str = "Active memory"):
    """Matplotlib figure: live GiB over allocation events, phases shaded, peak marked (no display needed)."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display, no backend switch

    trace = device_trace(snapshot, device)
    positions, totals = memory_curve(snapshot, device)
    x = list(range(len(totals)))  # event number, as in memory_viz
    y = [t / GIB for t in totals]
    fig = Figure(figsize=(11, 4.5))
    ax = fig.add_subplot()
    ax.fill_between(x, y, step="post", color="0.75", linewidth=0)
    ax.plot(x, y, drawstyle="steps-post", color="0.2", linewidth=1.0)
    # Phase boundaries: the first event at or after each mark's host time.
    times = [trace[p].get("time_us", 0) if p >= 0 else 0 for p in positions]
    # Phases: shaded behind the curve, and as a ribbon along the top where each phase is at least 0.6%
    # of the width (a fused optimizer step makes few allocation events and would not be visible).
    seen_phase: set[str] = set()
    min_width = max(1.0, 0.006 * len(x))
    for m in marks:
        a = bisect.bisect_left(times, m.start_us)
        b = bisect.bisect_left(times, m.end_us)
        colour = PHASE_COLOURS.get(m.phase, "tab:gray")
        label = m.phase if m.phase not in seen_phase else None
        seen_phase.add(m.phase)
        # Event k is drawn at x = k: a phase holding events a .. b-1 spans [a, b).
        ax.axvspan(a, max(b, a + 1), color=colour, alpha=0.15, linewidth=0)
        ax.axvspan(a, max(b, a + min_width), ymin=0.96, ymax=1.0, color=colour, alpha=0.9, linewidth=0, label=label)
        if m.phase == "forward":
            ax.axvline(a, color="0.3", linestyle="--", linewidth=0.8)
            ax.text(a, 0.95, f" step {m.step}", transform=ax.get_xaxis_transform(), va="top", fontsize=8)
    if y:
        k = max(range(len(y)), key=y.__getitem__)
        ax.plot([k], [y[k]], "o", color="tab:red")
        ax.annotate(f"peak {y[k]:.2f} GiB", (k, y[k]), textcoords="offset points", xytext=(6, -12),
                    color="tab:red", fontsize=9)
        ax.set_ylim(0, max(y) * 1.12 or 1)
    ax.set_xlim(0, max(1, len(x) - 1))
    ax.set_xlabel("allocation / free event")
    ax.set_ylabel("allocated (GiB)")
    ax.set_title(title)
    if seen_phase:
        ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# -- out-of-memory summary ----------------------------------------------------------------------


def _storages(tensors: Iterable[torch.Tensor], device: torch.device | None) -> dict[int, int]:
    """{storage address: bytes} of tensors (on ``device`` if given), each storage counted once."""
    out: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor) or (device is not None and t.device != device):
            continue
        storage = t.untyped_storage()
        out[storage.data_ptr()] = storage.nbytes()
    return out


def _optimizer_tensors(optimizers: Iterable[Any]) -> Iterable[torch.Tensor]:
    for opt in optimizers:
        for state in getattr(opt, "state", {}).values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value


def memory_by_category(module: torch.nn.Module, optimizers: Iterable[Any], allocated: int,
                       device: torch.device | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients, optimizer state, and the rest of ``allocated`` (activations,
    workspaces, temporaries). Each storage is counted once, in the first category that holds it."""
    optimizers = list(optimizers)
    params = _storages(module.parameters(), device)
    grads = {k: v for k, v in _storages((p.grad for p in module.parameters() if p.grad is not None), device).items()
             if k not in params}
    state = {k: v for k, v in _storages(_optimizer_tensors(optimizers), device).items()
             if k not in params and k not in grads}
    known = sum(params.values()) + sum(grads.values()) + sum(state.values())
    return {"parameters": sum(params.values()), "gradients": sum(grads.values()),
            "optimizer state": sum(state.values()), "activations and other": max(0, allocated - known)}


def tensor_labels(module: torch.nn.Module, optimizers: Iterable[Any]) -> dict[int, str]:
    """{data address: "parameter <name>" / "gradient <name>" / "optimizer <key> <name>"} for labelling blocks."""
    labels: dict[int, str] = {}
    names = {id(p): n.removeprefix("model.") for n, p in module.named_parameters()}
    for p in module.parameters():
        labels.setdefault(p.data_ptr(), f"parameter {names[id(p)]}")
        if p.grad is not None:
            labels.setdefault(p.grad.data_ptr(), f"gradient {names[id(p)]}")
    for opt in optimizers:
        for p, state in getattr(opt, "state", {}).items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    labels.setdefault(value.data_ptr(), f"optimizer {key} {names.get(id(p), '?')}")
    return labels


def oom_summary(categories: dict[str, int], step: int, phase: str, reserved: int, device_total: int,
                device_free: int, top: str, snapshot_name: str) -> str:
    """One screen: what was live by category when the allocation failed, the largest blocks, the file."""
    allocated = sum(categories.values())
    rows = [[name, f"{b / GIB:.2f}", f"{100 * b / allocated:.0f}%" if allocated else "-"]
            for name, b in categories.items()]
    rows.append(["**allocated**", f"{allocated / GIB:.2f}", "100%"])
    lines = [
        f"CUDA out of memory at step {step} ({phase}). Live memory by category:",
        "",
        markdown_table(["category", "GiB", "share"], rows),
        "",
        f"Reserved by the caching allocator: {reserved / GIB:.2f} GiB; device: {device_total / GIB:.2f} GiB, "
        f"{device_free / GIB:.2f} GiB free.",
        "",
        "Largest live blocks:",
        "",
        top,
        "",
        f"Snapshot: {snapshot_name} (open at {MEMORY_VIZ_URL}).",
    ]
    return "\n".join(lines)


def _model_name(pl_module: pl.LightningModule) -> str:
    size = getattr(getattr(pl_module, "hparams", None), "size", None)
    return str(size) if size is not None else type(pl_module).__name__
