"""Each launch of the fused backward with exact integer sums alone on the GPU (bf16, causal, 16 heads,
B*H*N = 2^21), with the patch ``2026-11-27-fixed-point-sums.patch`` applied: the K/V maxima, D with the rows'
exponents and zeroed sums, the fused kernel, the conversion to dQ, and the whole backward; beside them the same
launches of another version of the module (its sums added in any order), loaded from a file. ``do_bench`` medians,
fastest of two rounds, ms.

    git show COMMIT:lmtrain/kernels/flash_gluon_hopper.py > old.py
    PYTHONPATH=. python docs/benchmarks/scripts/gluon_fixed_kernels_probe.py old.py
"""
import functools
import os
import sys

import torch
import triton
from triton.testing import do_bench

from lmtrain.kernels import flash_gluon_hopper as fg
from lmtrain.kernels import flash_triton as ft
from lmtrain.kernels._launch_plans import launch_compiled

sys.path.insert(0, os.path.dirname(__file__))
from gluon_probe import inputs, load  # noqa: E402


def ms(fn) -> float:
    return do_bench(fn, return_mode="median")


def cell(old, d, n) -> dict:
    b, h, q, k, v, do = inputs(d, n)
    o = torch.empty_like(q)
    lse = torch.empty(b, h, n, device="cuda")
    ft._forward(q, k, v, True, o=o, lse=lse)
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    delta = torch.empty(b * h, n, device="cuda")
    acc, row_exp, bound = fg.sums(q)
    old_acc = torch.empty(q.shape, device="cuda")
    fg.bind_context(q.device)
    launches = {
        "K/V maxima": (fg._kv_bound_kernel, ((triton.cdiv(n, fg._BOUND_BLOCK), b * h),
                                             (k, v, *k.stride()[:3], *v.stride()[:3], h, n, bound),
                                             dict(HEAD_DIM=d, BLOCK=fg._BOUND_BLOCK, num_warps=4))),
        "D, x, zeros": (fg._delta_kernel, fg.delta_args(o, do, delta, acc, row_exp, bound)),
        "fused": (fg._bwd_atomic_kernel, fg.bwd_atomic_args(q, k, v, do, dk, dv, acc, row_exp, lse, delta, True)),
        "convert": (fg._dq_convert_kernel, ((triton.cdiv(n, 64), b * h),
                                            (acc, dq, *dq.stride()[:3], h, n, d**-0.5, row_exp),
                                            dict(HEAD_DIM=d, BLOCK=64, num_warps=4))),
        "old D, zeros": (old._delta_kernel, old.delta_args(o, do, delta, old_acc)),
        "old fused": (old._bwd_atomic_kernel, old.bwd_atomic_args(q, k, v, do, dk, dv, old_acc, lse, delta, True)),
    }
    calls = {name: functools.partial(launch_compiled, kernel, *launch) for name, (kernel, launch) in launches.items()}
    calls["total"] = functools.partial(fg.backward_atomic, q, k, v, o, do, dq, dk, dv, lse, delta, acc, row_exp,
                                       bound, True)
    calls["old total"] = functools.partial(old.backward_atomic, q, k, v, o, do, dq, dk, dv, lse, delta, old_acc,
                                           True)
    res = {}
    for _ in range(2):
        for name, call in calls.items():
            res.setdefault(name, []).append(ms(call))
    return {name: min(v) for name, v in res.items()}


def main():
    old = load(sys.argv[1])
    print(torch.cuda.get_device_name(), flush=True)
    for d, n in ((64, 4096), (64, 16384), (128, 16384)):
        best = cell(old, d, n)
        print(f"d {d} N {n}: " + "; ".join(f"{key} {v:.3f}" for key, v in best.items()), flush=True)


if __name__ == "__main__":
    main()
