"""The forward of flash_triton and of SDPA's cuDNN backend timed as ``bench attention`` times a cell's forward
(``_median_ms``: 1000 ms of sustained calls, then 30 timed runs between stream events, median), on six fresh input
sets in one process (bf16, causal, 16 heads, d 64, B*H*N = 2^21, N 4096 and 1024; inputs with ``requires_grad``):
ours, cuDNN's, ours again, each also under ``torch.no_grad`` (300 ms sustained).

    PYTHONPATH=. python benchmarks/scripts/fwd_cells_probe.py
"""
import functools

import torch

from lmtrain.bench.attention import _backend, _median_ms


def main():
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    for n, d in ((4096, 64), (1024, 64)):
        b, h = 2**21 // (16 * n), 16
        fns = {name: _backend(name, dev, n, 0) for name in ("flash_triton", "sdpa_cudnn")}
        for trial in range(6):
            g = torch.Generator(device=dev).manual_seed(trial)
            q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
                       for _ in range(3))
            row = []
            for name in ("flash_triton", "sdpa_cudnn", "flash_triton"):
                fn = fns[name]
                fn(q, k, v, True).sum().backward()
                q.grad = k.grad = v.grad = None
                call = functools.partial(fn, q, k, v, True)
                timed = _median_ms(lambda: None, lambda _, call=call: call(), 5, 30, dev, 1000.0)
                with torch.no_grad():
                    no_grad = _median_ms(lambda: None, lambda _, call=call: call(), 5, 30, dev, 300.0)
                row.append(f"{name} {timed:.3f} (no grad {no_grad:.3f})")
            print(f"N {n} trial {trial}: " + "; ".join(row), flush=True)


if __name__ == "__main__":
    main()
