"""Kernel categories: which kind of work a GPU kernel (or, on CPU, an ``aten::`` operator) does, by its name.

A name is looked up in this order; the first step that knows it decides:

1. lmtrain's own kernels, by exact name: the attention backends' kernels (``lmtrain.attention.kernel_names()``:
   the pointer, TMA and Gluon FlashAttention kernels) are ``attention``; the master-weight AdamW kernel
   (``lmtrain.kernels.master_adamw.KERNEL_NAMES``) is ``optimizer``. No regular expression guesses them.
2. Inductor's generated kernels (``torch.compile``), by what their name says they fuse:
   ``triton_{poi,per,red,tem,for}_fused_<aten ops>_<n>``. See :func:`inductor_category`.
3. Library kernels by ordered rules (:data:`CATEGORY_RULES`): NCCL, fused attention (FlashAttention, cuDNN SDPA,
   memory-efficient attention), cuBLAS / cuBLASLt / CUTLASS GEMMs, the loss, softmax, norms, foreach and fused
   optimizer kernels, copies, reductions, elementwise kernels.

Anything else is ``other``. The category is always the kernel's own, whatever phase launched it: the kernels of a
step replayed as one CUDA graph keep their categories (GEMMs are ``gemm``, attention is ``attention``).

==============  ====================================================================================
category        what falls in it
==============  ====================================================================================
gemm            cuBLAS / cuBLASLt / CUTLASS matrix products (``sm90_xmma_gemm_...``, ``nvjet_...``, ``ampere_sgemm``,
                ``cutlass::Kernel2<...>``, gemv, split-K reductions), inductor's ``triton_tem_fused_mm`` templates,
                ``aten::mm`` / ``addmm`` / ``bmm`` on CPU
attention       lmtrain's FlashAttention kernels, FlashAttention (``flash_fwd_kernel``), cuDNN SDPA
                (``cudnn_generated_fort_native_sdpa_...``), memory-efficient attention (``fmha_cutlassF...``),
                inductor kernels fusing ``sdpa`` / ``flash`` / ``flex_attention``
softmax         softmax forward and backward (the naive attention's), ``triton_..._fused__softmax...``
loss            the cross-entropy: log-softmax and NLL kernels (``cunn_SoftMaxForward<..LogSoftMax..>``,
                ``nll_loss_forward...``), inductor kernels fusing ``nll_loss`` / ``log_softmax``
norm            RMSNorm / LayerNorm: fused norm kernels, inductor kernels fusing ``rsqrt`` or ``mean`` with
                ``pow`` (RMSNorm's ``mean(x**2)`` then ``rsqrt``)
optimizer       lmtrain's master-weight AdamW kernel, multi-tensor (foreach) and fused optimizer kernels
                (``multi_tensor_apply_kernel``, ``fused_adamw``), inductor ``triton_for_`` and Adam kernels
elementwise     inductor pointwise kernels (``triton_poi_``), ATen elementwise kernels, activations, masks
reduction       inductor reductions (``triton_red_``, ``triton_per_``) of anything else, ``reduce_kernel``, sums
communication   collectives: NCCL (``ncclDevKernel_*``, ``ncclKernel_*``), on CPU gloo / c10d operators
copy            memcpy / memset, copy and cast kernels, ``cat``, FSDP2's ``chunk_cat`` (the reduce-scatter's input),
                index gathers and scatters (embedding; its backward's sort of the token ids: cub radix sort, scan,
                unique-by-key, segment offsets)
other           everything else (a GPU test checks this stays under 1% of kernel time on the default paths)
==============  ====================================================================================
"""

from __future__ import annotations

import functools
import re

__all__ = ["CATEGORIES", "CATEGORY_LABELS", "CATEGORY_RULES", "categorize", "inductor_category", "own_kernels"]

#: Kernel categories, in report order.
CATEGORIES: tuple[str, ...] = ("gemm", "attention", "softmax", "loss", "norm", "elementwise", "reduction",
                               "optimizer", "communication", "copy", "other")
#: Display names of the categories.
CATEGORY_LABELS: dict[str, str] = {c: c for c in CATEGORIES} | {"gemm": "GEMM", "copy": "copy/cast"}

_I = re.IGNORECASE
#: Ordered (category, pattern) rules for library kernels and CPU operators; the first match wins. The order
#: matters: NCCL names mention reduce and copy; fused attention kernels mention cutlass (caught before GEMM);
#: log-softmax is the loss's, caught before softmax.
CATEGORY_RULES: list[tuple[str, re.Pattern[str]]] = [
    ("communication", re.compile(r"nccl|^gloo:|^_?c10d(_functional)?::|^record_param_comms$|"
                                 r"^(aten::)?(all_?reduce|all_?gather|reduce_?scatter|broadcast|all_to_all|barrier)"
                                 r"_?(base_|into_tensor|coalesced_?)?$", _I)),
    ("attention", re.compile(r"flash|fmha|_sdpa_|native_sdpa|scaled_dot_product|efficient_attention|"
                             r"attention|_attn_(fwd|bwd)|cudnn::fusion::(compute_dot_do_o|convert_dq)", _I)),
    ("gemm", re.compile(r"gemm|gemv|xmma|nvjet|cutlass|wgmma|hmma|_tensorop_|splitKreduce|"
                        r"[sh](884|1688|16816)|cublas|^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|"
                        r"linear|_addmm_activation|addmv|mv|dot)$", _I)),
    ("loss", re.compile(r"log_?softmax|nll|criterion|cross_entropy", _I)),
    ("softmax", re.compile(r"softmax", _I)),
    ("norm", re.compile(r"layer_?norm|rms_?norm|group_?norm|batch_?norm", _I)),
    ("optimizer", re.compile(r"multi_tensor_apply|fused_adam|fusedadam|adamw?_?math|fused_sgd|_foreach_|"
                             r"^aten::_fused_", _I)),
    ("copy", re.compile(r"^memcpy|^memset|copy|catarraybatched|^aten::(cat|stack|to|_to_copy|clone|contiguous|"
                        r"index_select|embedding|embedding_dense_backward|index|index_put_|gather|scatter|"
                        r"scatter_add_|repeat)$|"
                        r"index_?select|indexselect|embedding|index_elementwise|indexing_backward|gather|scatter|"
                        r"compute_grad_weight|sum_and_scatter|krn_partials|_to_copy|"
                        # FSDP2's reduce-scatter input (gradients cast and packed), and the embedding backward's
                        # sort of its token ids (cub radix sort, scan, unique-by-key) and segment kernels
                        r"chunk_cat|DeviceRadixSort|DeviceScan(Init)?Kernel|DeviceCompactInit|unique_by_key|"
                        r"partial_segment", _I)),
    ("reduction", re.compile(r"reduce|reduction|welford|argmax|argmin|cumsum|"
                             r"^aten::(sum|mean|max|min|amax|amin|var|std|prod|all|any|logsumexp)$", _I)),
    ("elementwise", re.compile(r"elementwise|pointwise|functor|silu|gelu|relu|sigmoid|tanh|log|sqrt|"
                               r"triu|tril|where|masked|fill|neg|pow|sin|cos|clamp|dropout|exp(?!and)|"
                               r"^aten::(add|add_|sub|sub_|mul|mul_|div|div_|lerp_|addcmul_|addcdiv_|abs|sign|"
                               r"maximum|minimum|ge|gt|le|lt|eq|ne|bitwise_not|logical_not|reciprocal|"
                               r"threshold_backward|unsqueeze_copy)$", _I)),
]

_INDUCTOR = re.compile(r"^triton_(poi|per|red|tem|for)_(?:fused_?)?(.*?)(?:_\d+)?$")
#: (category, aten op names) that decide an inductor kernel's category when its fused ops include one of them,
#: in this order.
_INDUCTOR_OPS: list[tuple[str, re.Pattern[str]]] = [
    ("attention", re.compile(r"(^|_)(sdpa|flash|flex_attention|scaled_dot_product\w*|efficient_attention)(_|$)")),
    ("gemm", re.compile(r"(^|_)(mm|addmm|bmm|baddbmm|convolution)(_|$)")),
    ("optimizer", re.compile(r"(^|_)(adam\w*|foreach\w*|addcdiv|lerp)(_|$)")),
    ("loss", re.compile(r"(^|_)(nll_loss\w*|log_softmax\w*|cross_entropy\w*)(_|$)")),
    ("norm", re.compile(r"(^|_)(rsqrt|\w*layer_norm\w*|\w*rms_norm\w*)(_|$)|"
                        r"^(?=.*(^|_)mean(_|$))(?=.*(^|_)pow(_|$))")),  # RMSNorm's mean(x ** 2) without its rsqrt
    ("softmax", re.compile(r"(^|_)(softmax\w*)(_|$)")),
]
_INDUCTOR_KIND = {"poi": "elementwise", "per": "reduction", "red": "reduction", "tem": "gemm", "for": "optimizer"}


def inductor_category(name: str) -> str | None:
    """The category of an inductor-generated kernel (None for any other name).

    ``triton_<kind>_fused_<ops>_<n>``: the fused aten ops decide first (sdpa / flash: attention; mm / addmm / bmm /
    _scaled_mm: gemm, for templates only; adam / foreach / addcdiv / lerp: optimizer; nll_loss / log_softmax: loss;
    rsqrt, mean with pow or a norm: norm; softmax: softmax), then the kind: ``poi`` (pointwise) elementwise,
    ``red`` / ``per`` (reductions) reduction, ``tem`` (templates: matmuls) gemm, ``for`` (foreach combo kernels: the
    compiled optimizer) optimizer. A matmul op in a ``poi`` / ``red`` / ``per`` kernel's name is the GEMM its
    epilogue or prologue came from (``triton_poi_fused_addmm_relu_0``: bias and ReLU after an ``extern`` GEMM;
    ``triton_red_fused__scaled_mm_0``: a float8 scale's amax), not a matrix product, so it does not make it gemm.
    """
    m = _INDUCTOR.match(name)
    if m is None:
        return None
    kind, ops = m.group(1), m.group(2)
    for category, pattern in _INDUCTOR_OPS:
        if category == "gemm" and kind != "tem":
            continue
        if pattern.search(ops):
            return category
    return _INDUCTOR_KIND[kind]


@functools.lru_cache(maxsize=1)
def own_kernels() -> dict[str, str]:
    """Kernel name -> category for lmtrain's own kernels (attention backends' kernels, the master AdamW kernel)."""
    from lmtrain.attention import kernel_names

    out = {name: "attention" for names in kernel_names().values() for name in names}
    try:
        from lmtrain.kernels.master_adamw import KERNEL_NAMES
    except ImportError:  # a CPU install without Triton: the kernel cannot run there, so no trace holds it
        KERNEL_NAMES = frozenset()  # noqa: N806
    out.update({name: "optimizer" for name in KERNEL_NAMES})
    return out


@functools.lru_cache(maxsize=4096)
def categorize(kernel_name: str) -> str:
    """Category of a CUDA kernel or CPU operator name (see the module docstring for the order of the rules).

    Args:
        kernel_name: the kernel's full (demangled) name as the profiler reports it, or an ``aten::`` op.

    Returns:
        One of :data:`CATEGORIES`.
    """
    own = own_kernels().get(kernel_name.strip())
    if own is not None:
        return own
    inductor = inductor_category(kernel_name)
    if inductor is not None:
        return inductor
    for category, pattern in CATEGORY_RULES:
        if pattern.search(kernel_name):
            return category
    return "other"
