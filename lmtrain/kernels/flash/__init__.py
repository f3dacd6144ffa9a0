"""FlashAttention-2 in Triton and Gluon: settings, the dispatcher, the autograd function and one module per
implementation.

Layout:
    settings      ``FlashSettings`` (frozen, validated once), ``set_settings``, ``use_settings``
    dispatch      ``select`` (which kernels serve a call), ``explain``, ``describe``, the Triton version gate
    tuning        the Gluon kernels' launch configurations and where each serves by default
    api           ``FlashAttentionTriton``, ``flash_attention``, the custom ops ``lmtrain::flash_attn_{fwd,bwd}``
    launch_plans  replaying a call like an earlier one without its Python
    common        autotuning and helpers shared by the pointer and TMA kernels
    pointer       pointer-load kernels (every GPU, Triton's interpreter)
    tma           TMA-descriptor kernels (sm_90+)
    gluon_common  the Gluon kernels' producer, scheduling and descriptors
    gluon_fwd     the Gluon forward (sm_90)
    gluon_bwd     the Gluon dQ and dK/dV kernels (sm_90)
    fused_bwd     the Gluon fused backward with TMA reductions (sm_90)

``settings`` and ``dispatch`` import neither Triton nor a GPU; ``FlashAttentionTriton``, ``flash_attention`` and
``KERNEL_NAMES`` import the kernels (and Triton) on first use.
"""

from __future__ import annotations

from typing import Any

from lmtrain.kernels.flash.dispatch import Call, Plan, describe, explain, select
from lmtrain.kernels.flash.settings import FlashSettings, current, set_settings, use_settings

#: The implementation modules, each with its own ``KERNEL_NAMES``.
IMPLEMENTATIONS = ("pointer", "tma", "gluon_fwd", "gluon_bwd", "fused_bwd")

__all__ = ["KERNEL_NAMES", "Call", "FlashAttentionTriton", "FlashSettings", "Plan", "current", "describe", "explain",
           "flash_attention", "select", "set_settings", "use_settings"]


def __getattr__(name: str) -> Any:
    if name in ("FlashAttentionTriton", "flash_attention"):
        from lmtrain.kernels.flash import api

        return getattr(api, name)
    if name == "KERNEL_NAMES":
        import importlib

        return tuple(n for module in IMPLEMENTATIONS
                     for n in importlib.import_module(f"lmtrain.kernels.flash.{module}").KERNEL_NAMES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
