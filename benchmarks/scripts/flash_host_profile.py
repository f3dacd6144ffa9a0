"""Host time of one flash_triton forward+backward call at the 2.7B model's attention shape (batch 4 x 32 heads x 512
x head dim 80, causal bf16) and where it goes: the loop's wall time per call (the GPU work of a call is shorter
than its host work at this size, so the wall time is the host time), the same autograd Function with its kernels
left out (what autograd costs), then the top functions under cProfile.

    PYTHONPATH=. python benchmarks/scripts/flash_host_profile.py [--shape B H N D] [--calls 300]
"""
import argparse
import cProfile
import os
import pstats
import time

import torch
import torch.nn.functional as F

from lmtrain.kernels.flash_triton import FlashAttentionTriton


class Empty(torch.autograd.Function):
    """The autograd Function around flash_triton with its kernels left out: what autograd itself costs per call."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal):
        o, lse = torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(lse, q, k, v, o)
        return o

    @staticmethod
    def backward(ctx, grad_o):
        lse, q, k, v, o = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", nargs=4, type=int, default=[4, 32, 512, 80])
    p.add_argument("--calls", type=int, default=300)
    a = p.parse_args()
    q, k, v, do = (torch.randn(*a.shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    runs = {"flash_triton": lambda: FlashAttentionTriton.apply(*leaves, True),
            "sdpa": lambda: F.scaled_dot_product_attention(*leaves, is_causal=True),
            "autograd Function without kernels": lambda: Empty.apply(*leaves, True)}
    # flash_triton's plans replayed through Triton's C launch function (the default) or its Python launcher
    order = [("flash_triton", "1"), ("flash_triton", "python"), ("sdpa", "1"),
             ("autograd Function without kernels", "1")] * 2
    for name, setting in order:
        fn = runs[name]
        os.environ["LMTRAIN_FLASH_LAUNCH_PLANS"] = setting
        name = name if name != "flash_triton" else f"flash_triton (LMTRAIN_FLASH_LAUNCH_PLANS={setting})"
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
    os.environ["LMTRAIN_FLASH_LAUNCH_PLANS"] = "1"
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
