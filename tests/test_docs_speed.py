"""docs/speed.md's float8 MFU example: its figures are what lmtrain.flops gives for the shipped 2.7B float8 config."""

from __future__ import annotations

from pathlib import Path

import yaml

from lmtrain.config import ModelConfig
from lmtrain.flops import PEAK_FLOPS, float8_flops_per_step, float8_step_peak_flops, flops_per_step, mfu

ROOT = Path(__file__).resolve().parents[1]


def test_the_float8_mfu_example_matches_the_shipped_config() -> None:
    model = yaml.safe_load((ROOT / "configs" / "2.7B_bf16_fp8.yaml").read_text())["model"]
    cfg = ModelConfig.from_size(model["size"], vocab_size=model["vocab_size"], context_length=model["context_length"],
                                float8=model["float8"], float8_min_features=model["float8_min_features"])
    peaks = dict(PEAK_FLOPS)["H100"]
    flops, float8 = flops_per_step(cfg, 4, 512), float8_flops_per_step(cfg, 4, 512)
    step_peak = float8_step_peak_flops(flops, float8, peaks["bf16"], peaks["fp8"])
    doc = " ".join((ROOT / "docs" / "speed.md").read_text().split())
    assert f"vocabulary {cfg.vocab_size:,}" in doc
    assert f"linears hold {100 * float8 / flops:.1f}% of the step's FLOPs" in doc
    assert f"the step's peak is {step_peak / 1e12:.1f} TFLOP/s ({step_peak / peaks['bf16']:.2f}x bf16)" in doc
    assert (f"an 80 ms step is {mfu(flops, 0.080, peaks['bf16']):.3f} of the bf16 peak and "
            f"{mfu(flops, 0.080, step_peak):.3f} of its own") in doc
