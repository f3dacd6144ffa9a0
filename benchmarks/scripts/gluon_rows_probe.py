"""The dK/dV kernel's per-block statistics (L and D of each streamed query block) copied into shared memory by the
producer's TMA with the block's queries, against each consumer loading them from global memory at the block's start
(run on the GPU machine). First the float64 check of every Gluon kernel (``gluon_probe.check``; shapes with N_q a
multiple of 4 take the copied statistics, the others the loads) with the default dK/dV configuration and the
candidates below; then the dK/dV kernel alone, default configuration with loads ("loads") and with copies
("copies"), and candidate configurations with copies (larger query blocks, which the registers the loads held now
leave room for), three interleaved runs each, median milliseconds; last the leaderboard problem.

    PYTHONPATH=. python benchmarks/scripts/gluon_rows_probe.py [--no-check] [--no-leaderboard]
"""
import argparse
import os
import sys
import time

import torch

from lmtrain.kernels import flash_gluon_hopper as fg

sys.path.insert(0, os.path.dirname(__file__))
from flash_leaderboard import leaderboard_ms  # noqa: E402
from gluon_probe import _median_ms, check, poisoned, tflops  # noqa: E402

CANDIDATES = {64: ("2,128,2", "2,64,2,1,1", "3,32,3,1,1"), 128: ("2,64,2", "2,64,3", "2,64,2,1,0,2")}
SHAPES = [(128, 16, 1024), (32, 16, 4096), (8, 16, 16384), (1, 16, 16384)]


def loads(launch):
    """The same launch with the statistics loaded by the consumers (the kernel's SMEM_STATS off)."""
    grid, args, kwargs = launch
    args = list(args)
    for i, a in enumerate(args):
        if isinstance(a, fg.TensorDescriptor) and len(a.block_shape) == 2:  # L or D
            args[i] = a.base
    return grid, tuple(args), dict(kwargs, SMEM_STATS=False)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--no-leaderboard", action="store_true")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--candidates", nargs="+", metavar="D:CONFIG",
                   help="replace the candidate configurations, e.g. 64:2,64,2,1,1 128:2,64,2")
    a = p.parse_args()
    if a.candidates:
        CANDIDATES.clear()
        for item in a.candidates:
            d, c = item.split(":")
            CANDIDATES[int(d)] = CANDIDATES.get(int(d), ()) + (c,)
    t0 = time.time()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if not a.no_check:
        ok = check(None, "all")
        for d in a.head_dims:
            for c in CANDIDATES.get(d, ()):
                ok &= check({d: {"LMTRAIN_FLASH_GLUON_DKDV": c}}, "all")
        os.environ.pop("LMTRAIN_FLASH_GLUON_DKDV", None)
        print("CHECK", "PASSED" if ok else "FAILED", f"{time.time() - t0:.0f}s", flush=True)
        if not ok:
            sys.exit(1)
    rows = []
    for d in a.head_dims:
        for b, h, n in SHAPES:
            q, k, v, do, o, lse, dq, dk, dv, delta = poisoned(b, h, n, d)
            fg.dq(q, k, v, o, do, dq, lse, delta, True)  # D
            default = fg.config(fg.DKDV, d, n)
            variants = {"loads": loads(fg.dkdv_args(q, k, v, do, dk, dv, lse, delta, True)),
                        "copies": fg.dkdv_args(q, k, v, do, dk, dv, lse, delta, True)}
            for c in CANDIDATES.get(d, ()):
                variants[c] = fg.dkdv_args(q, k, v, do, dk, dv, lse, delta, True, fg.Config.parse(c))
            runs = {name: [] for name in variants}
            for _ in range(3):
                for name, launch in variants.items():
                    runs[name].append(_median_ms(fg._dkdv_kernel, launch))
            best = {name: min(r) for name, r in runs.items()}
            cells = " | ".join(f"{best[name]:.3f} ({tflops(best[name], b, h, n, d, 2.0):.0f})" for name in variants)
            rows.append(f"| {b}x{h}x{n} d{d} | {','.join(map(str, fg.dataclasses.astuple(default)))} | {cells} | "
                        f"{best['copies'] / best['loads']:.3f} |")
            print(rows[-1], " | ".join(f"{name}: " + ",".join(f"{x:.3f}" for x in r) for name, r in runs.items()),
                  flush=True)
    print("\ncolumns: shape | default config | loads | copies | " + " | ".join(
        f"{d}: {' / '.join(CANDIDATES.get(d, ()))}" for d in a.head_dims) + " | copies / loads")
    print("\n".join(rows))
    if not a.no_leaderboard:
        for _ in range(2):
            print(f"leaderboard flash_triton {leaderboard_ms('flash_triton'):.3f} ms, "
                  f"sdpa_cudnn {leaderboard_ms('sdpa_cudnn'):.3f} ms", flush=True)
    print(f"{time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
