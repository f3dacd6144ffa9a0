"""How far each kind of work is from this GPU's own ceilings: achieved TFLOP/s and GB/s per kernel category.

Ceilings are measured, not typed in: :func:`measure_ceilings` times a bf16 matrix product (8192^3) and a
device-to-device copy (256 MiB: bytes read plus bytes written) on the device, once; :func:`device_ceilings` keeps
the result in a JSON file keyed by device name (default ``~/.cache/lmtrain/ceilings.json``), so later runs read it.
Edit that file, or pass values, to override. On a CPU there is nothing to measure (one line says so).

What the trace gives (:func:`achieved`):

- FLOPs: the ``flops`` argument torch.profiler records on operators with ``with_flops=True`` (matrix products and
  convolutions), spread over the kernels that operator launched in proportion to their time, then summed per
  kernel category. Without it, the caller may give the model's FLOPs per step (``lmtrain.flops``): they are all
  charged to the ``gemm`` and ``attention`` kernels together (``model``), which approximates: the model FLOPs count
  the matmuls and attention only, and recomputation or fused elementwise work is not in them.
- Bytes: the ``bytes`` argument of memcpy activities, over the time of those memcpy activities alone (a category's
  other kernels, such as memsets or copy kernels, move bytes the trace does not give). A device-to-device copy reads
  and writes its bytes, so it counts them twice, as the ``copy_gbps`` ceiling does; host<->device and peer copies
  cross a link, not device memory: their one-way bytes give ``transfer`` GB/s, with no ceiling to compare with.
  Elementwise kernels' traffic is not in a trace, so they get no GB/s.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from lmtrain.analysis.categories import categorize

__all__ = ["DEFAULT_CACHE", "achieved", "ceiling_metrics", "device_ceilings", "measure_ceilings"]

#: Where measured ceilings are kept, keyed by device name.
DEFAULT_CACHE = Path.home() / ".cache" / "lmtrain" / "ceilings.json"


def measure_ceilings(device: Any = None) -> dict[str, float]:
    """Measure ``bf16_matmul_tflops`` and ``copy_gbps`` on a CUDA device (about a second)."""
    import torch

    def timed(fn: Any, reps: int) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps  # seconds per call

    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    matmul_s = timed(lambda: a @ b, 10)
    src = torch.empty(256 * 2**20, device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), 20)
    return {"bf16_matmul_tflops": 2 * n**3 / matmul_s / 1e12, "copy_gbps": 2 * src.numel() / copy_s / 1e9}


def device_ceilings(device_name: str, cache: Path | None = None, measure: Any = None) -> dict[str, float]:
    """The ceilings of ``device_name`` from the cache file, measured (with ``measure()``) and stored when missing.

    Args:
        device_name: ``torch.cuda.get_device_name()``.
        cache: the JSON file (default :data:`DEFAULT_CACHE`).
        measure: a function returning the ceilings (default :func:`measure_ceilings` on the current device).
    """
    path = cache or DEFAULT_CACHE
    table = json.loads(path.read_text()) if path.is_file() else {}
    if device_name not in table:
        table[device_name] = (measure or measure_ceilings)()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    return table[device_name]


def achieved(trace: dict, steps: int = 1, model_flops_per_step: float | None = None) -> dict[str, dict[str, float]]:
    """Per category, per step: ``us`` (kernel time), and where the trace has them ``flops``; ``bytes`` and
    ``memcpy_us`` (device-to-device memcpy activities: bytes read plus written, and their own time);
    ``transfer_bytes`` and ``transfer_us`` (host<->device and peer memcpy activities: one-way bytes, their time).

    ``model`` holds the gemm + attention time and ``model_flops_per_step`` when it is given (module docstring).
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    op_flops = {int(e["args"]["External id"]): float(e["args"]["flops"]) for e in events
                if e.get("cat") == "cpu_op" and "flops" in (e.get("args") or {}) and "External id" in e["args"]}
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    per_op: dict[int, float] = defaultdict(float)
    for e in kernels:
        ext = (e.get("args") or {}).get("External id")
        if ext is not None and int(ext) in op_flops:
            per_op[int(ext)] += float(e.get("dur", 0))
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in kernels:
        args, dur = e.get("args") or {}, float(e.get("dur", 0))
        category = categorize(e.get("name", ""))
        out[category]["us"] += dur / steps
        ext = args.get("External id")
        if ext is not None and int(ext) in op_flops and per_op[int(ext)] > 0:
            out[category]["flops"] += op_flops[int(ext)] * dur / per_op[int(ext)] / steps
        if e.get("cat") == "gpu_memcpy" and "bytes" in args:
            if "DtoD" in e.get("name", ""):  # "Memcpy DtoD (Device -> Device)": read and written in device memory
                out[category]["bytes"] += 2 * float(args["bytes"]) / steps
                out[category]["memcpy_us"] += dur / steps
            else:  # HtoD, DtoH, PtoP: across PCIe or NVLink
                out[category]["transfer_bytes"] += float(args["bytes"]) / steps
                out[category]["transfer_us"] += dur / steps
    if model_flops_per_step:
        out["model"]["us"] = out.get("gemm", {}).get("us", 0.0) + out.get("attention", {}).get("us", 0.0)
        out["model"]["flops"] = model_flops_per_step
    return {c: dict(v) for c, v in out.items()}


def ceiling_metrics(found: dict[str, dict[str, float]], ceilings: dict[str, float]) -> dict[str, float]:
    """``roofline/{category}_tflops`` and ``roofline/{category}_tflops_of_peak`` (against the bf16 matmul ceiling);
    ``roofline/{category}_gbps`` and ``roofline/{category}_gbps_of_peak`` (device-to-device memcpy bytes over
    their own time, against the copy ceiling); ``roofline/{category}_transfer_gbps`` (host<->device and peer
    memcpy, no ceiling)."""
    out = {}
    for category, v in found.items():
        seconds = v.get("us", 0.0) / 1e6
        if seconds <= 0:
            continue
        if v.get("flops"):
            out[f"roofline/{category}_tflops"] = v["flops"] / seconds / 1e12
            if ceilings.get("bf16_matmul_tflops"):
                out[f"roofline/{category}_tflops_of_peak"] = out[f"roofline/{category}_tflops"] / ceilings[
                    "bf16_matmul_tflops"]
        if v.get("bytes") and v.get("memcpy_us"):
            out[f"roofline/{category}_gbps"] = v["bytes"] / (v["memcpy_us"] / 1e6) / 1e9
            if ceilings.get("copy_gbps"):
                out[f"roofline/{category}_gbps_of_peak"] = out[f"roofline/{category}_gbps"] / ceilings["copy_gbps"]
        if v.get("transfer_bytes") and v.get("transfer_us"):
            out[f"roofline/{category}_transfer_gbps"] = v["transfer_bytes"] / (v["transfer_us"] / 1e6) / 1e9
    return out
