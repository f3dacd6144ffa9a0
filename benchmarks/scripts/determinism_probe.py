"""Whether each backend's backward gives the same bits on every run: six backward passes of one forward's output
gradient on the same inputs (bf16, causal, B*H*N = 2^21, 16 heads), and the number of distinct dQ, dK and dV bit
patterns among them, for flash_triton by default, with ``LMTRAIN_FLASH_GLUON_FUSED=0`` (the dQ and dK/dV
kernels), and under ``torch.use_deterministic_algorithms(True)``, and for SDPA's cuDNN and FlashAttention-2
backends (run on the GPU machine).

    PYTHONPATH=. python benchmarks/scripts/determinism_probe.py
"""
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmtrain.attention import backend_info

RUNS = 6
SHAPES = ((64, 4096), (128, 16384))  # (head dim, N)


def sdpa(backend):
    def fn(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return fn


def main():
    ours = backend_info("flash_triton").fn

    def flash(q, k, v):
        return ours(q, k, v, True)

    variants = (("flash_triton", flash, None), ("flash_triton, LMTRAIN_FLASH_GLUON_FUSED=0", flash, "0"),
                ("flash_triton, use_deterministic_algorithms", flash, "deterministic"),
                ("sdpa_cudnn", sdpa(SDPBackend.CUDNN_ATTENTION), None),
                ("sdpa_flash", sdpa(SDPBackend.FLASH_ATTENTION), None))
    print(torch.cuda.get_device_name(), torch.__version__)
    print(f"| d | N | backend | distinct dQ in {RUNS} runs | distinct dK | distinct dV |")
    print("| ---: | ---: | --- | ---: | ---: | ---: |")
    for d, n in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(1)
        q, k, v, do = (torch.randn((2**21 // n // 16, 16, n, d), device="cuda", dtype=torch.bfloat16, generator=gen)
                       for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        for name, fn, setting in variants:
            os.environ.pop("LMTRAIN_FLASH_GLUON_FUSED", None)
            if setting == "0":
                os.environ["LMTRAIN_FLASH_GLUON_FUSED"] = "0"
            torch.use_deterministic_algorithms(setting == "deterministic", warn_only=True)
            seen = [set(), set(), set()]
            for _ in range(RUNS):
                q.grad = k.grad = v.grad = None
                fn(q, k, v).backward(do)
                for bits, grad in zip(seen, (q.grad, k.grad, v.grad), strict=True):
                    bits.add(hash(grad.view(torch.int16).cpu().numpy().tobytes()))
            print(f"| {d} | {n} | {name} | {len(seen[0])} | {len(seen[1])} | {len(seen[2])} |", flush=True)
        torch.use_deterministic_algorithms(False)
        os.environ.pop("LMTRAIN_FLASH_GLUON_FUSED", None)


if __name__ == "__main__":
    main()
