"""lmtrain.analysis.ceilings: achieved TFLOP/s and GB/s per category on a constructed trace, the per-device cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmtrain.analysis.ceilings import achieved, ceiling_metrics, device_ceilings
from lmtrain.analysis.kernels import analyze_trace

GEMM = "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNN"


def _trace() -> dict:
    """Two steps; aten::mm (4e9 FLOPs, with_flops) launches one 100 µs GEMM and a 25 µs memset; a 40 µs
    device-to-device memcpy copies 80 MB; a 10 µs host-to-device memcpy moves 8 MB; an attention kernel of 50 µs has
    no FLOPs in the trace."""
    x = {"ph": "X", "pid": 1, "tid": 1}
    return {"traceEvents": [
        {**x, "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 500},
        {**x, "cat": "user_annotation", "name": "ProfilerStep#2", "ts": 500, "dur": 500},
        {**x, "cat": "cpu_op", "name": "aten::mm", "ts": 10, "dur": 20, "args": {"External id": 3, "flops": 4e9}},
        {**x, "cat": "kernel", "name": GEMM, "ts": 40, "dur": 100, "args": {"External id": 3, "correlation": 1}},
        {**x, "cat": "gpu_memset", "name": "Memset (Device)", "ts": 150, "dur": 25,
         "args": {"External id": 3, "correlation": 2}},
        {**x, "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 200, "dur": 40,
         "args": {"bytes": 80e6, "correlation": 4}},
        {**x, "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 250, "dur": 10,
         "args": {"bytes": 8e6, "correlation": 6}},
        {**x, "cat": "kernel", "name": "_flash_fused_bwd_atomic", "ts": 300, "dur": 50, "args": {"correlation": 5}},
    ]}


def test_achieved_flops_and_bytes_per_category() -> None:
    found = achieved(_trace(), steps=2, model_flops_per_step=3e9)
    # the mm's FLOPs spread over its kernels by time: 100 / 125 to the GEMM, 25 / 125 to the memset (copy)
    assert found["gemm"] == pytest.approx({"us": 50.0, "flops": 1.6e9})
    # copy: the memset, both memcpys; bytes from the DtoD memcpy only, read plus written, over its own 20 µs
    assert found["copy"] == pytest.approx({"us": 37.5, "flops": 0.4e9, "bytes": 80e6, "memcpy_us": 20.0,
                                           "transfer_bytes": 4e6, "transfer_us": 5.0})
    assert found["attention"] == pytest.approx({"us": 25.0})
    assert found["model"] == pytest.approx({"us": 75.0, "flops": 3e9})  # gemm + attention time


def test_ceiling_metrics_against_this_gpus_ceilings() -> None:
    metrics = ceiling_metrics(achieved(_trace(), steps=2), {"bf16_matmul_tflops": 64.0, "copy_gbps": 8000.0})
    assert metrics["roofline/gemm_tflops"] == pytest.approx(32.0)  # 1.6e9 FLOPs in 50 µs
    assert metrics["roofline/gemm_tflops_of_peak"] == pytest.approx(0.5)
    assert metrics["roofline/copy_gbps"] == pytest.approx(4000.0)  # 2 x 80 MB in 40 µs (memcpy time, not memset)
    assert metrics["roofline/copy_gbps_of_peak"] == pytest.approx(0.5)
    assert metrics["roofline/copy_transfer_gbps"] == pytest.approx(800.0)  # 8 MB one way in 10 µs, no ceiling
    assert "roofline/copy_transfer_gbps_of_peak" not in metrics
    assert not any(k.startswith("roofline/attention") for k in metrics)  # no FLOPs, no bytes: nothing claimed
    assert analyze_trace(_trace(), ceilings={"bf16_matmul_tflops": 64.0}).metrics["roofline/gemm_tflops_of_peak"] \
        == pytest.approx(0.5)


def test_ceilings_are_measured_once_per_device_and_cached(tmp_path: Path) -> None:
    cache, calls = tmp_path / "ceilings.json", []

    def measure() -> dict[str, float]:
        calls.append(1)
        return {"bf16_matmul_tflops": 700.0, "copy_gbps": 2800.0}

    assert device_ceilings("GPU A", cache, measure) == {"bf16_matmul_tflops": 700.0, "copy_gbps": 2800.0}
    assert device_ceilings("GPU A", cache, measure)["copy_gbps"] == 2800.0 and len(calls) == 1
    table = json.loads(cache.read_text())
    table["GPU A"]["copy_gbps"] = 3000.0  # a user's override
    cache.write_text(json.dumps(table))
    assert device_ceilings("GPU A", cache, measure)["copy_gbps"] == 3000.0
    device_ceilings("GPU B", cache, measure)
    assert len(calls) == 2 and set(json.loads(cache.read_text())) == {"GPU A", "GPU B"}
