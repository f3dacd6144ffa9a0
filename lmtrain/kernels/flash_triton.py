"""The former import path of the FlashAttention-2 Triton kernels: ``lmtrain.kernels.flash.api`` is the module.

Importing it registers the custom ops ``lmtrain::flash_attn_fwd`` / ``lmtrain::flash_attn_bwd``.
"""

from lmtrain.kernels.flash.api import FlashAttentionTriton, flash_attention

__all__ = ["FlashAttentionTriton", "flash_attention"]
