"""Host time of one flash_triton forward+backward call at the 2.7B model's attention shape (batch 4 x 32 heads x 512
x head dim 80, causal bf16) and where it goes: the loop's wall time per call (the GPU work of a call is shorter
than its host work at this size, so the wall time is the host time), then the top functions under cProfile.

    PYTHONPATH=. python docs/benchmarks/scripts/flash_host_profile.py [--shape B H N D] [--calls 300]
"""
import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

from lmtrain.kernels.flash_triton import FlashAttentionTriton


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", nargs=4, type=int, default=[4, 32, 512, 80])
    p.add_argument("--calls", type=int, default=300)
    a = p.parse_args()
    q, k, v, do = (torch.randn(*a.shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    runs = {"flash_triton": lambda: FlashAttentionTriton.apply(*leaves, True),
            "sdpa": lambda: F.scaled_dot_product_attention(*leaves, is_causal=True)}
    for name, fn in runs.items():
        for _ in range(20):
            fn().backward(do)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            fn().backward(do)
        host = (time.perf_counter() - t0) / a.calls * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / a.calls * 1e6
        print(f"{name}: {host:.0f} us per forward+backward call issued, {wall:.0f} us until the GPU finished")
    # Autograd runs the backward in its own thread, which cProfile does not see: run it in this one.
    torch.autograd.set_multithreading_enabled(False)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        runs["flash_triton"]().backward(do)
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
