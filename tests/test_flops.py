"""lmtrain.flops: the compute dtype of each Lightning precision; float8 FLOPs and the float8 step's peak."""

from __future__ import annotations

import pytest
import torch

from lmtrain.config import ModelConfig
from lmtrain.flops import (
    attention_flops_forward,
    compute_dtype,
    float8_flops_per_step,
    float8_parameter_count,
    float8_step_peak_flops,
    flops_per_step,
    mfu,
    peak_flops,
)


@pytest.mark.parametrize(("precision", "dtype"), [
    ("bf16-mixed", torch.bfloat16), ("bf16-true", torch.bfloat16), ("16-mixed", torch.float16),
    ("16-true", torch.float16), ("32-true", torch.float32),
])
def test_compute_dtype_of_each_precision(precision: str, dtype: torch.dtype) -> None:
    assert compute_dtype(precision) is dtype


# A model small enough to count by hand: d_model 64, d_ff 176 (a multiple of 16), vocab 256, 2 layers. Per
# block the linears hold qkv 64 x 192, out 64 x 64, w1 and w3 64 x 176, w2 176 x 64 weights: 4 * 64**2 +
# 3 * 64 * 176 = 50176; the head 64 x 256 = 16384.
SMALL = {"vocab_size": 256, "d_model": 64, "num_layers": 2, "num_heads": 4, "d_ff": 176}


@pytest.mark.parametrize(("options", "weights"), [
    ({"float8": "none"}, 0),
    ({"float8": "tensorwise", "float8_min_features": 64}, 2 * 50176),
    ({"float8": "rowwise", "float8_min_features": 64, "float8_head": True}, 2 * 50176 + 16384),
    # d_model 64 is below the minimum width: no block linear converts, and the head is not asked for.
    ({"float8": "tensorwise", "float8_min_features": 128}, 0),
])
def test_float8_parameter_count_follows_the_size_rule(options: dict, weights: int) -> None:
    assert float8_parameter_count(ModelConfig(**SMALL, **options)) == weights


def test_float8_parameter_count_skips_widths_off_the_alignment() -> None:
    # d_ff 168 is not a multiple of 16: the MLP stays in bf16, qkv (64 x 192) and out (64 x 64) convert.
    cfg = ModelConfig(**{**SMALL, "d_ff": 168}, float8="tensorwise", float8_min_features=64)
    assert float8_parameter_count(cfg) == 2 * (64 * 192 + 64 * 64)


def test_float8_flops_per_step_is_six_times_weights_times_tokens() -> None:
    cfg = ModelConfig(**SMALL, float8="tensorwise", float8_min_features=64)
    assert float8_flops_per_step(cfg, 2, 8) == 6 * 2 * 50176 * 2 * 8
    assert float8_flops_per_step(cfg, 2, 8, "forward") == 2 * 2 * 50176 * 2 * 8
    assert float8_flops_per_step(cfg, 2, 8, "forward_backward") == float8_flops_per_step(cfg, 2, 8)
    with pytest.raises(ValueError, match="mode"):
        float8_flops_per_step(cfg, 2, 8, "nonsense")


def test_every_matmul_converted_leaves_only_attention_at_bf16() -> None:
    cfg = ModelConfig(**SMALL, float8="tensorwise", float8_min_features=64, float8_head=True)
    rest = flops_per_step(cfg, 2, 8) - float8_flops_per_step(cfg, 2, 8)
    assert rest == 3 * attention_flops_forward(cfg, 2, 8)


@pytest.mark.parametrize(("flops", "float8_flops", "peak", "float8_peak", "expected"), [
    (3e12, 2e12, 1e12, 2e12, 1.5e12),  # 2e12 at 2e12/s + 1e12 at 1e12/s = 2 s for 3e12
    (4e12, 4e12, 1e12, 2e12, 2e12),  # everything float8: the float8 peak
    (4e12, 0.0, 1e12, None, 1e12),  # nothing float8: the bf16 peak, no float8 peak needed
    (4e12, 1e12, 1e12, None, None),  # float8 FLOPs on a device without a float8 peak
    (4e12, 1e12, None, 2e12, None),  # unknown device
])
def test_float8_step_peak_flops_blends_the_two_peaks(flops: float, float8_flops: float, peak: float | None,
                                                     float8_peak: float | None, expected: float | None) -> None:
    assert float8_step_peak_flops(flops, float8_flops, peak, float8_peak) == expected


def test_float8_step_peak_flops_refuses_more_float8_than_total() -> None:
    with pytest.raises(ValueError, match="float8_flops"):
        float8_step_peak_flops(1e12, 2e12, 1e12, 2e12)


@pytest.mark.parametrize(("device", "precision", "expected"), [
    ("NVIDIA H100 80GB HBM3", "fp8", 1978.9e12),
    ("NVIDIA H100 80GB HBM3", torch.float8_e4m3fn, 1978.9e12),
    ("NVIDIA H100 80GB HBM3", "bf16-mixed", 989.4e12),
    ("NVIDIA H200", "fp8", 1978.9e12),
    ("NVIDIA A100-SXM4-80GB", "fp8", None),  # no float8 tensor cores
])
def test_peak_flops_has_a_float8_column(device: str, precision: str | torch.dtype, expected: float | None) -> None:
    assert peak_flops(device, precision) == expected


def test_float8_step_peak_of_the_2_7b_step_on_an_h100() -> None:
    # 2.7B shape (d_model 2560, d_ff 10240, 32 layers, vocab 50257) at B 4, T 512: the blocks' linears convert
    # (every width >= 2048), the head and attention stay bf16. Forward FLOPs by hand: float8 2 * 3355443200 * 2048
    # = 13743895347200 of 2 * 3484101120 * 2048 + 171798691840 (attention) = 14442676879360, a share of 0.95162;
    # the step's peak is 1 / (0.95162 / 1978.9e12 + 0.04838 / 989.4e12) = 1887.565e12, 1.9078x the bf16 peak.
    cfg = ModelConfig(vocab_size=50257, d_model=2560, num_layers=32, num_heads=32, d_ff=10240, float8="tensorwise")
    flops, float8_flops = flops_per_step(cfg, 4, 512), float8_flops_per_step(cfg, 4, 512)
    assert (float8_flops, flops) == (3 * 13743895347200, 3 * 14442676879360)
    device = "NVIDIA H100 80GB HBM3"
    blended = float8_step_peak_flops(flops, float8_flops, peak_flops(device, "bf16-mixed"), peak_flops(device, "fp8"))
    assert blended == pytest.approx(1887.565e12, rel=1e-6)
    # An 80 ms step: 0.5474 of the bf16 peak (the headline), 0.2869 of the float8 step's own peak.
    assert mfu(flops, 0.08, peak_flops(device, "bf16-mixed")) == pytest.approx(0.547403, rel=1e-5)
    assert mfu(flops, 0.08, blended) == pytest.approx(0.286931, rel=1e-5)


def test_flops_by_category_add_up_to_the_step_and_follow_the_attention_backend() -> None:
    from lmtrain.flops import attention_flops_forward, flops_by_category, flops_per_step, matmul_parameter_count

    cfg = ModelConfig.from_size("tiny")
    for mode in ("train", "forward_backward", "forward"):
        split = flops_by_category(cfg, 3, 40, mode)
        assert sum(split.values()) == pytest.approx(flops_per_step(cfg, 3, 40, mode))
    split = flops_by_category(cfg, 3, 40)
    assert split == {"gemm": 3 * 2.0 * matmul_parameter_count(cfg) * 3 * 40,
                     "attention": 3 * attention_flops_forward(cfg, 3, 40)}
    assert flops_by_category(cfg, 3, 40, fused_attention=False) == {"gemm": flops_per_step(cfg, 3, 40)}
