"""Paired tile schedules of the Gluon kernels on the GPU (run on the GPU machine): correctness of paired and
three-warpgroup configurations through ``flash_triton``'s entry points (against float64 on odd shapes, NaN-poisoned
outputs, determinism), then each kernel alone at schedules 0 (one program per tile), 1 (one per pair of tiles) and
2 (persistent pairs), executed TFLOP/s (forward 2 products per tile pair, dQ 3, dK/dV 4), beside the ``tl`` TMA
kernels (bf16, causal, 16 heads, B*H*N = 2^21).

    PYTHONPATH=. python benchmarks/scripts/gluon_pairs_probe.py --head-dim 64 [--seq-lens 1024 4096 16384]

Configurations are ``num_wg,block,num_stages,per_sm,reg_a,schedule`` (``flash_gluon_hopper.Config``). A persistent
launch here always takes one program per multiprocessor (the probe passes the grid), where the library's launcher
falls back to one program per tile when the last round would leave most programs idle.
"""
import argparse
import dataclasses
import os
import sys
import time

import torch

from lmtrain.kernels import flash_gluon_hopper as fg

sys.path.insert(0, os.path.dirname(__file__))
from gluon_probe import _median_ms, check, prepared, print_table, tflops, tl_kernels  # noqa: E402

ENV = ("LMTRAIN_FLASH_GLUON_FWD", "LMTRAIN_FLASH_GLUON_DQ", "LMTRAIN_FLASH_GLUON_DKDV")
CHECKS = {64: [("2,128,3,1,0,1", "2,128,3,1,0,2", "2,64,3,1,1,1"), ("2,128,3,1,0,2", "3,64,3,1,0,1", "3,32,3,1,1,2")],
          128: [("2,128,2,1,0,1", "2,64,2,1,1,2", "2,32,2,1,0,1"), ("3,64,3,1,0,2", "2,128,2,1,0,1", "2,32,2,1,0,2")]}
# Per head dim: forward configurations per key count, dQ and dK/dV configurations; the first of each is also run
# at schedule 1, the others at 0 and 2 only.
FWD = {64: {1024: ["2,128,3"], 4096: ["2,128,3"], 16384: ["3,128,2"]},
       128: {1024: ["2,128,2"], 4096: ["2,128,2"], 16384: ["3,64,3"]}}
DQ = {64: ["2,128,3", "3,64,3"], 128: ["2,64,2,1,1", "2,128,2"]}
DKDV = {64: ["2,64,3,1,1", "3,32,3,1,1"], 128: ["2,32,2"]}
EXTRA_FWD = {64: ["2,64,3,2,0,2", "2,64,3,2,0,0"], 128: []}  # two programs per multiprocessor


def variants(cfgs):
    """Each configuration at schedules 0 and 2, the first also at 1, as (label, Config); labels in the override
    format of all six fields."""
    out = []
    for i, c in enumerate(cfgs):
        base = fg.Config.parse(c)
        for schedule in (0, 1, 2) if i == 0 else (0, 2):
            cfg = dataclasses.replace(base, schedule=schedule)
            out.append((",".join(map(str, dataclasses.astuple(cfg))), cfg))
    return out


def persistent_grid(cfg, sms):
    """The probe's grid for ``cfg``: per_sm programs per multiprocessor at schedule 2 (no fallback), else the
    launcher's."""
    return cfg.per_sm * sms if cfg.schedule == 2 else None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--head-dim", type=int, choices=(64, 128), required=True)
    p.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 4096, 16384])
    p.add_argument("--no-check", action="store_true")
    a = p.parse_args()
    d = a.head_dim
    t0 = time.time()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if not a.no_check:
        ok = all([check({d: dict(zip(ENV, cfgs, strict=True))}) for cfgs in CHECKS[d]])
        print("CHECK", "PASSED" if ok else "FAILED", f"{time.time() - t0:.0f}s", flush=True)
        if not ok:
            sys.exit(1)
        for var in ENV:
            os.environ.pop(var, None)
    os.environ["LMTRAIN_FLASH_GLUON"] = "1"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    table = {}
    extra = [(c, fg.Config.parse(c)) for c in EXTRA_FWD[d]]
    for n in a.seq_lens:
        b, h, q, k, v, do, o, lse, dq, dk, dv, delta = prepared(d, n)
        res = {}
        for label, cfg in variants(FWD[d].get(n, FWD[d][max(FWD[d])])) + extra:
            ms = _median_ms(fg._fwd_kernel, fg.forward_args(q, k, v, o, lse, True, cfg, persistent_grid(cfg, sms)))
            res[f"fwd {label}"] = tflops(ms, b, h, n, d)
        for label, cfg in variants(DQ[d]):
            ms = _median_ms(fg._dq_kernel,
                            fg.dq_args(q, k, v, o, do, dq, lse, delta, True, cfg, persistent_grid(cfg, sms)))
            res[f"dq {label}"] = tflops(ms, b, h, n, d, 1.5)
        for label, cfg in variants(DKDV[d]):
            ms = _median_ms(fg._dkdv_kernel,
                            fg.dkdv_args(q, k, v, do, dk, dv, lse, delta, True, cfg, persistent_grid(cfg, sms)))
            res[f"dkdv {label}"] = tflops(ms, b, h, n, d, 2.0)
        res.update(tl_kernels(b, h, q, k, v, do, o, lse, dq, dk, dv, delta))
        table[n] = res
        print(n, {k_: round(v_) for k_, v_ in res.items()}, f"{time.time() - t0:.0f}s", flush=True)
        del q, k, v, do, o, lse, dq, dk, dv, delta
    print_table(f"d {d}: kernel, config", [(f"N {n}", table[n]) for n in a.seq_lens])


if __name__ == "__main__":
    main()
