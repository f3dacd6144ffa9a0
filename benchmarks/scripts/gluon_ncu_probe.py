"""Launches for Nsight Compute (run on the GPU machine): each Gluon kernel and SDPA's cuDNN forward and backward
once each, inside ``cudaProfilerStart``/``Stop``, after untimed warm-up launches (compilation, autotuning), so that
``ncu --profile-from-start off`` profiles exactly these launches. bf16, causal, 16 heads, B*H*N = 2^21.

    ncu --profile-from-start off --csv --page raw --metrics <metrics> \\
        python benchmarks/scripts/gluon_ncu_probe.py [--cells 64:1024 64:16384 128:16384]

Each cell is ``head_dim:seq_len``; per cell the launches are, in order: the Gluon forward, cuDNN's forward, the Gluon
dQ and dK/dV kernels, cuDNN's backward (its kernels), each with the library's default configuration and grid. An NVTX
range names each launch (``ncu --print-nvtx-rename kernel`` or the NVTX columns tell them apart).
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmtrain.kernels import flash_gluon_hopper as fg

sys.path.insert(0, os.path.dirname(__file__))
from gluon_probe import poisoned  # noqa: E402


def launches(d: int, n: int):
    """[(name, zero-argument launch)] of one cell, inputs random (never zeros), outputs NaN-poisoned."""
    b, h = 2**21 // (16 * n), 16
    q, k, v, do, o, lse, dq, dk, dv, delta = poisoned(b, h, n, d)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    def cudnn_fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    return [
        (f"gluon fwd d{d} n{n}", lambda: fg.forward(q, k, v, o, lse, True)),
        (f"cudnn fwd d{d} n{n}", cudnn_fwd),
        (f"gluon dq d{d} n{n}", lambda: fg.dq(q, k, v, o, do, dq, lse, delta, True)),
        (f"gluon dkdv d{d} n{n}", lambda: fg.dkdv(q, k, v, do, dk, dv, lse, delta, True)),
        (f"cudnn bwd d{d} n{n}", lambda: torch.autograd.grad(out, (qs, ks, vs), do, retain_graph=True)),
    ]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cells", nargs="+", default=["64:1024", "64:16384", "128:16384"])
    a = p.parse_args()
    cells = [launches(*map(int, c.split(":"))) for c in a.cells]
    for cell in cells:  # warm-up: compile, autotune, allocate
        for _, fn in cell:
            fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for cell in cells:
        for name, fn in cell:
            torch.cuda.nvtx.range_push(name)
            fn()
            torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("launched:", [name for cell in cells for name, _ in cell])


if __name__ == "__main__":
    main()
