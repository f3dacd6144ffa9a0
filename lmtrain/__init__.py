"""lmtrain: instrumented training of GPT-style language models.

Public names are re-exported here; heavy modules (Lightning, Triton) load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ModelConfig": "lmtrain.config",
    "ShapeOptions": "lmtrain.config",
    "OptimizerOptions": "lmtrain.config",
    "MemoryOptions": "lmtrain.config",
    "SpeedOptions": "lmtrain.config",
    "option": "lmtrain.config",
    "SIZES": "lmtrain.config",
    "LmtrainError": "lmtrain.errors",
    "TransformerLM": "lmtrain.model",
    "get_attention": "lmtrain.attention",
    "register_attention": "lmtrain.attention",
    "available_backends": "lmtrain.attention",
    "annotate": "lmtrain.annotate",
    "LMModule": "lmtrain.module",
    "LMDataModule": "lmtrain.data",
    "flops_per_step": "lmtrain.flops",
    "parameter_count": "lmtrain.flops",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lmtrain' has no attribute {name!r}")
