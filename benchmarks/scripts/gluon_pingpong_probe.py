"""Consumers taking turns (``Config.pingpong``) in the Gluon kernels (run on the GPU machine): correctness of
configurations with turns through ``flash_triton``'s entry points (float64 reference on odd shapes, NaN-poisoned
outputs, determinism), then each kernel alone with and without turns, executed TFLOP/s (forward 2 products per tile
pair, dQ 3, dK/dV 4), beside SDPA's cuDNN forward and backward on the same inputs (bf16, causal, 16 heads;
B*H*N = 2^21, and the leaderboard's 1 x 16 x 16384 at head dim 64 with ``--leaderboard``).

    PYTHONPATH=. python benchmarks/scripts/gluon_pingpong_probe.py [--head-dims 64 128]
        [--seq-lens 1024 4096 16384] [--leaderboard] [--no-check]

Launches take the library's grid (persistent pairs where ``_persistent_programs`` allows, else one program per
tile). Rows are labelled with all seven ``Config`` fields; the last is ``pingpong``. The last table sums each path in
ms: forward, backward (dQ + dK/dV kernels, or cuDNN's backward) and both, the Gluon rows without and with turns
(each kernel's fastest configuration), and their ratios to cuDNN (above 1: Gluon faster).
"""
import argparse
import dataclasses
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from lmtrain.kernels import flash_gluon_hopper as fg

sys.path.insert(0, os.path.dirname(__file__))
from gluon_probe import _median_ms, check, poisoned, print_table, tflops  # noqa: E402

ENV = ("LMTRAIN_FLASH_GLUON_FWD", "LMTRAIN_FLASH_GLUON_DQ", "LMTRAIN_FLASH_GLUON_DKDV")
# Further configurations timed beside each cell's default, with and without turns.
EXTRA = {64: {fg.FWD: ["3,128,2,1,0,2", "2,128,3,1,0,2"], fg.DQ: ["2,128,3,1,0,2", "3,64,3,1,0,2"],
              fg.DKDV: ["3,32,3,1,1,0"]},
         128: {fg.FWD: ["3,64,3,1,0,2", "2,128,2,1,0,2"], fg.DQ: [], fg.DKDV: ["2,32,2,1,0,2"]}}


def label(cfg: fg.Config) -> str:
    return ",".join(map(str, dataclasses.astuple(cfg)))


def candidates(kernel: int, d: int, n: int) -> list[fg.Config]:
    """The cell's default configuration and the extras, each without and with turns, once each."""
    out = []
    for base in [fg.config(kernel, d, n)] + [fg.Config.parse(c) for c in EXTRA[d][kernel]]:
        for pp in (0, 1):
            cfg = dataclasses.replace(base, pingpong=pp)
            if cfg not in out:
                out.append(cfg)
    return out


def cell(b: int, h: int, n: int, d: int):
    """({row: ms}, {row: executed TFLOP/s}) of one shape."""
    q, k, v, do, o, lse, dq, dk, dv, delta = poisoned(b, h, n, d)
    ms, tf = {}, {}
    for kernel, name, factor, launch in (
            (fg.FWD, "fwd", 1.0, lambda c: fg.forward_args(q, k, v, o, lse, True, c)),
            (fg.DQ, "dq", 1.5, lambda c: fg.dq_args(q, k, v, o, do, dq, lse, delta, True, c)),
            (fg.DKDV, "dkdv", 2.0, lambda c: fg.dkdv_args(q, k, v, do, dk, dv, lse, delta, True, c))):
        kern = {fg.FWD: fg._fwd_kernel, fg.DQ: fg._dq_kernel, fg.DKDV: fg._dkdv_kernel}[kernel]
        default = fg.config(kernel, d, n)
        for cfg in candidates(kernel, d, n):
            row = f"{name} {label(cfg)}" + (" (default)" if cfg == default else "")
            ms[row] = _median_ms(kern, launch(cfg))
            tf[row] = tflops(ms[row], b, h, n, d, factor)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ms["cudnn fwd"] = do_bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True),
                                   return_mode="median")
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        ms["cudnn bwd"] = do_bench(lambda: torch.autograd.grad(out, (qs, ks, vs), do, retain_graph=True),
                                   return_mode="median")
    tf["cudnn fwd"] = tflops(ms["cudnn fwd"], b, h, n, d)
    tf["cudnn bwd (useful)"] = tflops(ms["cudnn bwd"], b, h, n, d, 2.5)
    return ms, tf


def sums(ms: dict) -> dict:
    """Per path: forward, backward and forward+backward ms; the Gluon rows take each kernel's fastest configuration
    without turns and with."""
    out = {}
    for pp in (0, 1):
        best = {}
        for kernel in ("fwd", "dq", "dkdv"):
            rows = [r for r in ms if r.startswith(kernel + " ") and r.split()[1].endswith(f",{pp}")]
            best[kernel] = min(ms[r] for r in rows)
        tag = "with turns" if pp else "without turns"
        out[f"gluon fwd, {tag}"] = best["fwd"]
        out[f"gluon bwd, {tag}"] = best["dq"] + best["dkdv"]
        out[f"gluon f+b, {tag}"] = best["fwd"] + best["dq"] + best["dkdv"]
    out["cudnn fwd"], out["cudnn bwd"] = ms["cudnn fwd"], ms["cudnn bwd"]
    out["cudnn f+b"] = ms["cudnn fwd"] + ms["cudnn bwd"]
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    p.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 4096, 16384])
    p.add_argument("--leaderboard", action="store_true", help="also 1 x 16 heads x 16384 at head dim 64")
    p.add_argument("--no-check", action="store_true")
    a = p.parse_args()
    t0 = time.time()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if not a.no_check:
        ok = True
        for d in a.head_dims:
            for n in (1024, 16384):
                for var in ENV:  # the previous check's overrides would be read as the defaults
                    os.environ.pop(var, None)
                cfgs = [label(dataclasses.replace(fg.config(kernel, d, n), pingpong=1))
                        for kernel in (fg.FWD, fg.DQ, fg.DKDV)]
                ok &= check({d: dict(zip(ENV, cfgs, strict=True))})
        print("CHECK", "PASSED" if ok else "FAILED", f"{time.time() - t0:.0f}s", flush=True)
        for var in ENV:
            os.environ.pop(var, None)
        if not ok:
            sys.exit(1)
    os.environ["LMTRAIN_FLASH_GLUON"] = "1"
    shapes = [(2**21 // (16 * n), 16, n, d) for d in a.head_dims for n in a.seq_lens]
    if a.leaderboard:
        shapes.append((1, 16, 16384, 64))
    results = []
    for b, h, n, d in shapes:
        ms, tf = cell(b, h, n, d)
        results.append((f"{b}x{h}x{n} d{d}", ms, tf))
        print(f"{b}x{h}x{n} d{d}", {r: round(x) for r, x in tf.items()}, f"{time.time() - t0:.0f}s", flush=True)
    for d in a.head_dims:
        rows = [(col, tf) for col, _, tf in results if col.endswith(f"d{d}")]
        print_table(f"d {d}: executed TFLOP/s", rows)
    print("\n| ms | " + " | ".join(col for col, _, _ in results) + " |")
    print("| --- |" + " ---: |" * len(results))
    table = [sums(ms) for _, ms, _ in results]
    for row in table[0]:
        print(f"| {row} | " + " | ".join(f"{t[row]:.3f}" for t in table) + " |")
    for what in ("fwd", "f+b"):
        for tag in ("without turns", "with turns"):
            print(f"| cudnn / gluon {what}, {tag} | "
                  + " | ".join(f"{t[f'cudnn {what}'] / t[f'gluon {what}, {tag}']:.3f}" for t in table) + " |")


if __name__ == "__main__":
    main()
