"""Attention backends: one signature, looked up by name.

Every backend is ``fn(q, k, v, causal: bool) -> out`` with q of shape (..., N_q, d), k and v of
shape (..., N_k, d), any leading batch dims, and ``out`` of shape (..., N_q, d) in q's dtype. Causal
masking keeps the lower triangle including the diagonal, aligned at the top left (query i sees keys
0..i), as ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` does.

Backends:
    naive: materialised (..., N, N) scores; its three stages are ``lmtrain.annotate`` ranges
        (``attention/qk_matmul``, ``attention/softmax``, ``attention/pv_matmul``).
    sdpa: ``torch.nn.functional.scaled_dot_product_attention`` (PyTorch picks its kernel).
    flash_pytorch: tiled FlashAttention-2 in plain PyTorch (``lmtrain.kernels.flash_pytorch``).
    flash_triton: FlashAttention-2 Triton and Gluon kernels (``lmtrain.kernels.flash``).

New backends register with :func:`register_attention`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmtrain.annotate import annotate
from lmtrain.errors import LmtrainError

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


@dataclass(frozen=True)
class AttentionBackend:
    """A registered backend and the facts about it that the rest of lmtrain needs.

    Attributes:
        name: the name ``model.attention`` selects it by.
        fn: the attention function (see the module docstring for its signature).
        needs_gpu: runs only on a CUDA device (or under Triton's interpreter, ``TRITON_INTERPRET=1``).
        materializes_scores: stores the full (..., N_q, N_k) score and probability matrices for the backward
            pass (the memory planner counts them; fused backends save only O and the logsumexp).
        kernel_pattern: a regular expression (searched, case-insensitive) matching the names of the GPU kernels
            this backend launches itself, so kernel-time breakdowns count them as attention; None when its
            kernels are library kernels that the generic rules already recognise.
        kernel_names: returns the names of the GPU kernels this backend launches itself, as a profiler trace
            shows them (imported on first use: they may need Triton); None when it launches only library kernels.
        description: one line for help texts and tables.
        fused: its QK^T and PV run inside attention kernels (which kernel-time breakdowns count as attention), not
            as plain matrix products (which they count as gemm): where a step's model FLOPs are charged
            (``lmtrain.flops.flops_by_category``).
    """

    name: str
    fn: AttentionFn
    needs_gpu: bool = False
    materializes_scores: bool = False
    fused: bool = False
    kernel_pattern: str | None = None
    kernel_names: Callable[[], tuple[str, ...]] | None = None
    description: str = ""


_REGISTRY: dict[str, AttentionBackend] = {}


def register_attention(
    name: str,
    *,
    needs_gpu: bool = False,
    materializes_scores: bool = False,
    kernel_pattern: str | None = None,
    kernel_names: Callable[[], tuple[str, ...]] | None = None,
    description: str | None = None,
    fused: bool = False,
) -> Callable[[AttentionFn], AttentionFn]:
    """Decorator adding ``fn`` to the registry under ``name``, with the facts of :class:`AttentionBackend`.

    A backend is one registration: the model, the memory planner, the kernel-time categories and the
    benchmarks read these facts from the registry.
    """

    def add(fn: AttentionFn) -> AttentionFn:
        if name in _REGISTRY:
            raise ValueError(f"attention backend {name!r} is already registered")
        doc = description if description is not None else (fn.__doc__ or "").strip().splitlines()[0:1]
        _REGISTRY[name] = AttentionBackend(
            name=name, fn=fn, needs_gpu=needs_gpu, materializes_scores=materializes_scores,
            kernel_pattern=kernel_pattern, kernel_names=kernel_names, fused=fused,
            description=doc if isinstance(doc, str) else "".join(doc),
        )
        return fn

    return add


def available_backends() -> list[str]:
    """Names of all registered backends."""
    return list(_REGISTRY)


def backend_info(name: str) -> AttentionBackend:
    """The registry entry of ``name``.

    Raises:
        LmtrainError: no backend has that name.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise LmtrainError("model.attention", f"unknown attention backend {name!r}.",
                           f"use one of {', '.join(_REGISTRY)}.") from None


def get_attention(name: str) -> AttentionFn:
    """The backend function registered under ``name``.

    Raises:
        LmtrainError: no backend has that name.
    """
    return backend_info(name).fn


def own_kernel_patterns() -> list[str]:
    """The ``kernel_pattern`` of every registered backend that has one (for kernel-time categories)."""
    return [b.kernel_pattern for b in _REGISTRY.values() if b.kernel_pattern]


def kernel_names() -> dict[str, frozenset[str]]:
    """Backend name -> the names of the GPU kernels it launches itself, as they appear in a profiler trace (empty for
    backends that launch only library kernels, and for a backend whose kernels cannot be imported here)."""
    out = {}
    for backend in _REGISTRY.values():
        try:
            out[backend.name] = frozenset(backend.kernel_names() if backend.kernel_names else ())
        except ImportError:  # its kernels need a package this install lacks (Triton)
            out[backend.name] = frozenset()
    return out


def causal_mask(n_q: int, n_k: int, device: torch.device) -> torch.Tensor:
    """Boolean (n_q, n_k) mask, True where query i may attend to key j (j <= i)."""
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril()


@register_attention("naive", materializes_scores=True)
def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d)) V with the full score matrix stored; softmax in fp32."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    with annotate("attention/qk_matmul"):
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (..., N_q, N_k)
    with annotate("attention/softmax"):
        if causal:
            scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    with annotate("attention/pv_matmul"):
        out = torch.matmul(probs, v)  # (..., N_q, d)
    return out.to(q.dtype)


@register_attention("sdpa", fused=True)
def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """PyTorch's fused ``scaled_dot_product_attention`` (flash, cuDNN, efficient or math kernel)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).to(q.dtype)


@register_attention("flash_pytorch")
def flash_pytorch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Tiled FlashAttention-2 written in PyTorch operations (a reference, not fast)."""
    from lmtrain.kernels.flash_pytorch import flash_attention_pytorch

    return flash_attention_pytorch(q, k, v, causal=causal)


def _flash_kernel_names() -> tuple[str, ...]:
    from lmtrain.kernels.flash import KERNEL_NAMES

    return KERNEL_NAMES


@register_attention(
    "flash_triton", needs_gpu=True, fused=True,
    # Every kernel of lmtrain.kernels.flash is named _flash_<implementation>_<job> (its KERNEL_NAMES); the second
    # alternative matches the pointer kernels' names in traces written before they were renamed.
    kernel_pattern=r"^_flash_[a-z0-9_]+$|^_(fwd|bwd_dq|bwd_dkdv|bwd_preprocess)_kernel$",
    kernel_names=_flash_kernel_names,
)
def flash_triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """FlashAttention-2 forward and backward Triton kernels."""
    from lmtrain.kernels.flash.api import flash_attention

    return flash_attention(q, k, v, causal=causal)


def needs_gpu(name: str) -> bool:
    """Whether a backend needs a CUDA device (Triton kernels; they also run under ``TRITON_INTERPRET=1``)."""
    return backend_info(name).needs_gpu
