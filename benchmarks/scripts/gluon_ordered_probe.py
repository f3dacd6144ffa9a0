"""The fused backward with its dQ sums added in a fixed order, against the same kernel adding in whatever order the
key tiles arrive and against the dQ and dK/dV kernels (run on the GPU machine). The ordered variant is not in the
library (it measured slower than the two kernels, see benchmarks/2026-11-27-H100-flash-gluon-ordered.md); apply
``2026-11-27-ordered-reductions.patch`` (beside this script) first, which adds it as ``LMTRAIN_FLASH_GLUON_FUSED=3``:

    git apply benchmarks/scripts/2026-11-27-ordered-reductions.patch
    for shape in "64 32 4096" "64 8 16384" "128 32 4096" "128 8 16384"; do
        PYTHONPATH=. timeout 70 python benchmarks/scripts/gluon_ordered_probe.py $shape 0 2 3
    done

Arguments: head dim, batch, sequence length (16 heads, causal, bf16), then the ``LMTRAIN_FLASH_GLUON_FUSED`` values to
run. For each: six backward calls on the same inputs (are their dQ, dK, dV the same bits?), the relative difference of
the first from the dQ and dK/dV kernels' (value 0, which must come first to be compared with), and the backward's
median time (``do_bench``). Each shape runs in a process of its own under ``timeout``: a variant that waits for a flag
no program will ever set hangs.
"""
import os
import sys
import time

import torch
from triton.testing import do_bench

os.environ["LMTRAIN_FLASH_LAUNCH_PLANS"] = "0"
from lmtrain.kernels import flash_triton as ft  # noqa: E402


def main():
    d, b, n = map(int, sys.argv[1:4])
    h = 16
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o = torch.empty_like(q)
    lse = torch.empty(b, h, n, device="cuda")
    ft._forward(q, k, v, True, o=o, lse=lse)
    torch.cuda.synchronize()
    first = {}
    for mode in sys.argv[4:]:
        os.environ["LMTRAIN_FLASH_GLUON_FUSED"] = mode
        t0 = time.time()
        outs = [ft._backward(do, q, k, v, o, lse, True) for _ in range(6)]
        torch.cuda.synchronize()
        same = all(torch.equal(a, c) for x in outs[1:] for a, c in zip(outs[0], x, strict=True))
        first[mode] = outs[0]
        err = "" if mode == "0" or "0" not in first else " dq/dk/dv vs two kernels " + " ".join(
            f"{((a.float() - c.float()).norm() / c.float().norm()).item():.1e}"
            for a, c in zip(outs[0], first["0"], strict=True))
        ms = do_bench(lambda: ft._backward(do, q, k, v, o, lse, True), return_mode="median")
        print(f"d{d} b{b} n{n} mode {mode}: bwd {ms:.3f} ms, 6 runs bitwise same {same}{err} "
              f"({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
