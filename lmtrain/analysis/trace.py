"""Reading ``torch.profiler`` Chrome traces: loading, the phase ranges lmtrain records, the event categories, and
interval lookup. Shared by ``lmtrain.analysis.kernels`` and ``lmtrain.analysis.temporal``."""

from __future__ import annotations

import gzip
import json
from bisect import bisect_right
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["GRAPH_PHASE", "PHASE_RANGES", "load_trace", "trace_device"]

#: The one phase of a step replayed as a CUDA graph (``lmtrain.callbacks._common.StepPhases.GRAPH``): its kernels
#: run from one graph launch, with no forward/backward/optimizer boundary in between.
GRAPH_PHASE = "cuda graph"
#: Range names that open a phase (``record_function`` names, also the NVTX convention of the project).
PHASE_RANGES: tuple[str, ...] = ("forward", "backward", "optimizer", GRAPH_PHASE)

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


def trace_device(trace: dict) -> str:
    """``cuda`` when the trace holds GPU activities (kernels, memcpy, memset), else ``cpu``."""
    return "cuda" if any(e.get("cat") in _GPU_CATS for e in trace.get("traceEvents", [])) else "cpu"


def load_trace(path: str | Path) -> dict:
    """A Chrome trace from ``prof.export_chrome_trace`` (``.json``) or gzipped (``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        trace = json.load(f)
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path} is not a Chrome trace (no traceEvents list)")
    return trace
