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
"""

from __future__ import annotations

import torch

from lmtrain.config import STEP_MODES, ModelConfig

__all__ = ["STEP_MODES", "flops_per_step", "mfu", "parameter_count", "peak_flops"]

#: Dense peak FLOP/s by device-name substring and compute dtype, from the vendors' datasheets (no
#: sparsity). ``fp32`` is plain fp32 (no tensor cores); ``tf32`` applies when
#: ``torch.backends.cuda.matmul.allow_tf32`` is on. Matched in order: the first substring found in
#: ``torch.cuda.get_device_name()`` wins. Override per run with the ``peak_flops`` argument of the
#: callbacks and benchmarks, or add entries here.
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("H100 NVL", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.8e12, "fp32": 60.0e12}),
    ("H100 PCIe", {"bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378.0e12, "fp32": 51.2e12}),
    ("H100", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM
    ("GH200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362.1e12, "fp16": 362.1e12, "tf32": 183.0e12, "fp32": 91.6e12}),
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


def flops_per_step(cfg: ModelConfig, batch_size: int, seq_len: int, mode: str = "train") -> float:
    """Model FLOPs of one step (see the module docstring). ``mode``: train, forward_backward or forward."""
    if mode not in STEP_MODES:
        raise ValueError(f"mode must be one of {STEP_MODES}, got {mode!r}")
    forward = 2.0 * matmul_parameter_count(cfg) * batch_size * seq_len + attention_flops_forward(
        cfg, batch_size, seq_len
    )
    return forward if mode == "forward" else 3.0 * forward


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the matrix products run in under a Lightning precision (``bf16-mixed`` -> bfloat16, ``16-true`` ->
    float16, anything else float32)."""
    return {"bf16": torch.bfloat16, "16": torch.float16}.get(str(precision).split("-")[0], torch.float32)


def compute_dtype_key(precision: str | torch.dtype) -> str:
    """Peak-table key for a Lightning precision string (``bf16-mixed``, ``32-true`` ...) or a dtype."""
    text = str(precision).lower()
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
