"""The forward of flash_triton and of SDPA's cuDNN backend timed on fresh inputs several times in one process (bf16,
causal, 128 x 16 heads x 1024 x 64 unless given): for each input set, 700 ms of sustained calls then
``triton.testing.do_bench`` (L2 flushed before each run, median) of ours, cuDNN's, and ours again; every input set
is kept alive, so each lies at new addresses.

    PYTHONPATH=. python benchmarks/scripts/fwd_spread_probe.py [--shape 128 16 1024 64] [--trials 6]
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from lmtrain.attention import backend_info


def cudnn(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sustained(fn, ms):
    t0 = time.time()
    while time.time() - t0 < ms / 1000:
        fn()
        torch.cuda.synchronize()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", type=int, nargs=4, default=[128, 16, 1024, 64])
    p.add_argument("--trials", type=int, default=6)
    a = p.parse_args()
    ours = backend_info("flash_triton").fn
    kept = []
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    print("| input set | ours ms | cuDNN ms | ours again ms | cuDNN / ours |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for trial in range(a.trials):
        q, k, v = (torch.randn(*a.shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        kept.append((q, k, v))
        res = []
        t = (q, k, v)
        for fn in (lambda t=t: ours(*t, True), lambda t=t: cudnn(*t), lambda t=t: ours(*t, True)):
            sustained(fn, 700)
            res.append(do_bench(fn, warmup=100, rep=300, return_mode="median"))
        print(f"| {trial} | {res[0]:.3f} | {res[1]:.3f} | {res[2]:.3f} | {res[1] / res[0]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
