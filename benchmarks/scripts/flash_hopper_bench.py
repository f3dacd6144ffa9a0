"""flash_triton on Hopper against SDPA's cuDNN and FlashAttention-2 backends (run on the GPU machine).

Prints, for bf16, causal, 16 heads and B*H*N = 2^21 (N in 1024/4096/16384, head dims 64/80/128), forward and
forward+backward TFLOP/s of ``flash_triton``, ``sdpa_cudnn`` and ``sdpa_flash`` (``triton.testing.do_bench``
medians; forward FLOPs 4*B*H*N^2*d/2, forward+backward 3.5x that) and flash_triton's ratios to cuDNN; then the
leaderboard problem: batch 1 x 16 heads x N 16384 x d 64, causal, bf16, forward then backward of a scalar loss
(``.sum()``) through a ``torch.compile``d function calling the autograd Function, ``do_bench`` mean in ms.

    PYTHONPATH=. python benchmarks/scripts/flash_hopper_bench.py [--pointer-baseline]

``--pointer-baseline`` also times the leaderboard problem with the pointer kernels (``LMTRAIN_FLASH_TMA=0``), and
with the TMA forward followed by the pointer backward. Inputs are random, fresh per cell; the first call of each
cell (compilation, autotuning) is untimed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from lmtrain.bench.attention import attention_flops
from lmtrain.kernels.flash_triton import FlashAttentionTriton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flash_leaderboard import scalar_loss  # noqa: E402  (the script beside this one)

HEADS, TOKENS_HEADS = 16, 2**21
BACKENDS = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}


def _inputs(b: int, h: int, n: int, d: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)]


def _attention(backend: str):
    if backend == "flash_triton":
        return lambda q, k, v: FlashAttentionTriton.apply(q, k, v, True)

    def sdpa(q, k, v):
        with sdpa_kernel(BACKENDS[backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return sdpa


def time_cell(backend: str, b: int, n: int, d: int, seed: int) -> tuple[float, float]:
    """(forward ms, forward+backward ms), do_bench medians."""
    q, k, v, do = _inputs(b, HEADS, n, d, seed)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    fn = _attention(backend)
    fn(*leaves).backward(do)  # compile / autotune outside the timing
    with torch.no_grad():
        fwd = do_bench(lambda: fn(q, k, v), return_mode="median")
    fwd_bwd = do_bench(lambda: fn(*leaves).backward(do), grad_to_none=leaves, return_mode="median")
    return fwd, fwd_bwd


def leaderboard_ms(backend: str, seed: int, env: dict[str, str] | None = None) -> float:
    """Batch 1 x 16 heads x 16384 x 64, causal bf16: compiled forward + backward of a scalar loss, do_bench mean."""
    q, k, v, _ = _inputs(1, HEADS, 16384, 64, seed)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(scalar_loss(backend))
    env = env or {}

    def step():
        os.environ["LMTRAIN_FLASH_TMA"] = env.get("forward", "1")
        out = compiled(*leaves)
        os.environ["LMTRAIN_FLASH_TMA"] = env.get("backward", "1")
        out.backward()

    context = sdpa_kernel(BACKENDS[backend]) if backend in BACKENDS else contextlib.nullcontext()
    with context:
        step()
        ms = do_bench(step, grad_to_none=leaves, return_mode="mean")
    os.environ["LMTRAIN_FLASH_TMA"] = "1"
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pointer-baseline", action="store_true")
    parser.add_argument("--seq-lens", default="1024,4096,16384")
    parser.add_argument("--head-dims", default="64,80,128")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rows = []
    seed = 0
    for d in map(int, args.head_dims.split(",")):
        for n in map(int, args.seq_lens.split(",")):
            b = TOKENS_HEADS // (HEADS * n)
            flops = attention_flops(b, HEADS, n, n, d, True)
            tf = {}
            for backend in ("flash_triton", "sdpa_cudnn", "sdpa_flash"):
                seed += 1
                fwd, fwd_bwd = time_cell(backend, b, n, d, seed)
                tf[backend] = (flops / fwd / 1e9, 3.5 * flops / fwd_bwd / 1e9)
                print(f"d {d} N {n} {backend}: fwd {fwd:.3f} ms, fwd+bwd {fwd_bwd:.3f} ms", flush=True)
            ours, cudnn, fa2 = tf["flash_triton"], tf["sdpa_cudnn"], tf["sdpa_flash"]
            rows.append(f"| {d} | {n} | {b} | {ours[0]:.0f} / {ours[1]:.0f} | {cudnn[0]:.0f} / {cudnn[1]:.0f} | "
                        f"{fa2[0]:.0f} / {fa2[1]:.0f} | {ours[0] / cudnn[0]:.2f} / {ours[1] / cudnn[1]:.2f} |")
    board = [f"| flash_triton | {leaderboard_ms('flash_triton', 100):.3f} |",
             f"| sdpa_cudnn | {leaderboard_ms('sdpa_cudnn', 100):.3f} |"]
    if args.pointer_baseline:
        board.append(f"| flash_triton, pointer kernels | "
                     f"{leaderboard_ms('flash_triton', 100, {'forward': '0', 'backward': '0'}):.3f} |")
        board.append(f"| flash_triton, TMA forward + pointer backward | "
                     f"{leaderboard_ms('flash_triton', 100, {'forward': '1', 'backward': '0'}):.3f} |")
    print("\nbf16, causal, 16 heads, B*H*N = 2^21; TFLOP/s forward / forward+backward (do_bench median)\n")
    print("| d | N | B | flash_triton | sdpa_cudnn | sdpa_flash | flash_triton / cudnn |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))
    print("\nleaderboard: 1 x 16 x 16384 x 64, causal bf16, compiled fwd+bwd of .sum() (do_bench mean)\n")
    print("| backend | ms |\n| --- | ---: |")
    print("\n".join(board))


if __name__ == "__main__":
    main()
