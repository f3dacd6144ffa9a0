"""FlashAttention-2 kernels: a tiled PyTorch reference and Triton/Gluon forward + backward kernels (``flash/``).

``flash_attention_pytorch`` / ``FlashAttentionPyTorch`` run anywhere; ``flash_attention`` /
``FlashAttentionTriton`` need a CUDA GPU (or Triton's interpreter, for tests). The Triton names are
imported on first use, so ``import lmtrain.kernels`` neither needs Triton nor compiles anything, and
``TRITON_INTERPRET=1`` still takes effect if it is set before the first use.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from lmtrain.kernels.flash_pytorch import FlashAttentionPyTorch, flash_attention_pytorch

if TYPE_CHECKING:
    from lmtrain.kernels.flash.api import FlashAttentionTriton, flash_attention

__all__ = ["FlashAttentionPyTorch", "FlashAttentionTriton", "flash_attention", "flash_attention_pytorch",
           "triton_interpreted"]


def triton_interpreted() -> bool:
    """Whether Triton kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def __getattr__(name: str) -> Any:
    if name in ("FlashAttentionTriton", "flash_attention"):
        from lmtrain.kernels.flash import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
