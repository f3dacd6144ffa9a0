"""How far each kind of work is from this GPU's own ceilings: achieved TFLOP/s and GB/s per kernel category.

Ceilings are measured, not typed in: :func:`measure_ceilings` times a bf16 matrix product (8192^3) and a
device-to-device copy (256 MiB: bytes read plus bytes written) on the given CUDA device, once;
:func:`device_ceilings` keeps the result in a JSON file keyed by device name and torch version (default
``~/.cache/lmtrain/ceilings.json``), so later runs read it. Edit that file, or pass values, to override. Only a CUDA
device is measured: on a CPU there is nothing to measure and nothing is stored (the caller says so in one line).

What the trace gives (:func:`achieved`):

- FLOPs: the ``flops`` argument torch.profiler records on operators with ``with_flops=True`` (matrix products and
  convolutions), spread over the kernels that operator launched in proportion to their time, then summed per
  kernel category. Without it (a trace without operators, KernelShare's default), the caller may give the model's
  FLOPs per category (``lmtrain.flops.flops_by_category``: the linear layers' products for ``gemm``, QK^T and PV for
  ``attention``). The caller may also give the model's FLOPs per step (``lmtrain.flops``): they are all charged to
  the ``gemm`` and ``attention`` kernels together (``model``). Both approximate: the model FLOPs count the matmuls
  and attention only, and recomputation or fused elementwise work is not in them.
- Bytes: the ``bytes`` argument of memcpy activities, over the time of those memcpy activities alone (a category's
  other kernels, such as memsets or copy kernels, move bytes the trace does not give). A device-to-device copy reads
  and writes its bytes, so it counts them twice, as the ``copy_gbps`` ceiling does; host<->device and peer copies
  cross a link, not device memory: their one-way bytes give ``transfer`` GB/s, with no ceiling to compare with.
  Elementwise kernels' traffic is not in a trace, so they get no GB/s.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from lmtrain.analysis.categories import categorize

__all__ = ["DEFAULT_CACHE", "achieved", "cache_key", "ceiling_metrics", "device_ceilings", "measure_ceilings"]

#: Where measured ceilings are kept, keyed by device name and torch version (:func:`cache_key`).
DEFAULT_CACHE = Path.home() / ".cache" / "lmtrain" / "ceilings.json"


def measure_ceilings(device: Any) -> dict[str, float]:
    """Measure ``bf16_matmul_tflops`` and ``copy_gbps`` on the CUDA device ``device`` (about a second).

    Raises:
        ValueError: ``device`` is not a CUDA device (CUDA events would time host work, not the GPU's).
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"measure_ceilings measures a CUDA device, got {device}.")

    def timed(fn: Any, reps: int) -> float:
        for _ in range(3):
            fn()
        # The operands' device runs the work on its current stream: the events are recorded on that stream
        # (not the current device's, which may be another GPU).
        stream = torch.cuda.current_stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(reps):
            fn()
        end.record(stream)
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


def cache_key(device_name: str) -> str:
    """The cache file's key for a device: its name and the torch version that measured it (a new torch may come
    with faster kernels, and an entry from an older torch, or from before the key held the version, is not read)."""
    import torch

    return f"{device_name} | torch {torch.__version__}"


def device_ceilings(device: Any, cache: Path | None = None, measure: Any = None,
                    device_name: str | None = None) -> dict[str, float] | None:
    """The ceilings of the CUDA device ``device`` from the cache file, measured on it and stored when missing.

    Only a CUDA device is measured: for any other device this returns None, measures nothing and writes nothing
    (a CPU's figures stored under a GPU's name would make every later ``*_of_peak`` wrong). A measurement whose
    figures are not finite and above 0 is not stored either (and None is returned).

    Args:
        device: the device to measure on (``torch.device`` or a string such as ``"cuda:1"``).
        cache: the JSON file (default :data:`DEFAULT_CACHE`), keyed by :func:`cache_key`.
        measure: ``measure(device)`` returning the ceilings (default :func:`measure_ceilings`).
        device_name: the device's name (default ``torch.cuda.get_device_name(device)``).
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    key = cache_key(device_name or torch.cuda.get_device_name(device))
    path = cache or DEFAULT_CACHE
    table = json.loads(path.read_text()) if path.is_file() else {}
    if key in table:
        return table[key]
    found = (measure or measure_ceilings)(device)
    if not found or not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in found.values()):
        return None
    table[key] = found
    path.parent.mkdir(parents=True, exist_ok=True)
    # Several ranks may measure at once: each writes a whole file and renames it over the old one.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return found


def achieved(trace: dict, steps: int = 1, model_flops_per_step: float | None = None,
             category_flops_per_step: dict[str, float] | None = None) -> dict[str, dict[str, float]]:
    """Per category, per step: ``us`` (kernel time), and where the trace has them ``flops``; ``bytes`` and
    ``memcpy_us`` (device-to-device memcpy activities: bytes read plus written, and their own time);
    ``transfer_bytes`` and ``transfer_us`` (host<->device and peer memcpy activities: one-way bytes, their time).

    ``model`` holds the gemm + attention time and ``model_flops_per_step`` when it is given (module docstring).
    ``category_flops_per_step`` (category -> the model's FLOPs per step that its kernels run, e.g. ``gemm`` and
    ``attention``) stands in for the operators' FLOPs where the trace has none (a trace without operators), for the
    categories that have kernel time.
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
    if not op_flops:
        for category, flops in (category_flops_per_step or {}).items():
            if flops and out.get(category, {}).get("us"):
                out[category]["flops"] = flops
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
