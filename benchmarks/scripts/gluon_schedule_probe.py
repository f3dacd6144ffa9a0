"""The Gluon kernels' schedules on the GPU: correctness of the configurations swept (through ``flash_triton``'s
entry points, against float64 on odd shapes), then each kernel alone, executed TFLOP/s (forward 2 products per tile
pair, dQ 3, dK/dV 4), for this tree's kernels, for another version of the module (``--old``, a file, e.g. the
previous commit's ``flash_gluon_hopper.py``) and for the ``tl`` TMA kernels, in one process (bf16, causal, 16 heads,
B*H*N = 2^21).

    git show HEAD~1:lmtrain/kernels/flash_gluon_hopper.py > /tmp/fg_old.py
    PYTHONPATH=. python benchmarks/scripts/gluon_schedule_probe.py --old /tmp/fg_old.py

Configurations are ``num_wg,block,num_stages[,per_sm[,reg_a]]`` (``flash_gluon_hopper.Config``).
"""
import argparse
import os
import sys
import time

import torch

from lmtrain.kernels import flash_gluon_hopper as fg

sys.path.insert(0, os.path.dirname(__file__))
from gluon_probe import _median_ms, check, load, prepared, print_table, tflops, tl_kernels  # noqa: E402

FWD = {64: ["2,128,3", "2,128,3,1,1", "3,128,2"], 128: ["2,128,2", "2,128,2,1,1", "3,64,3"]}
DQ = {64: ["2,128,3", "2,128,3,1,1", "2,128,2,1,1", "2,64,3,1,1"],
      128: ["2,128,2", "2,64,3", "2,64,3,1,1", "2,64,2,1,1"]}
DKDV = {64: ["2,64,2", "2,64,2,1,1", "2,64,3,1,1", "2,32,2,1,1"],
        128: ["2,32,2", "2,32,3", "2,16,2,1,1", "2,16,3,1,1"]}


def sweep(head_dims, seq_lens, old):
    rows = []
    for d in head_dims:
        for n in seq_lens:
            b, h, q, k, v, do, o, lse, dq, dk, dv, delta = prepared(d, n)
            res = {}
            mods = [("", fg)] + ([("old:", old)] if old is not None else [])
            for tag, mod in mods:
                cfgs = (FWD[d], DQ[d], DKDV[d]) if tag == "" else ([None], [None], [None])
                for c in cfgs[0]:
                    cfg = mod.Config.parse(c) if c else None
                    ms = _median_ms(mod._fwd_kernel, mod.forward_args(q, k, v, o, lse, True, cfg))
                    res[f"{tag}fwd {c or 'default'}"] = tflops(ms, b, h, n, d)
                for c in cfgs[1]:
                    cfg = mod.Config.parse(c) if c else None
                    ms = _median_ms(mod._dq_kernel, mod.dq_args(q, k, v, o, do, dq, lse, delta, True, cfg))
                    res[f"{tag}dq {c or 'default'}"] = tflops(ms, b, h, n, d, 1.5)
                for c in cfgs[2]:
                    cfg = mod.Config.parse(c) if c else None
                    ms = _median_ms(mod._dkdv_kernel, mod.dkdv_args(q, k, v, do, dk, dv, lse, delta, True, cfg))
                    res[f"{tag}dkdv {c or 'default'}"] = tflops(ms, b, h, n, d, 2.0)
            res.update(tl_kernels(b, h, q, k, v, do, o, lse, dq, dk, dv, delta))
            rows.append((d, n, res))
            print(f"sweep d={d} N={n}: " + "; ".join(f"{k_} {v_:.0f}" for k_, v_ in res.items()), flush=True)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--old", help="another flash_gluon_hopper.py to time beside this tree's")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    p.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 4096, 16384])
    a = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    t0 = time.time()
    if not a.no_check:
        ok = check()  # every Gluon kernel at its defaults
        for i in range(1, 4):  # the swept configurations, a kernel's i-th of each head dim together
            over = {d: {"LMTRAIN_FLASH_GLUON_FWD": FWD[d][min(i, len(FWD[d]) - 1)],
                        "LMTRAIN_FLASH_GLUON_DQ": DQ[d][i], "LMTRAIN_FLASH_GLUON_DKDV": DKDV[d][i]}
                    for d in a.head_dims}
            ok &= check(over)
        print("CHECK", "PASSED" if ok else "FAILED", f"{time.time() - t0:.0f}s", flush=True)
        if not ok:
            sys.exit(1)
    old = load(a.old) if a.old else None
    rows = sweep(a.head_dims, a.seq_lens, old)
    print(f"sweep done {time.time() - t0:.0f}s", flush=True)
    print("\nexecuted TFLOP/s, bf16 causal, B*H*N = 2^21")
    for d in a.head_dims:
        print_table(f"d {d}: kernel, config", [(f"N {n}", r) for d_, n, r in rows if d_ == d])


if __name__ == "__main__":
    main()
