"""Profiling callbacks for Lightning: attach in YAML (``trainer.callbacks``) or in Python.

    CudaSyncTimer       per-phase step times (CUDA events), tokens/s, MFU, a summary table
    NVTXRanges          NVTX + record_function ranges for steps, phases, blocks, attention stages
    MemorySnapshot      per-phase memory peaks, allocation history window, timeline PNG, top allocations
    KernelShare         torch.profiler kernel table, categories, shares per phase, report
    PrecisionInspector  dtypes of parameters, activations, logits, loss, grads, optimizer state
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CudaSyncTimer": "lmtrain.callbacks.timer",
    "NVTXRanges": "lmtrain.callbacks.nvtx",
    "MemorySnapshot": "lmtrain.callbacks.memory",
    "KernelShare": "lmtrain.callbacks.kernel_share",
    "PrecisionInspector": "lmtrain.callbacks.precision",
    "GenerateSamples": "lmtrain.callbacks.samples",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lmtrain.callbacks' has no attribute {name!r}")
