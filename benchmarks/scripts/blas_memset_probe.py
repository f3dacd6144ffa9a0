"""How many memsets cuBLAS and cuDNN put into a CUDA graph of 2.7B blocks, and what they cost: one setting per process.

Captures the forward and backward pass of eight blocks shaped like the 2.7B model's (d_model 2560, d_ff 10240, 32
heads of 80, batch 4 x context 512 = 2,048 tokens, bf16) as one CUDA graph, replays it, times 20 replays with CUDA
events (median), profiles 3 more and prints one JSON line: per replay, the GPU operations, the memsets among them,
the busy time (union of their intervals), the gaps under 200 µs between them, and the GEMM kernels' time, with the
kernels the memsets come before.

cuBLAS reads its workspace size once per process, from the environment, so each setting runs in its own process::

    python benchmarks/scripts/blas_memset_probe.py                                   # PyTorch's workspace
    CUBLAS_WORKSPACE_CONFIG=:0:0 python benchmarks/scripts/blas_memset_probe.py     # no cuBLAS workspace
    CUBLASLT_WORKSPACE_SIZE=0 python benchmarks/scripts/blas_memset_probe.py        # no cuBLASLt workspace
    python benchmarks/scripts/blas_memset_probe.py --blas cublaslt --sdpa flash     # other BLAS path / attention

``model.blas_workspace`` (``lmtrain/blas.py``) chooses the workspace in a fit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from lmtrain.analysis.kernels import gpu_timeline

#: The 2.7B model's block shapes (lmtrain.config) at batch 4, context 512.
TOKENS, D_MODEL, D_FF, HEADS, BATCH, SEQ, HEAD_DIM = 2048, 2560, 10240, 32, 4, 512, 80
BLOCKS = 8
GAP_LIMIT_US = 200.0


def replay_stats(events: list[dict[str, Any]], replays: int) -> dict[str, Any]:
    """Per replay, from a Chrome trace's events: GPU operations (kernels, memsets, memcpys), memsets, busy ms (the
    union of their intervals), the gaps under ``GAP_LIMIT_US`` between them in ms, GEMM ms (``nvjet`` / ``gemm``
    kernels), and for each kernel that follows a memset how many times it does (over all replays)."""
    ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                 key=lambda e: float(e["ts"]))
    timeline = gpu_timeline([(float(e["ts"]), float(e.get("dur", 0)), e["name"], "") for e in ops],
                            keep_gaps=len(ops))
    busy = timeline.busy_us if timeline else 0.0
    gaps = sum(gap for gap, *_ in timeline.largest_gaps if gap < GAP_LIMIT_US) if timeline else 0.0
    after: dict[str, int] = {}
    for e, nxt in zip(ops, ops[1:], strict=False):
        if e["cat"] == "gpu_memset":
            after[nxt["name"]] = after.get(nxt["name"], 0) + 1
    gemm_us = sum(float(e.get("dur", 0)) for e in ops if e["cat"] == "kernel" and
                  (e["name"].startswith("nvjet") or "gemm" in e["name"].lower()))
    return {"ops_per_replay": len(ops) / replays,
            "memsets_per_replay": sum(e["cat"] == "gpu_memset" for e in ops) / replays,
            "busy_ms": busy / replays / 1e3, "small_gaps_ms": gaps / replays / 1e3, "gemm_ms": gemm_us / replays / 1e3,
            "memset_before": dict(sorted(after.items(), key=lambda kv: -kv[1]))}


def measure(blas: str, sdpa: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    if blas != "default":
        torch.backends.cuda.preferred_blas_library(blas)
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[sdpa]
    torch.manual_seed(0)
    bf16, dev = torch.bfloat16, "cuda"
    shapes = {"qkv": (D_MODEL, 3 * D_MODEL), "out": (D_MODEL, D_MODEL), "w1": (D_MODEL, D_FF), "w3": (D_MODEL, D_FF),
              "w2": (D_FF, D_MODEL)}
    w = {n: (torch.randn(o, i, device=dev, dtype=bf16) * 0.02).requires_grad_() for n, (i, o) in shapes.items()}
    x0 = torch.randn(TOKENS, D_MODEL, device=dev, dtype=bf16, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ w["qkv"].t()).view(BATCH, SEQ, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        with sdpa_kernel(backend):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + y.transpose(1, 2).reshape(TOKENS, D_MODEL) @ w["out"].t()
        return x + (F.silu(x @ w["w1"].t()) * (x @ w["w3"].t())) @ w["w2"].t()

    def step() -> None:
        x = x0
        for _ in range(BLOCKS):
            x = block(x)
        x.float().square().mean().backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for p in [*w.values(), x0]:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    replays = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    env = {k: os.environ[k] for k in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE") if k in os.environ}
    return {"blas": blas, "sdpa": sdpa, "env": env, "device": torch.cuda.get_device_name(),
            "replay_ms": sorted(times)[len(times) // 2], **replay_stats(events, replays)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--blas", default="default", choices=["default", "cublas", "cublaslt"],
                        help="torch.backends.cuda.preferred_blas_library (default: leave it)")
    parser.add_argument("--sdpa", default="cudnn", choices=["cudnn", "flash"], help="the attention kernel")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("blas_memset_probe: needs a CUDA GPU (it captures a CUDA graph); none is visible.", file=sys.stderr)
        return 2
    print(json.dumps(measure(args.blas, args.sdpa)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
