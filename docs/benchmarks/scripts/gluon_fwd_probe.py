"""Gluon forward on the GPU: correctness against float64 on odd shapes, then forward TFLOP/s per configuration
against SDPA's cuDNN backend and the tl TMA kernel, bf16 causal, 16 heads, B*H*N = 2^21.

    PYTHONPATH=. python docs/benchmarks/scripts/gluon_fwd_probe.py [--check-only] [--configs 2,128,2 ...]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from lmtrain.kernels import flash_gluon_hopper as fg
from lmtrain.kernels import flash_triton as ft


def reference(q, k, v, causal):
    q64, k64, v64 = (t.double() for t in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        s = s.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v64, lse


def check(cfgs) -> bool:
    ok = True
    shapes = [((1, 2, 97, 97), 64), ((2, 3, 1025, 1025), 128), ((1, 2, 257, 333), 64), ((1, 2, 333, 257), 128),
              ((2, 2, 1025, 1025), 64), ((1, 1, 30, 30), 128), ((1, 2, 4096, 4096), 128), ((1, 1, 200, 1000), 64)]
    for cfg in cfgs:
        for (z, h, n_q, n_k), d in shapes:
            for dtype in (torch.bfloat16, torch.float16):
                for causal in (True, False):
                    g = torch.Generator(device="cuda").manual_seed(n_q * 7 + d)
                    q = torch.randn(z, h, n_q, d, device="cuda", dtype=dtype, generator=g)
                    k = torch.randn(z, h, n_k, d, device="cuda", dtype=dtype, generator=g)
                    v = torch.randn(z, h, n_k, d, device="cuda", dtype=dtype, generator=g)
                    o = torch.full_like(q, float("nan"))
                    lse = torch.full((z, h, n_q), float("nan"), device="cuda")
                    fg.forward(q, k, v, o, lse, causal, cfg)
                    torch.cuda.synchronize()
                    ref, ref_lse = reference(q, k, v, causal)
                    err = ((o.double() - ref).norm() / ref.norm()).item()
                    lerr = (lse.double() - ref_lse).abs().max().item()
                    bad = not (err < 1e-2) or not (lerr < 1e-3) or o.isnan().any().item()
                    ok &= not bad
                    if bad or (causal and dtype == torch.bfloat16):
                        print(f"check {cfg} {(z, h, n_q, n_k, d)} {dtype} causal={causal}: rel {err:.2e} "
                              f"lse {lerr:.1e} {'FAIL' if bad else 'ok'}", flush=True)
    return ok


def tflops(ms, b, h, n, d):
    return 4 * b * h * n * n * d / 2 / ms * 1e-9


def bench(cfgs, head_dims, seq_lens):
    rows = []
    for d in head_dims:
        for n in seq_lens:
            b, h = 2**21 // (16 * n), 16
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            o = torch.empty_like(q)
            lse = torch.empty(b, h, n, device="cuda")
            res = {}
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                res["cudnn"] = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                        return_mode="median")
            os.environ["LMTRAIN_FLASH_GLUON"] = "0"
            res["tl_tma"] = do_bench(lambda: ft._forward(q, k, v, True, o=o, lse=lse), return_mode="median")
            os.environ["LMTRAIN_FLASH_GLUON"] = "1"
            for cfg in cfgs:
                if cfg.smem_bytes(d) > 220 * 1024:
                    continue
                try:
                    res[repr(cfg)] = do_bench(lambda: fg.forward(q, k, v, o, lse, True, cfg), return_mode="median")
                except Exception as e:  # noqa: BLE001
                    print(f"{cfg} d{d}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            line = " ".join(f"{name}={tflops(ms, b, h, n, d):.0f}" for name, ms in res.items())
            print(f"d={d} N={n}: {line}", flush=True)
            rows.append((d, n, res))
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--configs", nargs="+", default=["2,128,2", "2,128,3", "3,128,2", "2,64,3", "3,64,3"])
    p.add_argument("--check-configs", nargs="+", default=["2,128,2", "3,64,2"])
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    p.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 4096, 16384])
    a = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    ok = check([fg.FwdConfig(*map(int, c.split(","))) for c in a.check_configs])
    print("CHECK", "PASSED" if ok else "FAILED", flush=True)
    if a.check_only or not ok:
        sys.exit(0 if ok else 1)
    bench([fg.FwdConfig(*map(int, c.split(","))) for c in a.configs], a.head_dims, a.seq_lens)


if __name__ == "__main__":
    main()
