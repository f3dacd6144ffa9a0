"""Named ranges inside operations, for timelines (NVTX) and the PyTorch profiler (``record_function``).

Code that wants its inner stages visible on a timeline wraps them once, in the code itself::

    with annotate("attention/softmax"):
        p = torch.softmax(scores, dim=-1)

While no callback has switched ranges on, ``annotate`` returns one shared do-nothing context manager:
the cost is a function call and a flag test, nothing is allocated and nothing reaches the GPU. A
callback (``NVTXRanges``, ``KernelShare``) turns ranges on for its window with :func:`enable_ranges`,
which counts requests per kind, so two callbacks can each turn them on and off independently.

Ranges are never emitted while ``torch.compile`` traces (they would break the graph); compiled
regions appear as their own kernels instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import TracebackType

import torch

__all__ = ["annotate", "enable_ranges", "ranges_enabled", "nvtx_push", "nvtx_pop", "profiler_recording"]

_NULL = contextlib.nullcontext()


class _State:
    nvtx = 0  # number of active requests for NVTX ranges
    profiler = 0  # number of active requests for record_function ranges
    on = False  # nvtx or profiler


_state = _State()


def nvtx_push(name: str) -> None:
    """Push an NVTX range when CUDA is present (NVTX needs the CUDA runtime)."""
    if torch.cuda.is_available():
        torch.cuda.nvtx.range_push(name)


def nvtx_pop() -> None:
    if torch.cuda.is_available():
        torch.cuda.nvtx.range_pop()


def profiler_recording() -> bool:
    """A torch profiler is recording now (a ``record_function`` entered now would reach a trace).

    A ``record_function`` entered while no profiler records is recorded nowhere, even if a profiler starts before
    it closes, yet it still costs an operator dispatch on entry and exit: the ranges skip it then."""
    return bool(torch._C._autograd._profiler_enabled())


class _Range:
    __slots__ = ("name", "nvtx", "record")

    def __init__(self, name: str) -> None:
        self.name = name
        self.nvtx = _state.nvtx > 0
        self.record: torch.profiler.record_function | None = None

    def __enter__(self) -> _Range:
        if self.nvtx:
            nvtx_push(self.name)
        if _state.profiler > 0 and profiler_recording():
            self.record = torch.profiler.record_function(self.name)
            self.record.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.record is not None:
            self.record.__exit__(exc_type, exc, tb)
        if self.nvtx:
            nvtx_pop()


def annotate(name: str) -> contextlib.AbstractContextManager:
    """A named range around the enclosed code, or a shared no-op while ranges are off.

    Args:
        name: range name, ``group/stage`` by convention (``attention/qk_matmul``).
    """
    if not _state.on or torch.compiler.is_compiling():
        return _NULL
    return _Range(name)


def enable_ranges(nvtx: bool = True, profiler: bool = True) -> None:
    """Ask for ranges of the given kinds; undo with :func:`disable_ranges` using the same arguments."""
    _state.nvtx += int(nvtx)
    _state.profiler += int(profiler)
    _state.on = _state.nvtx > 0 or _state.profiler > 0


def disable_ranges(nvtx: bool = True, profiler: bool = True) -> None:
    """Withdraw one request made by :func:`enable_ranges` (never below zero)."""
    _state.nvtx = max(0, _state.nvtx - int(nvtx))
    _state.profiler = max(0, _state.profiler - int(profiler))
    _state.on = _state.nvtx > 0 or _state.profiler > 0


@contextlib.contextmanager
def ranges_enabled(nvtx: bool = True, profiler: bool = True) -> Iterator[None]:
    """Ranges of the given kinds on inside the ``with`` block."""
    enable_ranges(nvtx, profiler)
    try:
        yield
    finally:
        disable_ranges(nvtx, profiler)


def active_requests() -> tuple[int, int]:
    """(NVTX requests, profiler requests) now active; for tests and diagnostics."""
    return _state.nvtx, _state.profiler
