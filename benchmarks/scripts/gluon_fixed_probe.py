"""The fused backward with integer dQ sums (``flash_gluon_hopper.backward_atomic``) on the GPU: correctness through
``flash_triton``'s backward against float64 (odd shapes, N_q != N_k, strided heads, fp16 and bf16, causal and not,
NaN-poisoned buffers), the same bits over repeated calls, inputs of large and small magnitude, a row of dO far
smaller than the others, a row of dO NaN; then causal bf16, 16 heads, B*H*N = 2^21, interleaved ``--rounds`` times:
the backward alone (the dQ and dK/dV kernels, the fused kernel, and with ``--baseline`` another version of the
module's fused kernel called directly, for example the one with fp32 sums), forward+backward through
``FlashAttentionTriton`` both ways against SDPA's cuDNN backend.

It needs ``2026-11-27-fixed-point-sums.patch`` applied (``patch -p1``), which is not in the library (see
benchmarks/2026-11-27-H100-flash-gluon-fixed-point.md).

    git show COMMIT:lmtrain/kernels/flash_gluon_hopper.py > old.py
    PYTHONPATH=. python benchmarks/scripts/gluon_fixed_probe.py [--baseline old.py] [--head-dims 64 128] \
        [--seq-lens 4096 16384] [--rounds 2] [--no-check]
"""
import argparse
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench

from lmtrain.kernels import flash_triton as ft

sys.path.insert(0, os.path.dirname(__file__))
from gluon_probe import fwd_bwd_ms, load, make, prepared, print_backward_table, reference, rel  # noqa: E402

SHAPES = [(1, 2, 97, 97, False), (2, 3, 1025, 1025, False), (1, 2, 257, 333, False), (2, 2, 1028, 1028, True),
          (1, 1, 1000, 4100, False)]


def use(fused: int) -> None:
    os.environ["LMTRAIN_FLASH_GLUON_FUSED"] = str(fused)


def grads(q, k, v, do, causal, repeats=3):
    """(dQ, dK, dV into NaN-poisoned buffers, whether ``repeats`` more calls gave the same bits)."""
    o = torch.empty(q.shape, device="cuda", dtype=q.dtype)
    lse = torch.empty(q.shape[:-1], device="cuda")
    ft._forward(q, k, v, causal, o=o, lse=lse)
    bufs = [torch.full(t.shape, float("nan"), device="cuda", dtype=q.dtype) for t in (q, k, v)]
    first = ft._backward(do, q, k, v, o, lse, causal, dq=bufs[0], dk=bufs[1], dv=bufs[2])
    same = all(all(torch.equal(a, b) for a, b in zip(first, ft._backward(do, q, k, v, o, lse, causal), strict=True))
               for _ in range(repeats))
    return first, same


QUICK = [(2, 3, 1025, 1025, False, torch.bfloat16, True), (1, 1, 1000, 4100, False, torch.float16, False),
         (2, 2, 1028, 1028, True, torch.float16, True), (1, 2, 4096, 4096, False, torch.bfloat16, False)]


def check(head_dims, quick=False) -> bool:
    use(2)
    ok = True
    cases = QUICK if quick else [(*shape, dtype, causal) for shape in SHAPES
                                 for dtype in (torch.bfloat16, torch.float16) for causal in (True, False)]
    for d in head_dims:
        for z, h, n_q, n_k, strided, dtype, causal in cases:
            q, k, v = make(z, h, n_q, n_k, d, dtype, strided, n_q * 7 + n_k + d)
            do = torch.randn(q.shape, device="cuda", dtype=dtype)
            g, same = grads(q, k, v, do, causal)
            errs = [rel(x, r) for x, r in zip(g, reference(q, k, v, causal, do)[2:], strict=True)]
            limit = 1e-2 if dtype == torch.bfloat16 else 2e-3
            bad = not all(e < limit for e in errs) or not same or any(x.isnan().any().item() for x in g)
            ok &= not bad
            print(f"check {(z, h, n_q, n_k, d)}{' strided' if strided else ''} {str(dtype)[6:]} "
                  f"causal={causal}: dq {errs[0]:.1e} dk {errs[1]:.1e} dv {errs[2]:.1e} same={same} "
                  f"{'FAIL' if bad else 'ok'}", flush=True)
        # Magnitudes: (q, k, v, dO) scales; one dO row is 1e-5 of the others, its dQ checked on its own and against
        # the dQ and dK/dV kernels' (with large scores, where most of P is in one key, a row's dQ is mostly what the
        # 16-bit rounding of dS leaves, in both).
        for scales in ((1, 1, 1, 1e-6), (3, 30, 1, 1)) if quick else ((1, 1, 1, 1e-6), (3, 30, 1, 1), (1, 1, 1e3, 1e3),
                                                                    (1e-2, 1e-2, 1e-2, 1)):
            q, k, v = make(2, 4, 2048, 2048, d, torch.bfloat16, False, d + 11)
            q, k, v = (t * s for t, s in zip((q, k, v), scales[:3], strict=True))
            do = torch.randn(q.shape, device="cuda", dtype=q.dtype) * scales[3]
            do[0, 1, 700] *= 1e-5
            g, same = grads(q, k, v, do, True)
            use(0)
            two, _ = grads(q, k, v, do, True, repeats=0)
            use(2)
            ref = reference(q, k, v, True, do)[2:]
            errs = [rel(x, r) for x, r in zip(g, ref, strict=True)]
            two_errs = [rel(x, r) for x, r in zip(two, ref, strict=True)]
            row, two_row = rel(g[0][0, 1, 700], ref[0][0, 1, 700]), rel(two[0][0, 1, 700], ref[0][0, 1, 700])
            bad = not all(e < max(1e-2, 1.2 * t) for e, t in zip(errs + [row], two_errs + [two_row], strict=True)) \
                or not same
            ok &= not bad
            print(f"check d {d} scales {scales}: dq {errs[0]:.1e} dk {errs[1]:.1e} dv {errs[2]:.1e} small row dq "
                  f"{row:.1e}; two kernels dq {two_errs[0]:.1e} small row {two_row:.1e}; same={same} "
                  f"{'FAIL' if bad else 'ok'}", flush=True)
        q, k, v = make(1, 2, 1024, 1024, d, torch.bfloat16, False, 5)
        do = torch.randn(q.shape, device="cuda", dtype=q.dtype)
        do[0, 1, 500] = float("nan")
        (dq, _, _), _ = grads(q, k, v, do, True, repeats=0)
        nan_row = dq[0, 1, 500].isnan().all().item()
        ok &= nan_row
        print(f"check d {d} NaN in a row of dO: that row of dQ NaN {nan_row}", flush=True)
    use(0)
    return ok


def cell(d, n, rounds, base):
    _, _, q, k, v, do, o, lse, dq, dk, dv, delta = prepared(d, n)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    res = {}

    def bwd(fused):
        use(fused)
        return do_bench(lambda: ft._backward(do, q, k, v, o, lse, True), return_mode="median")

    if base:
        acc = torch.empty(q.shape, device="cuda")

        def old():
            return do_bench(lambda: base.backward_atomic(q, k, v, o, do, dq, dk, dv, lse, delta, acc, True),
                            return_mode="median")
    for _ in range(rounds):
        res.setdefault("bwd two kernels", []).append(bwd(0))
        res.setdefault("bwd fused", []).append(bwd(2))
        if base:
            res.setdefault("bwd baseline", []).append(old())
        for name, fused in (("two kernels", 0), ("fused", 2), ("cuDNN", None)):
            use(fused or 0)
            res.setdefault(f"f+b {name}", []).append(fwd_bwd_ms(leaves, do, fused is None))
    use(0)
    print(f"d {d} N {n}: " + "; ".join(f"{key} {'/'.join(f'{x:.3f}' for x in v)}" for key, v in res.items()),
          flush=True)
    return {key: min(v) for key, v in res.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--quick", action="store_true", help="four cases per head dim and two scalings in the check")
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    p.add_argument("--seq-lens", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--baseline", help="another version of flash_gluon_hopper.py whose backward_atomic to time")
    a = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    t0 = time.time()
    if not a.no_check:
        ok = check(a.head_dims, a.quick)
        print("CHECK", "PASSED" if ok else "FAILED", f"{time.time() - t0:.0f}s", flush=True)
    base = load(a.baseline) if a.baseline else None
    rows = [((d, n), cell(d, n, a.rounds, base)) for d in a.head_dims for n in a.seq_lens]
    print_backward_table(rows, a.rounds, "fused")


if __name__ == "__main__":
    main()
