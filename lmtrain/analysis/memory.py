"""Allocator-snapshot analysis: the active-memory curve, what was live at the peak, top allocations, plots.

Pure functions of a ``torch.cuda.memory._snapshot()`` dict (the object that
``torch.cuda.memory._dump_snapshot`` pickles and https://pytorch.org/memory_viz opens): ``segments`` (each
with ``device`` and ``blocks`` of ``address``, ``size``, ``state``, ``frames``) and ``device_traces`` (one
list per device of entries with ``action`` ``alloc`` / ``free_requested`` / ``free_completed`` /
``segment_alloc`` ..., ``addr``, ``size``, ``frames`` innermost first, ``time_us``), as documented in
PyTorch's ``torch/cuda/_memory_viz.py``. No Lightning, no CUDA: ``MemorySnapshot`` captures the snapshot
and hands it here; ``python -m lmtrain analyze memory SNAPSHOT.pickle`` does the same for a snapshot taken
by anyone. The functions that label blocks by tensor (:func:`tensor_labels`, :func:`memory_by_category`)
read a model and its optimizers, on any device.
"""

from __future__ import annotations

import bisect
import os
import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmtrain.analysis.tables import markdown_table

GIB = 1024**3
MIB = 1024**2

#: Phase names marked on the timeline, with their colours.
PHASE_COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "after backward": "tab:gray",
                 "optimizer": "tab:green"}

#: Link printed next to every snapshot file.
MEMORY_VIZ_URL = "https://pytorch.org/memory_viz"


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


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """Unpickle a snapshot written by ``torch.cuda.memory._dump_snapshot`` or ``MemorySnapshot``.

    Only open snapshots you trust: unpickling runs code named in the file.
    """
    with open(path, "rb") as f:
        snapshot = pickle.load(f)  # noqa: S301 (the format is a pickle; memory_viz reads the same files)
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        raise ValueError(f"{path} is not an allocator snapshot (no 'segments' key)")
    return snapshot


def snapshot_devices(snapshot: dict[str, Any]) -> list[int]:
    """Devices with trace entries or segments in the snapshot, in order."""
    devices = {seg.get("device", 0) for seg in snapshot.get("segments", [])}
    devices.update(i for i, trace in enumerate(snapshot.get("device_traces") or []) if trace)
    return sorted(devices)


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
_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])


def _is_library(filename: str) -> bool:
    if filename.startswith(_PACKAGE_DIR):
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
    if not marks:  # a snapshot analysed offline: no phase times known
        return "recording"
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
    if phase == "recording":
        return "allocated during the recording"
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


def peak_report(snapshot: dict[str, Any], device: int, top_n: int = 10, marks: list[PhaseMark] | None = None,
                labels_before: dict[int, str] | None = None, labels_after: dict[int, str] | None = None,
                where: str = "the snapshot", snapshot_name: str = "") -> str:
    """Markdown: what was live at the trace's peak, by category, and the largest blocks.

    Args:
        snapshot: the ``_snapshot()`` dict.
        device: the CUDA device index whose trace to read.
        top_n: rows of the table of blocks allocated during the recording.
        marks: phases of the recorded steps (host times), to say which phase allocated a block.
        labels_before: tensor names of blocks that existed when the recording started.
        labels_after: tensor names of blocks at the snapshot (:func:`tensor_labels`).
        where: what the snapshot covers, for the first line (``steps 5-6``).
        snapshot_name: the file name to mention.
    """
    marks = marks or []
    live, peak_bytes = live_at_peak(snapshot, device)
    in_window = [x for x in live if x.time_us is not None]
    name = f"snapshot `{snapshot_name}`, " if snapshot_name else ""
    return "\n".join([
        f"Live at the peak of {where}: {peak_bytes / GIB:.2f} GiB allocated ({len(device_trace(snapshot, device))} "
        f"trace entries; {name}open at {MEMORY_VIZ_URL}).", "",
        live_by_category_table(live, marks, labels_before, labels_after), "",
        f"Largest blocks allocated in the window and live at the peak ({len(in_window)} blocks):", "",
        top_allocations_table(in_window, top_n, marks, labels_before, labels_after), "",
        "Largest live blocks overall:", "",
        top_allocations_table(live, min(5, top_n), marks, labels_before, labels_after),
    ])


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

