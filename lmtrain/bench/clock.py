"""The benchmarks' clock: CUDA events on the GPU stream, or the host's ``time.perf_counter``.

On a GPU a mark is an event recorded on the current stream, so an interval is GPU time between two points
of the stream's work, read after one synchronisation at the end (reading a clock inside a step would make
the host wait for the GPU and change what is measured). On the CPU, or for host-side time (how long the
host takes to issue work), a mark is ``time.perf_counter()``.
"""

from __future__ import annotations

import time
from typing import Any


class Clock:
    """Time marks and the milliseconds between them.

    Args:
        cuda: mark with CUDA events on the current stream (True) or with the host clock (False).
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        """A point in time: a recorded CUDA event, or seconds of the host clock."""
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        """Wait for the GPU's work (no-op on the host clock): events can be read afterwards."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def ms(self, start: Any, end: Any) -> float:
        """Milliseconds from ``start`` to ``end`` (after :meth:`sync` for CUDA events)."""
        return float(start.elapsed_time(end)) if self.cuda else (end - start) * 1e3

    def intervals_ms(self, starts: list[Any], ends: list[Any]) -> list[float]:
        """``ms(starts[i], ends[i])`` for every pair, after one synchronisation."""
        self.sync()
        return [self.ms(a, b) for a, b in zip(starts, ends, strict=False)]
