"""The fused backward (``flash_gluon_hopper.backward``, ``LMTRAIN_FLASH_GLUON_FUSED=1``) on the GPU: correctness
through ``flash_triton``'s backward against float64 (odd shapes, N_q != N_k, strided heads, fp16 and bf16,
NaN-poisoned buffers, three repeats bit for bit), then head dim 64, causal bf16, B*H*N = 2^21:

* the backward through ``flash_triton._backward`` (dQ and dK/dV kernels, the library's default, against fused);
* the kernels alone: the default dK/dV and dQ kernels, and the fused kernel with the ablations of ``_bwd_kernel``
  (``ABLATE`` 1-4: wrong results, timing only) and in full;
* forward+backward TFLOP/s through ``FlashAttentionTriton`` against SDPA's cuDNN backend, and the leaderboard problem
  (``flash_leaderboard.py``) both ways.

    PYTHONPATH=. python benchmarks/scripts/gluon_fused_probe.py [--seq-lens 1024 4096 16384] [--no-check]
"""
import argparse
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench

from lmtrain.kernels import flash_gluon_hopper as fg
from lmtrain.kernels import flash_triton as ft
from lmtrain.kernels.flash_triton import _as_4d

sys.path.insert(0, os.path.dirname(__file__))
from gluon_probe import fwd_bwd_ms, make, prepared, reference, rel, tflops, tl_constants  # noqa: E402

SHAPES = [(1, 2, 97, 97, False), (2, 3, 1025, 1025, False), (1, 2, 257, 333, False), (1, 2, 333, 257, False),
          (1, 1, 30, 30, False), (2, 2, 1025, 1025, True), (1, 1, 200, 1000, False), (1, 1, 1000, 200, False),
          (1, 4, 8192, 8192, False)]
ABLATIONS = {1: "dQ product only", 2: "+ partials handed over", 3: "+ reducer sums in shared memory",
             4: "+ global sums, no flag waits"}


def use(fused: bool) -> None:
    os.environ["LMTRAIN_FLASH_GLUON_FUSED"] = "1" if fused else "0"


def check() -> bool:
    ok = True
    use(True)
    for z, h, n_q, n_k, strided in SHAPES:
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v = make(z, h, n_q, n_k, 64, dtype, strided, n_q * 7 + n_k)
            do = torch.randn(q.shape, device="cuda", dtype=dtype)
            assert fg.fused(fg.kernels(*(_as_4d(t) for t in (q, k, v))), _as_4d(q), _as_4d(k), True)
            o = torch.empty(q.shape, device="cuda", dtype=dtype)
            lse = torch.empty(q.shape[:-1], device="cuda")
            ft._forward(q, k, v, True, o=o, lse=lse)
            bufs = [torch.full(t.shape, float("nan"), device="cuda", dtype=dtype) for t in (q, k, v)]
            grads = ft._backward(do, q, k, v, o, lse, True, dq=bufs[0], dk=bufs[1], dv=bufs[2])
            repeats = [ft._backward(do, q, k, v, o, lse, True) for _ in range(3)]
            _, _, rdq, rdk, rdv = reference(q, k, v, True, do)
            errs = [rel(g, r) for g, r in zip(grads, (rdq, rdk, rdv), strict=True)]
            det = all(torch.equal(a, b) for r in repeats for a, b in zip(grads, r, strict=True))
            limit = 1e-2 if dtype == torch.bfloat16 else 2e-3
            bad = not det or not all(e < limit for e in errs) or any(g.isnan().any().item() for g in grads)
            ok &= not bad
            print(f"check {(z, h, n_q, n_k)}{' strided' if strided else ''} {str(dtype)[6:]}: dq {errs[0]:.1e} "
                  f"dk {errs[1]:.1e} dv {errs[2]:.1e} det={det} {'FAIL' if bad else 'ok'}", flush=True)
    return ok


def fused_kernel(q, k, v, do, dq, dk, dv, lse, delta, ablate=0):
    """The fused kernel alone (flags zeroed before each launch, as ``backward`` allocates them)."""
    q4, k4, v4, do4, dq4, dk4, dv4 = (_as_4d(t) for t in (q, k, v, do, dq, dk, dv))
    z, h, n_q, d = q4.shape
    n_qb = triton.cdiv(n_q, 64)
    acc = torch.empty((z, h, n_qb * 64, d), device="cuda", dtype=torch.float32)
    flags = torch.zeros((z * h * n_qb,), device="cuda", dtype=torch.int32)
    grid, args, kwargs = fg.bwd_args(q4, k4, v4, do4, dq4, dk4, dv4, acc, flags, lse, delta, True)
    kwargs["ABLATE"] = ablate
    return lambda: (flags.zero_(), fg._bwd_kernel[grid](*args, **kwargs))


def cell(n):
    b, h, q, k, v, do, o, lse, dq, dk, dv, delta = prepared(64, n)
    q4, k4, v4, o4, do4, dq4, dk4, dv4 = (_as_4d(t) for t in (q, k, v, o, do, dq, dk, dv))
    res = {}
    for name, fused in (("backward, dQ + dK/dV kernels", False), ("backward, fused", True)):
        use(fused)
        res[name] = do_bench(lambda: ft._backward(do, q, k, v, o, lse, True), return_mode="median")
    res["dK/dV kernel alone"] = do_bench(lambda: fg.dkdv(q4, k4, v4, do4, dk4, dv4, lse, delta, True),
                                         return_mode="median")
    common, key = tl_constants(q)
    res["dQ kernel alone (tl)"] = do_bench(lambda: ft._hopper.dq(q4, k4, v4, o4, do4, lse, delta, dq4, common, key),
                                           return_mode="median")
    for ablate, what in ABLATIONS.items():
        res[f"fused kernel, ablation {ablate}: {what}"] = do_bench(
            fused_kernel(q, k, v, do, dq, dk, dv, lse, delta, ablate), return_mode="median")
    res["fused kernel"] = do_bench(fused_kernel(q, k, v, do, dq, dk, dv, lse, delta), return_mode="median")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    for name, fused in (("f+b TFLOP/s, two kernels", False), ("f+b TFLOP/s, fused", True),
                        ("f+b TFLOP/s, cuDNN", None)):
        use(bool(fused))
        res[name] = tflops(fwd_bwd_ms(leaves, do, fused is None), b, h, n, 64, 3.5)
    use(False)
    print(f"N {n}: " + "; ".join(f"{k_} {v_:.3f}" for k_, v_ in res.items()), flush=True)
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--no-leaderboard", action="store_true")
    p.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 4096, 16384])
    a = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    t0 = time.time()
    if not a.no_check:
        ok = check()
        print("CHECK", "PASSED" if ok else "FAILED", f"{time.time() - t0:.0f}s", flush=True)
        if not ok:
            sys.exit(1)
    use(False)
    rows = [(n, cell(n)) for n in a.seq_lens]
    board = {}
    if not a.no_leaderboard:
        import flash_leaderboard
        for fused in (False, True):
            use(fused)
            board[fused] = flash_leaderboard.leaderboard_ms("flash_triton")
        use(False)
        board["cudnn"] = flash_leaderboard.leaderboard_ms("sdpa_cudnn")
    print("\nhead dim 64, causal bf16, B*H*N = 2^21: ms (median), forward+backward TFLOP/s (3.5x forward FLOPs)")
    print("\n| | " + " | ".join(f"N {n}" for n, _ in rows) + " |\n| --- |" + " ---: |" * len(rows))
    for name in rows[0][1]:
        print(f"| {name} | " + " | ".join(f"{r[name]:.{0 if 'TFLOP' in name else 3}f}" for _, r in rows) + " |")
    if board:
        print(f"\nleaderboard (mean ms): two kernels {board[False]:.3f}, fused {board[True]:.3f}, "
              f"cuDNN {board['cudnn']:.3f}")


if __name__ == "__main__":
    main()
