"""lmtrain.analysis.ceilings: achieved TFLOP/s and GB/s per category on a constructed trace, the per-device cache."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from lmtrain.analysis.ceilings import achieved, cache_key, ceiling_metrics, device_ceilings, measure_ceilings
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

    def measure(device: torch.device) -> dict[str, float]:
        calls.append(device)
        return {"bf16_matmul_tflops": 700.0, "copy_gbps": 2800.0}

    gpu = torch.device("cuda", 1)
    assert device_ceilings(gpu, cache, measure, "GPU A") == {"bf16_matmul_tflops": 700.0, "copy_gbps": 2800.0}
    assert calls == [gpu]  # measured on the device it was given, not the current one
    assert device_ceilings(gpu, cache, measure, "GPU A")["copy_gbps"] == 2800.0 and len(calls) == 1
    table = json.loads(cache.read_text())
    assert set(table) == {cache_key("GPU A")} and torch.__version__ in cache_key("GPU A")
    table[cache_key("GPU A")]["copy_gbps"] = 3000.0  # a user's override
    cache.write_text(json.dumps(table))
    assert device_ceilings(gpu, cache, measure, "GPU A")["copy_gbps"] == 3000.0
    device_ceilings("cuda:0", cache, measure, "GPU B")
    assert len(calls) == 2 and set(json.loads(cache.read_text())) == {cache_key("GPU A"), cache_key("GPU B")}


def test_an_entry_keyed_by_the_name_alone_is_measured_again(tmp_path: Path) -> None:
    """Caches written before the key held the torch version may hold a CPU-speed figure: they are not read."""
    cache = tmp_path / "ceilings.json"
    cache.write_text(json.dumps({"GPU A": {"bf16_matmul_tflops": 0.3, "copy_gbps": 20.0}}))
    found = device_ceilings("cuda:0", cache, lambda device: {"bf16_matmul_tflops": 700.0, "copy_gbps": 2800.0},
                            "GPU A")
    assert found["bf16_matmul_tflops"] == 700.0


@pytest.mark.parametrize("device", ["cpu", torch.device("meta")])
def test_no_ceilings_off_a_cuda_device_and_nothing_cached(tmp_path: Path, device: object) -> None:
    cache, calls = tmp_path / "ceilings.json", []
    assert device_ceilings(device, cache, lambda d: calls.append(d) or {"bf16_matmul_tflops": 1.0},
                           "GPU A") is None
    assert device_ceilings(device, cache) is None  # the default measure too
    assert calls == [] and not cache.exists()
    with pytest.raises(ValueError, match="CUDA device"):
        measure_ceilings(device)


def test_an_implausible_measurement_is_not_cached(tmp_path: Path) -> None:
    cache = tmp_path / "ceilings.json"
    for bad in ({"bf16_matmul_tflops": 0.0, "copy_gbps": 2800.0}, {"bf16_matmul_tflops": math.nan}, {}):
        assert device_ceilings("cuda:0", cache, lambda device, bad=bad: bad, "GPU A") is None
    assert not cache.exists()


class _Allocations(TorchFunctionMode):
    """Records the ``device`` of every ``torch.randn`` / ``torch.empty``, then stops the measurement (no CUDA here)."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: list[object] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in (torch.randn, torch.empty):
            self.devices.append((kwargs or {}).get("device"))
            raise _Stop
        return func(*args, **(kwargs or {}))


class _Stop(Exception):
    pass


def test_the_default_measure_allocates_on_the_given_device(tmp_path: Path) -> None:
    """The default path (no ``measure``) makes its operands on the device it was given; a failed measurement
    writes nothing."""
    cache, spy = tmp_path / "ceilings.json", _Allocations()
    with spy, pytest.raises(_Stop):
        device_ceilings(torch.device("cuda", 1), cache, device_name="GPU A")
    assert spy.devices == [torch.device("cuda", 1)] and not cache.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ceilings_measured_on_the_gpu(tmp_path: Path) -> None:
    """On a GPU the figures are the GPU's (a CPU-speed bf16 matmul is well under 1 TFLOP/s), cached under its name
    and torch version."""
    cache, device = tmp_path / "ceilings.json", torch.device("cuda", torch.cuda.current_device())
    found = device_ceilings(device, cache)
    assert found["bf16_matmul_tflops"] > 20 and found["copy_gbps"] > 200, found
    assert json.loads(cache.read_text()) == {cache_key(torch.cuda.get_device_name(device)): found}


def test_model_flops_per_category_stand_in_only_where_the_trace_has_no_operator_flops() -> None:
    """A trace without operators (KernelShare's default): the model's FLOPs per category go to the categories that
    have kernel time; a trace with operators' FLOPs keeps those, whatever is given."""
    from lmtrain.analysis.ceilings import achieved

    kernels = [{"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NTT", "ts": 0,
                "dur": 100, "args": {"correlation": 1, "External id": 7}},
               {"ph": "X", "cat": "kernel", "name": "_flash_tma_fwd", "ts": 100, "dur": 50,
                "args": {"correlation": 2}}]
    given = {"gemm": 8e9, "attention": 1e9, "copy": 5e9}
    found = achieved({"traceEvents": kernels}, steps=2, category_flops_per_step=given)
    assert found["gemm"] == {"us": 50.0, "flops": 8e9} and found["attention"] == {"us": 25.0, "flops": 1e9}
    assert "copy" not in found  # no kernel time there: nothing to charge
    with_ops = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1,
                 "args": {"External id": 7, "flops": 4e9}}, *kernels]
    found = achieved({"traceEvents": with_ops}, steps=2, category_flops_per_step=given)
    assert found["gemm"]["flops"] == pytest.approx(2e9) and "flops" not in found["attention"]
