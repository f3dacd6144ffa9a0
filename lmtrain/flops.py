"""Analytic FLOPs per step, peak FLOP/s per device, and model FLOPs utilisation (MFU).

FLOPs of one training step on a batch of B sequences of T tokens (multiply-add = 2 FLOPs)::

    matmul  = 6 * N_matmul * B * T
    attn    = 3 * L * (4 * B * T**2 * d_model) / 2      (causal: half the score matrix)
    train   = matmul + attn

``N_matmul`` counts the weights that take part in matrix products: the q/k/v/out projections, the
SwiGLU weights and the output head. It excludes the embedding table (a lookup, not a product) and
the RMSNorm gains (elementwise). The factor 6 is 2 (forward) + 4 (backward: gradients for inputs and
for weights). The attention term counts QK^T and PV (2 * T**2 * d_model each per sequence and layer,
forward), halved for the causal mask since a causal kernel can skip the upper triangle; backward is
twice the forward. Forward-only steps are one third of each term. RoPE, softmax, norms, the loss and
the optimizer are not counted, as is customary for MFU (PaLM, Appendix B).

Float8 (``model.float8``): the linear layers that ``lmtrain.float8`` converts run their three GEMMs as float8 on
Hopper's tensor cores, at twice the bf16 rate; everything else (the other linears, attention) stays at bf16.
``throughput/mfu`` stays against the bf16 peak for every run, so one number compares recipes: a float8 run that
does the same work faster shows a higher MFU, and a value above what bf16 alone could reach shows the float8 gain.
What fraction of the step's own ceiling a float8 run reaches is a second figure, MFU against the step's float8
peak (:func:`float8_step_peak_flops`): the time the step's FLOPs would take at peak, its converted-linear FLOPs
(:func:`float8_flops_per_step`) at the float8 peak and the rest at bf16, turned back into one FLOP/s::

    float8_step_peak = train / (float8 / float8_peak + (train - float8) / bf16_peak)
"""

from __future__ import annotations

import torch

from lmtrain.config import STEP_MODES, ModelConfig
from lmtrain.float8 import block_linear_shapes, converts_shape

__all__ = ["STEP_MODES", "float8_flops_per_step", "float8_step_peak_flops", "flops_per_step", "mfu",
           "parameter_count", "peak_flops"]

#: Dense peak FLOP/s by device-name substring and compute dtype, from the vendors' datasheets (no
#: sparsity). ``fp32`` is plain fp32 (no tensor cores); ``tf32`` applies when
#: ``torch.backends.cuda.matmul.allow_tf32`` is on; ``fp8`` (float8 tensor cores, Ada and Hopper only) is
#: the rate of ``model.float8``'s converted GEMMs. Matched in order: the first substring found in
#: ``torch.cuda.get_device_name()`` wins. Override per run with the ``peak_flops`` argument of the
#: callbacks and benchmarks, or add entries here.
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("H100 NVL", {"bf16": 835.5e12, "fp16": 835.5e12, "fp8": 1670.5e12, "tf32": 417.8e12, "fp32": 60.0e12}),
    ("H100 PCIe", {"bf16": 756.5e12, "fp16": 756.5e12, "fp8": 1513.0e12, "tf32": 378.0e12, "fp32": 51.2e12}),
    ("H100", {"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM
    ("GH200", {"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362.1e12, "fp16": 362.1e12, "fp8": 733.0e12, "tf32": 183.0e12, "fp32": 91.6e12}),
    ("RTX 5090", {"bf16": 209.5e12, "fp16": 209.5e12, "tf32": 104.8e12, "fp32": 104.8e12}),
    ("RTX 4090", {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12}),
    ("A10G", {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "fp32": 31.2e12}),
]


def parameter_count(cfg: ModelConfig) -> int:
    """Exact number of parameters of ``TransformerLM(cfg)``."""
    d, layers = cfg.d_model, cfg.num_layers
    per_layer = 4 * d * d + 3 * d * cfg.d_ff + 2 * d
    return 2 * cfg.vocab_size * d + layers * per_layer + d


def matmul_parameter_count(cfg: ModelConfig) -> int:
    """Parameters that take part in matrix products (all but the embedding table and RMSNorm gains)."""
    d = cfg.d_model
    return cfg.num_layers * (4 * d * d + 3 * d * cfg.d_ff) + cfg.vocab_size * d


def attention_flops_forward(cfg: ModelConfig, batch_size: int, seq_len: int, causal: bool = True) -> float:
    """FLOPs of QK^T and PV in one forward pass over all layers."""
    flops = 4.0 * batch_size * seq_len**2 * cfg.d_model * cfg.num_layers
    return flops / 2 if causal else flops


def _passes(mode: str) -> float:
    """A step's FLOPs in forward passes' worth: 1 in mode ``forward``, else 3 (the backward pass is two)."""
    if mode not in STEP_MODES:
        raise ValueError(f"mode must be one of {STEP_MODES}, got {mode!r}")
    return 1.0 if mode == "forward" else 3.0


def flops_per_step(cfg: ModelConfig, batch_size: int, seq_len: int, mode: str = "train") -> float:
    """Model FLOPs of one step (see the module docstring): the linear layers' products and attention's
    (:func:`flops_by_category`). ``mode``: train, forward_backward or forward."""
    return sum(flops_by_category(cfg, batch_size, seq_len, mode).values())


def flops_by_category(cfg: ModelConfig, batch_size: int, seq_len: int, mode: str = "train",
                      fused_attention: bool = True) -> dict[str, float]:
    """:func:`flops_per_step` split by the kernel category that runs it (``lmtrain.analysis.categories``): ``gemm``,
    the linear layers' products (``2 * N_matmul * B * T`` forward); ``attention``, QK^T and PV. With
    ``fused_attention`` False (an attention backend that runs its products as plain matrix products: naive,
    flash_pytorch) both are ``gemm``. :func:`flops_per_step` is their sum. (``sdpa`` counts as fused: where
    PyTorch falls back to its math kernel, plain matrix products, the trace has no attention kernels and
    ``lmtrain.analysis.ceilings.achieved`` charges the attention FLOPs nowhere.)"""
    times = _passes(mode)
    linear = times * 2.0 * matmul_parameter_count(cfg) * batch_size * seq_len
    attention = times * attention_flops_forward(cfg, batch_size, seq_len)
    return {"gemm": linear, "attention": attention} if fused_attention else {"gemm": linear + attention}


def float8_parameter_count(cfg: ModelConfig) -> int:
    """Weights of the linear layers that ``model.float8`` converts (``lmtrain.float8.converts_shape``): 0 with
    ``float8: none``."""
    block = sum(i * o for i, o in block_linear_shapes(cfg).values() if converts_shape(i, o, False, cfg))
    head = cfg.d_model * cfg.vocab_size if converts_shape(cfg.d_model, cfg.vocab_size, True, cfg) else 0
    return cfg.num_layers * block + head


def float8_flops_per_step(cfg: ModelConfig, batch_size: int, seq_len: int, mode: str = "train") -> float:
    """The part of :func:`flops_per_step` that runs as float8 GEMMs: the converted linears' products (forward
    ``2 * N_float8 * B * T``, a training step three times that); 0 with ``float8: none``."""
    passes = _passes(mode)
    forward = 2.0 * float8_parameter_count(cfg) * batch_size * seq_len
    return passes * forward


def float8_step_peak_flops(flops: float, float8_flops: float, peak: float | None, float8_peak: float | None
                           ) -> float | None:
    """The peak FLOP/s of a step that runs ``float8_flops`` of its ``flops`` at ``float8_peak`` and the rest at
    ``peak``: ``flops / (float8_flops / float8_peak + (flops - float8_flops) / peak)``. MFU against it is the
    fraction of the step's own ceiling a float8 run reaches (the module docstring).

    Args:
        flops: model FLOPs of the step (:func:`flops_per_step`).
        float8_flops: the part that runs as float8 GEMMs (:func:`float8_flops_per_step`), 0 to ``flops``.
        peak: peak FLOP/s of the step's precision (bf16), None when unknown.
        float8_peak: float8 peak FLOP/s of the device (``peak_flops(name, "fp8")``), None when unknown; with
            ``float8_flops == 0`` it is not needed.

    Returns:
        The blended peak, ``peak`` itself without float8 FLOPs, or None when a needed peak is unknown.
    """
    if not 0 <= float8_flops <= flops:
        raise ValueError(f"float8_flops must lie in [0, flops={flops}], got {float8_flops}")
    if not peak or flops <= 0:
        return None
    if float8_flops == 0:
        return peak
    if not float8_peak:
        return None
    return flops / (float8_flops / float8_peak + (flops - float8_flops) / peak)


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the matrix products run in under a Lightning precision (``bf16-mixed`` -> bfloat16, ``16-true`` ->
    float16, anything else float32)."""
    return {"bf16": torch.bfloat16, "16": torch.float16}.get(str(precision).split("-")[0], torch.float32)


def compute_dtype_key(precision: str | torch.dtype) -> str:
    """Peak-table key for a Lightning precision string (``bf16-mixed``, ``32-true`` ...), ``fp8`` or a dtype."""
    text = str(precision).lower()
    if "fp8" in text or "float8" in text:
        return "fp8"
    if "bf16" in text or "bfloat16" in text:
        return "bf16"
    if "16" in text:
        return "fp16"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def peak_flops(device_name: str, precision: str | torch.dtype, table: list[tuple[str, dict[str, float]]] | None = None
               ) -> float | None:
    """Dense peak FLOP/s for a device name and precision, or None for a device not in the table."""
    key = compute_dtype_key(precision)
    for substring, peaks in table if table is not None else PEAK_FLOPS:
        if substring.lower() in device_name.lower():
            return peaks.get(key)
    return None


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1]; None when the peak is unknown or the time is not positive.

    Values above 1 can only come from a wrong time or peak; they are clipped to 1.
    """
    if not peak or seconds <= 0:
        return None
    return min(1.0, flops / seconds / peak)
