"""The leaderboard attention problem, timed as the course states it (run on the GPU machine).

Batch 1 x 16 heads x N 16384 x head dim 64, causal, bf16: a ``torch.compile``d function that calls the attention
and returns ``.sum()`` of its output, then ``.backward()`` of that scalar; ``triton.testing.do_bench`` mean in ms.
``flash_triton`` runs ``FlashAttentionTriton.apply`` with the library's defaults (whatever ``LMTRAIN_FLASH_*``
variables the environment sets); ``sdpa_cudnn`` and ``sdpa_flash`` run PyTorch's SDPA pinned to that backend.
Inputs are random (seed 100); the first step (compilation, autotuning) is untimed.

    PYTHONPATH=. python benchmarks/scripts/flash_leaderboard.py [--backends flash_triton sdpa_cudnn ...]
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from lmtrain.kernels.flash_triton import FlashAttentionTriton

SDPA = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}


def scalar_loss(backend: str):
    """The function the problem compiles: causal attention of (q, k, v) summed to a scalar."""
    if backend == "flash_triton":
        return lambda q, k, v: FlashAttentionTriton.apply(q, k, v, True).sum()
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def leaderboard_ms(backend: str, seed: int = 100) -> float:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, 16, 16384, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    compiled = torch.compile(scalar_loss(backend))

    def step():
        compiled(q, k, v).backward()

    with sdpa_kernel(SDPA[backend]) if backend in SDPA else contextlib.nullcontext():
        step()
        return do_bench(step, grad_to_none=[q, k, v], return_mode="mean")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["flash_triton", "sdpa_cudnn", "sdpa_flash"])
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    rows = [(b, leaderboard_ms(b)) for b in args.backends]
    print("\n| backend | ms |\n| --- | ---: |")
    for backend, ms in rows:
        print(f"| {backend} | {ms:.3f} |")


if __name__ == "__main__":
    main()
