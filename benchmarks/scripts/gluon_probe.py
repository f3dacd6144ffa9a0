"""The Gluon kernels on the GPU: correctness through ``flash_triton``'s entry points against float64 on odd shapes
(forward O and L, backward dQ/dK/dV into NaN-poisoned buffers, determinism), then per-kernel configuration sweeps and
forward / forward+backward TFLOP/s against SDPA's cuDNN backend (bf16, causal, 16 heads, B*H*N = 2^21).

    PYTHONPATH=. python benchmarks/scripts/gluon_probe.py [--check-only] [--no-sweep] [--leaderboard]
"""
import argparse
import contextlib
import functools
import importlib.util
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from lmtrain.kernels import flash_gluon_hopper as fg
from lmtrain.kernels import flash_triton as ft
from lmtrain.kernels.flash_triton import _as_4d


def reference(q, k, v, causal, do):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ v64
    o.backward(do.double())
    return o.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def make(z, h, n_q, n_k, d, dtype, fused, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if fused:  # heads of a fused qkv projection: strided (b, h, n, d) views
        assert n_q == n_k
        qkv = torch.randn(z, n_q, 3, h, d, device="cuda", dtype=dtype, generator=g)
        return qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)
    return (torch.randn(z, h, n, d, device="cuda", dtype=dtype, generator=g) for n in (n_q, n_k, n_k))


def check(overrides=None, setting="all") -> bool:
    """``overrides``: {head dim: {env var: configuration}} for the Gluon kernels (other head dims' shapes skipped);
    ``setting``: LMTRAIN_FLASH_GLUON for the run."""
    os.environ["LMTRAIN_FLASH_GLUON"] = setting
    ok = True
    shapes = [(1, 2, 97, 97, 64, False), (2, 3, 1025, 1025, 128, False), (1, 2, 257, 333, 64, False),
              (1, 2, 333, 257, 128, False), (1, 1, 30, 30, 128, False), (2, 2, 1025, 1025, 64, True),
              (1, 2, 2048, 2048, 128, True), (1, 1, 200, 1000, 64, False), (1, 1, 1000, 200, 128, False),
              (1, 2, 100, 100, 64, False), (2, 3, 1028, 1028, 128, False), (1, 2, 260, 332, 64, False),
              (2, 2, 1028, 1028, 64, True)]
    for z, h, n_q, n_k, d, fused in shapes:
        if overrides is not None and d not in overrides:
            continue
        for var in ("LMTRAIN_FLASH_GLUON_FWD", "LMTRAIN_FLASH_GLUON_DQ", "LMTRAIN_FLASH_GLUON_DKDV"):
            os.environ.pop(var, None)
        os.environ.update((overrides or {}).get(d, {}))
        for dtype in (torch.bfloat16, torch.float16):
            for causal in (True, False):
                q, k, v = make(z, h, n_q, n_k, d, dtype, fused, n_q * 131 + n_k + d)
                do = torch.randn(q.shape, device="cuda", dtype=dtype)
                if setting == "all":
                    assert all(fg.usable(_as_4d(q), _as_4d(k), _as_4d(v), kernel=m) for m in (fg.FWD, fg.DQ, fg.DKDV))
                o = torch.full(q.shape, float("nan"), device="cuda", dtype=dtype)
                lse = torch.full(q.shape[:-1], float("nan"), device="cuda")
                ft._forward(q, k, v, causal, o=o, lse=lse)
                bufs = [torch.full(t.shape, float("nan"), device="cuda", dtype=dtype) for t in (q, k, v)]
                dq, dk, dv = ft._backward(do, q, k, v, o, lse, causal, dq=bufs[0], dk=bufs[1], dv=bufs[2])
                again = ft._backward(do, q, k, v, o, lse, causal)
                torch.cuda.synchronize()
                ro, rl, rdq, rdk, rdv = reference(q, k, v, causal, do)
                errs = [rel(o, ro), (lse.double() - rl).abs().max().item(), rel(dq, rdq), rel(dk, rdk), rel(dv, rdv)]
                limit = 1e-2 if dtype == torch.bfloat16 else 2e-3
                det = all(torch.equal(a, b) for a, b in zip((dq, dk, dv), again, strict=True))
                bad = (not all(e < limit for e in errs) or any(t.isnan().any().item() for t in (o, lse, dq, dk, dv))
                       or not det)
                ok &= not bad
                cfgs = (os.environ.get("LMTRAIN_FLASH_GLUON_FWD"), os.environ.get("LMTRAIN_FLASH_GLUON_DQ"))
                print(f"check {setting} {cfgs} {(z, h, n_q, n_k, d)}{' fused' if fused else ''} {str(dtype)[6:]} "
                      f"causal={causal}: "
                      f"o {errs[0]:.1e} lse {errs[1]:.0e} dq {errs[2]:.1e} dk {errs[3]:.1e} dv {errs[4]:.1e} "
                      f"det={det} {'FAIL' if bad else 'ok'}", flush=True)
    return ok


def tflops(ms, b, h, n, d, factor=1.0):
    return factor * 4 * b * h * n * n * d / 2 / ms * 1e-9


def inputs(d, n):
    b, h = 2**21 // (16 * n), 16
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    return b, h, q, k, v, do


def prepared(d, n):
    """(b, h, q, k, v, dO, O, L, dQ, dK, dV, D buffers) of one sweep cell: random inputs, O and L from a forward."""
    b, h, q, k, v, do = inputs(d, n)
    o = torch.empty_like(q)
    lse = torch.empty(b, h, n, device="cuda")
    ft._forward(q, k, v, True, o=o, lse=lse)
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    return b, h, q, k, v, do, o, lse, dq, dk, dv, torch.empty(b * h, n, device="cuda")


def poisoned(b, h, n, d):
    """(q, k, v, dO, O, L, dQ, dK, dV, D) of a (b, h, n, d) bf16 causal problem: random inputs (never zeros), every
    output buffer NaN-poisoned, then O and L from ``flash_triton``'s forward."""
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o, dq, dk, dv = (torch.full_like(q, float("nan")) for _ in range(4))
    lse = torch.full((b, h, n), float("nan"), device="cuda")
    delta = torch.full((b * h, n), float("nan"), device="cuda")
    ft._forward(q, k, v, True, o=o, lse=lse)
    return q, k, v, do, o, lse, dq, dk, dv, delta


def load(path):
    """Another version of ``lmtrain/kernels/flash_gluon_hopper.py`` (a file) as a module of its own, to time beside
    the current one."""
    spec = importlib.util.spec_from_file_location("lmtrain.kernels._flash_gluon_other", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _median_ms(kernel, launch) -> float:
    """Median milliseconds of ``kernel[grid](*args, **kwargs)`` for ``launch = (grid, args, kwargs)``."""
    grid, args, kwargs = launch
    return do_bench(lambda: kernel[grid](*args, **kwargs), return_mode="median")


def tl_constants(q):
    """(constants, autotuning key) of the tl backward kernels for causal self-attention over ``q``'s shape."""
    n, d = q.shape[-2:]
    common = dict(HEAD_DIM=d, BLOCK_D=ft._block_d(d), IS_CAUSAL=True, DOT_PRECISION=ft._dot_precision(q.dtype, False))
    return common, (ft._n_key(n, n), d, True, common["DOT_PRECISION"], q.dtype)


def tl_backward_kernels(b, h, q, k, v, do, o, lse, dq, dk, dv, delta):
    """Executed TFLOP/s of the tl dQ and dK/dV kernels alone (autotuned; dK/dV reads the D that dQ writes)."""
    n, d = q.shape[-2:]
    q4, k4, v4, o4, do4, dq4, dk4, dv4 = (_as_4d(t) for t in (q, k, v, o, do, dq, dk, dv))
    common, key = tl_constants(q)
    ms_dq = do_bench(functools.partial(ft._hopper.dq, q4, k4, v4, o4, do4, lse, delta, dq4, common, key),
                     return_mode="median")
    ms_dkdv = do_bench(functools.partial(ft._hopper.dkdv, q4, k4, v4, do4, lse, delta, dk4, dv4, common, key),
                       return_mode="median")
    return tflops(ms_dq, b, h, n, d, 1.5), tflops(ms_dkdv, b, h, n, d, 2.0)


@contextlib.contextmanager
def gluon_setting(value: str):
    """``LMTRAIN_FLASH_GLUON=value`` inside the block, the previous value (or none) after it."""
    before = os.environ.get("LMTRAIN_FLASH_GLUON")
    os.environ["LMTRAIN_FLASH_GLUON"] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LMTRAIN_FLASH_GLUON")
        else:
            os.environ["LMTRAIN_FLASH_GLUON"] = before


def tl_kernels(b, h, q, k, v, do, o, lse, dq, dk, dv, delta):
    """Executed TFLOP/s of the tl forward (through flash_triton with the Gluon kernels off) and of the tl dQ and
    dK/dV kernels alone: {"tl fwd", "tl dq", "tl dkdv"}."""
    n, d = q.shape[-2:]
    with gluon_setting("0"):
        ms = do_bench(lambda: ft._forward(q, k, v, True, o=o, lse=lse), return_mode="median")
        tl_dq, tl_dkdv = tl_backward_kernels(b, h, q, k, v, do, o, lse, dq, dk, dv, delta)
    return {"tl fwd": tflops(ms, b, h, n, d), "tl dq": tl_dq, "tl dkdv": tl_dkdv}


def print_table(title: str, cells) -> None:
    """A markdown table of ``cells`` ([(column heading, {row name: TFLOP/s})]): a row per name in the order first
    seen, blank where a column lacks it."""
    names = []
    for _, res in cells:
        names += [name for name in res if name not in names]
    print(f"\n| {title} | " + " | ".join(str(col) for col, _ in cells) + " |")
    print("| --- |" + " ---: |" * len(cells))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{res[name]:.0f}" if name in res else "" for _, res in cells) + " |")


def sweep(head_dims, seq_lens, fwd_cfgs, dq_cfgs, dkdv_cfgs, sms):
    """Each kernel and configuration alone, one program per tile and persistent (``p`` suffix, one program per
    multiprocessor); the tl TMA kernels of the same pass for comparison (exec TFLOP/s: fwd 2 products, dq 3, dkdv
    4; ``tl_bwd`` the tl dQ + dK/dV pair at 7)."""
    for d in head_dims:
        for n in seq_lens:
            b, h, q, k, v, do, o, lse, dq, dk, dv, delta = prepared(d, n)
            res = []
            for c in fwd_cfgs[d]:
                for progs, tag in ((None, ""), (sms, "p"))[:2 if sms else 1]:
                    ms = _median_ms(fg._fwd_kernel, fg.forward_args(q, k, v, o, lse, True, fg.Config.parse(c), progs))
                    res.append(f"fwd{c}{tag}={tflops(ms, b, h, n, d):.0f}")
            for c in dq_cfgs[d]:
                for progs, tag in ((None, ""), (sms, "p"))[:2 if sms else 1]:
                    ms = _median_ms(fg._dq_kernel,
                                    fg.dq_args(q, k, v, o, do, dq, lse, delta, True, fg.Config.parse(c), progs))
                    res.append(f"dq{c}{tag}={tflops(ms, b, h, n, d, 1.5):.0f}")
            for c in dkdv_cfgs[d]:
                for progs, tag in ((None, ""), (sms, "p"))[:2 if sms else 1]:
                    ms = _median_ms(fg._dkdv_kernel,
                                    fg.dkdv_args(q, k, v, do, dk, dv, lse, delta, True, fg.Config.parse(c), progs))
                    res.append(f"dkdv{c}{tag}={tflops(ms, b, h, n, d, 2.0):.0f}")
            tl = tl_kernels(b, h, q, k, v, do, o, lse, dq, dk, dv, delta)
            tensors = dict(q=q, k=k, v=v, o=o, lse=lse, do=do, dq=dq, dk=dk, dv=dv)
            with gluon_setting("0"):
                ms = do_bench(lambda t=tensors: ft._backward(t["do"], t["q"], t["k"], t["v"], t["o"], t["lse"], True,
                                                             dq=t["dq"], dk=t["dk"], dv=t["dv"]), return_mode="median")
            res += [f"tl_fwd={tl['tl fwd']:.0f}", f"tl_bwd={tflops(ms, b, h, n, d, 3.5):.0f}",
                    f"tl_dq={tl['tl dq']:.0f}", f"tl_dkdv={tl['tl dkdv']:.0f}"]
            print(f"sweep d={d} N={n}: " + " ".join(res), flush=True)


def print_backward_table(rows, rounds: int, fused: str) -> None:
    """The table of the backward probes: ``rows`` of ((d, N), {column: fastest ms}) with "f+b two kernels",
    "f+b cuDNN" and "f+b " + ``fused`` among the columns, and both forward+backward ratios to cuDNN."""
    print(f"\ncausal bf16, 16 heads, B*H*N = 2^21: fastest median ms of {rounds} interleaved rounds, "
          "and forward+backward ratios to cuDNN")
    names = list(rows[0][1])
    print("\n| d, N | " + " | ".join(names) + " | f+b two / cuDNN | f+b fused / cuDNN |")
    print("| --- |" + " ---: |" * (len(names) + 2))
    for (d, n), best in rows:
        ratio = [best["f+b cuDNN"] / best[f"f+b {x}"] for x in ("two kernels", fused)]
        print(f"| {d}, {n} | " + " | ".join(f"{best[x]:.3f}" for x in names)
              + f" | {ratio[0]:.3f} | {ratio[1]:.3f} |", flush=True)


def causal_attention(leaves, cudnn: bool):
    """A causal forward over ``leaves`` (q, k, v) through SDPA's cuDNN backend or ``FlashAttentionTriton``."""
    if cudnn:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(*leaves, is_causal=True)
    return ft.FlashAttentionTriton.apply(*leaves, True)


def fwd_bwd_ms(leaves, do, cudnn: bool) -> float:
    """Median ms (``do_bench``) of ``causal_attention`` forward then backward of ``do``."""
    return do_bench(lambda: causal_attention(leaves, cudnn).backward(do), grad_to_none=list(leaves),
                    return_mode="median")


def compare(head_dims, seq_lens, settings=("1",)):
    """flash_triton (under each LMTRAIN_FLASH_GLUON setting) against SDPA's cuDNN backend, forward and
    forward+backward TFLOP/s."""
    rows = []
    for d in head_dims:
        for n in seq_lens:
            b, h, q, k, v, do = inputs(d, n)
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            out = {}
            leaves = (qg, kg, vg)
            for name in ("cudnn", *settings):
                if name != "cudnn":
                    os.environ["LMTRAIN_FLASH_GLUON"] = name
                fwd = do_bench(lambda t=leaves, c=name == "cudnn": causal_attention(t, c), return_mode="median")
                fb = fwd_bwd_ms(leaves, do, name == "cudnn")
                out[name] = (tflops(fwd, b, h, n, d), tflops(fb, b, h, n, d, 3.5))
            os.environ["LMTRAIN_FLASH_GLUON"] = "1"
            c = out["cudnn"]
            cells = " ".join(f"[{name}] {out[name][0]:.0f}/{out[name][1]:.0f} ({out[name][0] / c[0]:.2f}/"
                             f"{out[name][1] / c[1]:.2f})" for name in settings)
            rows.append((d, n, out))
            print(f"compare d={d} N={n}: cudnn {c[0]:.0f}/{c[1]:.0f} {cells}", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--persistent", action="store_true", help="also sweep persistent launches")
    p.add_argument("--leaderboard", action="store_true")
    p.add_argument("--no-compare", action="store_true")
    p.add_argument("--settings", nargs="+", default=["1"], help="LMTRAIN_FLASH_GLUON values to compare")
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    p.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 4096, 16384])
    a = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    t0 = time.time()
    default_setting = os.environ.get("LMTRAIN_FLASH_GLUON", "1")
    if not a.no_check:
        # Every Gluon kernel at its defaults; the two-programs-per-multiprocessor candidates at head dim 64; the
        # mixed backward (one kernel from Gluon, the other from tl) both ways.
        ok = check()
        ok &= check({64: {"LMTRAIN_FLASH_GLUON_FWD": "2,64,2,2", "LMTRAIN_FLASH_GLUON_DQ": "2,32,3,2"}})
        ok &= check({128: {}}, setting="fwd,dq")
        ok &= check({64: {}}, setting="dkdv")
        print("CHECK", "PASSED" if ok else "FAILED", f"{time.time() - t0:.0f}s", flush=True)
        if a.check_only or not ok:
            sys.exit(0 if ok else 1)
        os.environ["LMTRAIN_FLASH_GLUON"] = default_setting
    if not a.no_sweep:
        sweep(a.head_dims, a.seq_lens,
              fwd_cfgs={64: ["3,128,2", "2,128,3", "2,64,2,2", "2,64,3,2", "2,32,3,2"], 128: ["2,128,2", "3,64,3"]},
              dq_cfgs={64: ["2,128,3", "2,32,2,2", "2,32,3,2"], 128: ["2,128,2", "2,64,3"]},
              dkdv_cfgs={64: ["2,64,2"], 128: ["2,32,2"]},
              sms=torch.cuda.get_device_properties(0).multi_processor_count if a.persistent else None)
        print(f"sweep done {time.time() - t0:.0f}s", flush=True)
    if not a.no_compare:
        compare(a.head_dims, a.seq_lens, a.settings)
    if a.leaderboard:
        sys.argv = [sys.argv[0]]
        sys.path.insert(0, os.path.dirname(__file__))
        import flash_leaderboard
        flash_leaderboard.main()


if __name__ == "__main__":
    main()
