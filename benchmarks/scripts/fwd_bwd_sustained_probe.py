"""Forward+backward of flash_triton and SDPA's cuDNN backend timed two ways (bf16, causal, 16 heads,
B*H*N = 2^21): ten iterations each followed by a synchronisation (events around the forward and the backward, and
the host time of the ``backward()`` call), then ten iterations back to back with no synchronisation between them
(the GPU busy throughout, as in ``bench attention``'s forward+backward column). Where the second is slower than the
first, sustained load costs the GPU clock speed.

    PYTHONPATH=. python benchmarks/scripts/fwd_bwd_sustained_probe.py [--cells 64:16384 64:4096 128:16384]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmtrain.attention import backend_info


def cudnn(q, k, v, causal):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cells", nargs="+", default=["64:16384", "64:4096", "128:16384"])
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    fns = {"flash_triton": backend_info("flash_triton").fn, "sdpa_cudnn": cudnn}
    rows = []
    for cell in a.cells:
        d, n = map(int, cell.split(":"))
        b = 2**21 // (16 * n)
        gen = torch.Generator(device="cuda").manual_seed(n + d)
        q, k, v, do = (torch.randn(b, 16, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        for name, fn in fns.items():
            for _ in range(3):
                fn(q, k, v, True).backward(do)
            res = {"fwd": [], "bwd": [], "f+b": [], "host bwd call": []}
            for _ in range(a.iters):
                q.grad = k.grad = v.grad = None
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                ev[0].record()
                out = fn(q, k, v, True)
                ev[1].record()
                t0 = time.perf_counter()
                out.backward(do)
                res["host bwd call"].append((time.perf_counter() - t0) * 1e3)
                ev[2].record()
                torch.cuda.synchronize()
                res["fwd"].append(ev[0].elapsed_time(ev[1]))
                res["bwd"].append(ev[1].elapsed_time(ev[2]))
                res["f+b"].append(ev[0].elapsed_time(ev[2]))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(a.iters):
                q.grad = k.grad = v.grad = None
                fn(q, k, v, True).backward(do)
            end.record()
            torch.cuda.synchronize()
            med = {key: statistics.median(x) for key, x in res.items()}
            rows.append((d, n, name, med, start.elapsed_time(end) / a.iters))
            print(d, n, name, med, flush=True)
    print("\nmedian ms of iterations with a synchronisation after each; mean ms of iterations back to back\n")
    print("| d | N | backend | fwd | bwd | f+b | host ms of backward() | f+b back to back |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for d, n, name, med, b2b in rows:
        print(f"| {d} | {n} | {name} | {med['fwd']:.3f} | {med['bwd']:.3f} | {med['f+b']:.3f} | "
              f"{med['host bwd call']:.3f} | {b2b:.3f} |")


if __name__ == "__main__":
    main()
