"""Attention variants timed in interleaved windows of sustained load, with the GPU's clock and energy per run.

For each shape (head dim, N; bf16, causal, B*H*N = 2^21, 16 heads) and pass (``fwd`` or ``fb``: forward then
backward of ``out.backward(do)``), every round runs each variant for ``--window-ms`` of back-to-back calls (the order
rotated from round to round), so that all variants see the same mix of clock states under the power limit. Each
window gives: the mean milliseconds per call over the window (device events around all its calls), the median of
``--rep`` calls timed one by one right after (as ``bench attention`` times), millijoules per call (NVML's energy
counter over the window), mean power and the mean SM clock (NVML, sampled every 10 ms). The summary gives, per shape
and pass, the median of each over the rounds and each variant's time over cuDNN's.

Variants: ``ours`` (flash_triton, defaults), ``ours_det`` (``LMTRAIN_FLASH_GLUON_FUSED=0``: the dQ and dK/dV kernels,
what ``torch.use_deterministic_algorithms(True)`` selects), ``cudnn`` (SDPA's cuDNN backend), ``flash2`` (SDPA's
FlashAttention-2 backend), and ``fwd=A,B,C...`` (ours with ``LMTRAIN_FLASH_GLUON_FWD`` set to that configuration).

    PYTHONPATH=. python benchmarks/scripts/interleaved_probe.py --cells 64:1024:fwd 64:16384:fb \
        --variants ours ours_det cudnn --rounds 6
"""
import argparse
import os
import statistics
import threading
import time

import pynvml
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmtrain.attention import backend_info

_KEYS = ("LMTRAIN_FLASH_GLUON_FUSED", "LMTRAIN_FLASH_GLUON_FWD")  # what the variants set
_SDPA = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash2": SDPBackend.FLASH_ATTENTION}


def variant_fn(name):
    """(attention function, environment of the variant)."""
    if name in _SDPA:
        backend = _SDPA[name]

        def fn(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return fn, {}
    ours = backend_info("flash_triton").fn
    env = {"ours": {}, "ours_det": {"LMTRAIN_FLASH_GLUON_FUSED": "0"}}.get(name)
    if env is None and name.startswith("fwd="):
        env = {"LMTRAIN_FLASH_GLUON_FWD": name[4:]}
    if env is None:
        raise SystemExit(f"unknown variant {name!r}")
    return (lambda q, k, v: ours(q, k, v, True)), env


class Sampler:
    """Mean SM clock (MHz) and power (W) of the device, sampled every 10 ms while running."""

    def __init__(self, handle):
        self.handle, self.clocks, self.powers, self.stop = handle, [], [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            self.clocks.append(pynvml.nvmlDeviceGetClockInfo(self.handle, pynvml.NVML_CLOCK_SM))
            self.powers.append(pynvml.nvmlDeviceGetPowerUsage(self.handle) / 1000)
            time.sleep(0.01)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def make_call(fn, tensors, mode):
    """One forward (``fwd``), or forward then backward (``fb``), with the gradients cleared first."""
    q, k, v, do = tensors

    def call():
        q.grad = k.grad = v.grad = None
        out = fn(q, k, v)
        if mode == "fb":
            out.backward(do)
    return call


def window(call, handle, window_ms, rep):
    """(mean ms per call over a window of back-to-back calls, median ms of ``rep`` calls timed one by one, mJ per
    call, mean W, mean MHz)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    call()
    torch.cuda.synchronize()
    t = time.perf_counter()
    call()
    torch.cuda.synchronize()
    n = max(4, int(window_ms / 1000 / max(time.perf_counter() - t, 1e-5)))
    with Sampler(handle) as sampler:
        energy0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        start.record()
        for _ in range(n):
            call()
        end.record()
        end.synchronize()
        energy1 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    mean_ms = start.elapsed_time(end) / n
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rep)]
    for a, b in marks:
        a.record()
        call()
        b.record()
    torch.cuda.synchronize()
    median_ms = statistics.median(a.elapsed_time(b) for a, b in marks)
    return (mean_ms, median_ms, (energy1 - energy0) / n, statistics.mean(sampler.powers or [0]),
            statistics.mean(sampler.clocks or [0]))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="+", default=["64:1024:fwd"], help="head_dim:N:fwd|fb")
    p.add_argument("--variants", nargs="+", default=["ours", "cudnn"])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--window-ms", type=float, default=400)
    p.add_argument("--rep", type=int, default=30)
    a = p.parse_args()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    print(torch.cuda.get_device_name(), torch.__version__, "power limit W",
          pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000, flush=True)
    fns = {name: variant_fn(name) for name in a.variants}
    summary = []
    for cell in a.cells:
        d, n, mode = cell.split(":")
        d, n = int(d), int(n)
        bh = 2**21 // n
        gen = torch.Generator(device="cuda").manual_seed(n * 1000 + d)
        tensors = tuple(torch.randn((bh // 16, 16, n, d), device="cuda", dtype=torch.bfloat16, generator=gen)
                       for _ in range(4))
        for t in tensors[:3]:
            t.requires_grad_()
        results = {name: [] for name in a.variants}
        for r in range(a.rounds):
            order = a.variants[r % len(a.variants):] + a.variants[:r % len(a.variants)]
            for name in order:
                fn, env = fns[name]
                for key in _KEYS:
                    os.environ.pop(key, None)
                os.environ.update(env)
                results[name].append(window(make_call(fn, tensors, mode), handle, a.window_ms, a.rep))
                row = results[name][-1]
                print(f"d {d} N {n} {mode} round {r} {name}: window {row[0]:.3f} ms, median {row[1]:.3f} ms, "
                      f"{row[2]:.1f} mJ, {row[3]:.0f} W, {row[4]:.0f} MHz", flush=True)
        for key in _KEYS:
            os.environ.pop(key, None)
        for name in a.variants:
            cols = list(zip(*results[name], strict=True))
            summary.append((d, n, mode, name, *(statistics.median(c) for c in cols)))
        del tensors
    print("\n| d | N | pass | variant | window ms | median-of-rep ms | mJ / call | W | MHz | cuDNN / variant (window) "
          "| cuDNN / variant (median) |")
    print("| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in summary:
        ref = next((s for s in summary if s[:3] == row[:3] and s[3] == "cudnn"), None)
        ratio = f"{ref[4] / row[4]:.3f} | {ref[5] / row[5]:.3f}" if ref else "- | -"
        print(f"| {row[0]} | {row[1]} | {row[2]} | {row[3]} | {row[4]:.3f} | {row[5]:.3f} | {row[6]:.1f} | "
              f"{row[7]:.0f} | {row[8]:.0f} | {ratio} |")


if __name__ == "__main__":
    main()
