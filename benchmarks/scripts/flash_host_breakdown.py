"""Where the host time of one flash_triton forward and backward call goes, without a profiler's distortion: each
stage below is wrapped in a perf_counter pair (inclusive times, about 0.3 us of wrapper each) and the launcher
functions called directly, many times, at the 2.7B model's attention shape (4 x 32 heads x 512 x d 80, causal bf16,
q/k/v strided views of one qkv tensor as in the model).

    PYTHONPATH=. python benchmarks/scripts/flash_host_breakdown.py [--shape B H N D] [--calls 400]

It first times the unwrapped calls with launch plans off (``LMTRAIN_FLASH_LAUNCH_PLANS=0``), replayed through Triton's
Python launcher (``python``) and replayed through its C launch function (``1``, the default), twice each, then the
wrapped ones with plans on and then off.
"""
import argparse
import functools
import os
import time
from collections import defaultdict

import torch
import triton
import triton.runtime.jit as jit

import lmtrain.kernels._flash_shared as shared
import lmtrain.kernels._launch_plans as plans
import lmtrain.kernels.flash_gluon_hopper as gl
import lmtrain.kernels.flash_triton as ft
import lmtrain.kernels.flash_triton_hopper as hop

TOTALS: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter() - t0
            COUNTS[name] += 1
    return wrapper


def patch(owner, attr, name):
    setattr(owner, attr, timed(name, getattr(owner, attr)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", nargs=4, type=int, default=[4, 32, 512, 80])
    p.add_argument("--calls", type=int, default=400)
    a = p.parse_args()
    b, h, n, d = a.shape
    qkv = torch.randn(b, n, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, d) strided views, as in the model
    q, k = q.mul(1), k.mul(1)  # as the rotary embedding leaves them: dense, in the views' order
    do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    o, lse = ft._forward(q, k, v, True)
    ft._backward(do, q, k, v, o, lse, True)
    torch.cuda.synchronize()

    def loop(label):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            ft._forward(q, k, v, True)
        t1 = time.perf_counter()
        for _ in range(a.calls):
            ft._backward(do, q, k, v, o, lse, True)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"{label}: forward {1e6 * (t1 - t0) / a.calls:.0f} us, backward {1e6 * (t2 - t1) / a.calls:.0f} us "
              "per call issued")
        return t1 - t0, t2 - t1

    for setting in ("0", "python", "1") * 2:
        os.environ["LMTRAIN_FLASH_LAUNCH_PLANS"] = setting
        ft._forward(q, k, v, True)  # records the plans of this setting
        ft._backward(do, q, k, v, o, lse, True)
        loop(f"LMTRAIN_FLASH_LAUNCH_PLANS={setting}")
    patch(ft, "_check_inputs", "_check_inputs")
    patch(hop, "usable", "tma usable")
    patch(gl, "kernels", "gluon kernels")
    patch(gl, "usable", "gluon usable")
    patch(hop, "_descs", "TensorDescriptor building")
    patch(shared, "_launch", "_launch (all)")
    for mod in (ft, hop):
        mod._launch = shared._launch
    patch(plans, "launch_compiled", "launch_compiled")
    gl.launch_compiled = plans.launch_compiled
    patch(plans.Plan, "run", "Plan.run (replays)")
    patch(plans, "key", "plan key")
    patch(jit.JITFunction, "run", "JITFunction.run")
    drv = triton.runtime.driver.active
    patch(drv, "get_current_stream", "get_current_stream")
    import triton.backends.nvidia.driver as nvd
    patch(nvd, "make_tensordesc_arg", "make_tensordesc_arg")
    patch(drv.utils, "fill_tma_descriptor", "fill_tma_descriptor (C)")
    patch(nvd.CudaLauncher, "__call__", "CudaLauncher.__call__")
    patch(torch, "empty", "torch.empty")
    patch(ft, "_as_4d", "_as_4d")
    patch(ft, "_forward", "_forward (all)")
    patch(ft, "_backward", "_backward (all)")
    for setting in ("1", "0"):
        os.environ["LMTRAIN_FLASH_LAUNCH_PLANS"] = setting
        TOTALS.clear()
        COUNTS.clear()
        loop(f"wrapped, LMTRAIN_FLASH_LAUNCH_PLANS={setting}")
        print()
        print("| stage | us per forward+backward pair | calls per pair |")
        print("| --- | ---: | ---: |")
        for name, total in sorted(TOTALS.items(), key=lambda kv: -kv[1]):
            print(f"| {name} | {1e6 * total / a.calls:.1f} | {COUNTS[name] / a.calls:.1f} |")
        print()


if __name__ == "__main__":
    main()
