"""The fused backward with TMA reductions (``flash_gluon_hopper.backward_atomic``, ``LMTRAIN_FLASH_GLUON_FUSED=2``)
on the GPU: correctness through ``flash_triton``'s backward against float64 (odd shapes, N_q != N_k, strided heads,
fp16 and bf16, causal and not, NaN-poisoned buffers, repeats within the tolerance), then causal bf16, 16 heads,
B*H*N = 2^21, for each head dim and sequence length, interleaved ``--rounds`` times:

* the backward through ``flash_triton._backward``: the dQ and dK/dV kernels (default) against the fused kernel, for
  each ``--configs`` configuration of the fused kernel (``LMTRAIN_FLASH_GLUON_DKDV``; ``default`` the table's);
* forward+backward through ``FlashAttentionTriton`` both ways against SDPA's cuDNN backend.

    PYTHONPATH=. python benchmarks/scripts/gluon_atomic_probe.py [--head-dims 64] [--seq-lens 1024 4096 16384] \
        [--configs default 2,64,2,1,1] [--rounds 2] [--no-check]
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
from gluon_probe import fwd_bwd_ms, inputs, make, print_backward_table, reference, rel  # noqa: E402

SHAPES = [(1, 2, 97, 97, False), (2, 3, 1025, 1025, False), (1, 2, 257, 333, False), (1, 2, 333, 257, False),
          (1, 1, 30, 30, False), (2, 2, 1025, 1025, True), (1, 1, 200, 1000, False), (1, 1, 1000, 200, False),
          (1, 2, 1028, 1028, False), (1, 4, 8192, 8192, False)]


def use(fused: int, cfg: str = "default") -> None:
    os.environ["LMTRAIN_FLASH_GLUON_FUSED"] = str(fused)
    if cfg == "default":
        os.environ.pop("LMTRAIN_FLASH_GLUON_DKDV", None)
    else:
        os.environ["LMTRAIN_FLASH_GLUON_DKDV"] = cfg


def check(head_dims, configs) -> bool:
    ok = True
    for d in head_dims:
        for cfg in configs:
            use(2, cfg)
            for z, h, n_q, n_k, strided in SHAPES:
                for dtype in (torch.bfloat16, torch.float16):
                    for causal in (True, False):
                        q, k, v = make(z, h, n_q, n_k, d, dtype, strided, n_q * 7 + n_k + d)
                        do = torch.randn(q.shape, device="cuda", dtype=dtype)
                        o = torch.empty(q.shape, device="cuda", dtype=dtype)
                        lse = torch.empty(q.shape[:-1], device="cuda")
                        ft._forward(q, k, v, causal, o=o, lse=lse)
                        bufs = [torch.full(t.shape, float("nan"), device="cuda", dtype=dtype) for t in (q, k, v)]
                        grads = ft._backward(do, q, k, v, o, lse, causal, dq=bufs[0], dk=bufs[1], dv=bufs[2])
                        again = ft._backward(do, q, k, v, o, lse, causal)
                        _, _, rdq, rdk, rdv = reference(q, k, v, causal, do)
                        errs = [rel(g, r) for g, r in zip(grads, (rdq, rdk, rdv), strict=True)]
                        errs_again = [rel(g, r) for g, r in zip(again, (rdq, rdk, rdv), strict=True)]
                        limit = 1e-2 if dtype == torch.bfloat16 else 2e-3
                        bad = not all(e < limit for e in errs + errs_again) \
                            or any(g.isnan().any().item() for g in grads)
                        ok &= not bad
                        print(f"check {cfg} {(z, h, n_q, n_k, d)}{' strided' if strided else ''} {str(dtype)[6:]} "
                              f"causal={causal}: dq {errs[0]:.1e} dk {errs[1]:.1e} dv {errs[2]:.1e} "
                              f"(again dq {errs_again[0]:.1e}) {'FAIL' if bad else 'ok'}", flush=True)
    return ok


def cell(d, n, configs, rounds):
    b, h, q, k, v, do = inputs(d, n)
    o = torch.empty_like(q)
    lse = torch.empty(b, h, n, device="cuda")
    ft._forward(q, k, v, True, o=o, lse=lse)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    variants = [("two kernels", 0, "default")] + [(f"fused {cfg}", 2, cfg) for cfg in configs]
    res = {}
    for _ in range(rounds):
        for name, fused, cfg in variants:
            use(fused, cfg)
            ms = do_bench(lambda: ft._backward(do, q, k, v, o, lse, True), return_mode="median")
            res.setdefault(f"bwd {name}", []).append(ms)
        for name, fused, cfg in variants[:2] + [("cuDNN", None, "default")]:
            use(fused or 0, cfg)
            res.setdefault(f"f+b {name}", []).append(fwd_bwd_ms(leaves, do, fused is None))
    use(0)
    best = {key: min(v) for key, v in res.items()}
    print(f"d {d} N {n}: " + "; ".join(f"{key} {'/'.join(f'{x:.3f}' for x in v)}" for key, v in res.items()),
          flush=True)
    return best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--head-dims", nargs="+", type=int, default=[64])
    p.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 4096, 16384])
    p.add_argument("--configs", nargs="+", default=["default"])
    p.add_argument("--check-configs", nargs="+", default=["default"])
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    t0 = time.time()
    if not a.no_check:
        ok = check(a.head_dims, a.check_configs)
        print("CHECK", "PASSED" if ok else "FAILED", f"{time.time() - t0:.0f}s", flush=True)
        if not ok:
            sys.exit(1)
    rows = [((d, n), cell(d, n, a.configs, a.rounds)) for d in a.head_dims for n in a.seq_lens]
    print_backward_table(rows, a.rounds, list(rows[0][1])[1][4:])


if __name__ == "__main__":
    main()
