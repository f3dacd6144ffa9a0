"""The Gluon forward kernel alone against SDPA's cuDNN forward, per configuration (run on the GPU machine): bf16,
causal, 16 heads, B*H*N = 2^21. Three interleaved runs of each configuration and of cuDNN's forward per shape,
fastest run in milliseconds and as a ratio to cuDNN's fastest; then the float64 check (``gluon_probe.check``) of the
fastest configuration of each head dim that is not the default.

    PYTHONPATH=. python benchmarks/scripts/gluon_fwd_probe.py --head-dim 64 --seq-lens 1024 4096 \
        --configs 2,128,3,1,0,2 2,64,4,1,0,2 [--baseline OLD.py] [--check 2,128,3,1,0,2 ...]

``--baseline``: another version of ``lmtrain/kernels/flash_gluon_hopper.py`` (a file, for example the previous
commit's, ``git show HEAD~1:lmtrain/kernels/flash_gluon_hopper.py > old.py``): its forward kernel with its own
default configuration of each cell is timed in the same rounds (column "baseline"). ``--check``: configurations to
run the float64 check with (instead of the fastest ones), "default" for the defaults.
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from lmtrain.kernels import flash_gluon_hopper as fg

sys.path.insert(0, os.path.dirname(__file__))
from gluon_probe import _median_ms, check, load, poisoned, tflops  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--configs", nargs="+", required=True)
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--baseline", help="another version of flash_gluon_hopper.py to time with its defaults")
    p.add_argument("--check", nargs="+", help="configurations to check against float64 ('default': the defaults)")
    a = p.parse_args()
    t0 = time.time()
    d = a.head_dim
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    base = load(a.baseline) if a.baseline else None
    labels = [*a.configs, *(["baseline"] if base else [])]
    wins = {}
    print("| N | default | " + " | ".join(labels) + " | cuDNN |")
    for n in a.seq_lens:
        b, h = 2**21 // (16 * n), 16
        q, k, v, do, o, lse, dq, dk, dv, delta = poisoned(b, h, n, d)
        launches = {c: (fg._fwd_kernel, fg.forward_args(q, k, v, o, lse, True, fg.Config.parse(c)))
                    for c in a.configs}
        if base:
            launches["baseline"] = (base._fwd_kernel, base.forward_args(q, k, v, o, lse, True))
        runs = {c: [] for c in [*labels, "cudnn"]}
        for _ in range(3):
            for c, (kernel, launch) in launches.items():
                runs[c].append(_median_ms(kernel, launch))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                runs["cudnn"].append(do_bench(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                    q, k, v, is_causal=True), return_mode="median"))
        best = {c: min(r) for c, r in runs.items()}
        default = ",".join(map(str, fg.dataclasses.astuple(fg.config(fg.FWD, d, n))))
        print(f"| {n} | {default} | " + " | ".join(
            f"{best[c]:.3f} ({tflops(best[c], b, h, n, d):.0f}, {best['cudnn'] / best[c]:.3f})" for c in labels)
            + f" | {best['cudnn']:.3f} ({tflops(best['cudnn'], b, h, n, d):.0f}) |", flush=True)
        print("  runs: " + "; ".join(f"{c}: " + ",".join(f"{x:.3f}" for x in r) for c, r in runs.items()), flush=True)
        winner = min(a.configs, key=best.get)
        if not default.startswith(winner):
            wins[n] = winner
    if not a.no_check:
        for c in a.check or sorted(set(wins.values())):
            ok = check({d: {} if c == "default" else {"LMTRAIN_FLASH_GLUON_FWD": c}}, "all")
            print("CHECK", c, "PASSED" if ok else "FAILED", flush=True)
    print(f"{time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
