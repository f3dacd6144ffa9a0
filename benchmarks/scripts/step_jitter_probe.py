"""Where a slow training step loses its time: the 2.7B model (or any size) trained by a bare loop, with the attention
backend switched between steps (``--order sdpa,flash_triton``: step i uses backend i mod 2), so both backends see the
same machine, clocks and memory state.

For every step it records, without waiting for the GPU inside the step:

    gpu fwd/bwd/opt   CUDA-event times of the three phases
    host bwd          how long ``loss.backward()`` took to return (the time to issue the backward's work; when it is
                      close to ``gpu bwd`` the GPU waited for the host)
    attn host         host time spent inside flash_triton's backward launcher (sum over the step's calls) and its
                      longest single call
    retries           allocator retries (``num_alloc_retries``) during the step

and one synchronisation at the end of each step. With ``--smi`` it also samples the SM clock and power with
nvidia-smi every 20 ms and prints, for the slowest steps, the clock while they ran.

    PYTHONPATH=. python benchmarks/scripts/step_jitter_probe.py [--size 2.7B] [--context 512] [--batch 4]
        [--steps 40] [--warmup 6] [--order sdpa,flash_triton] [--smi] [--trace]

An entry of ``--order`` may carry settings for its steps after a colon, joined by ``+``:
``--order sdpa,flash_triton,flash_triton:LMTRAIN_FLASH_LAUNCH_PLANS=0`` compares flash_triton with and without
launch plans beside sdpa.
"""
import argparse
import contextlib
import os
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

import lmtrain.kernels.flash_triton as ft
from lmtrain.attention import get_attention
from lmtrain.config import ModelConfig
from lmtrain.model import CausalSelfAttention, TransformerLM
from lmtrain.optim import weight_decay_groups

_ATTN_HOST = []  # seconds of each flash_triton backward launcher call in the current step


def _timed_backward(fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        _ATTN_HOST.append(time.perf_counter() - t0)
        return out
    return wrapper


def _gaps(prof, backends, top=12):
    """The longest idle stretches of the GPU between kernels inside the profiled steps (each marked
    ``probe-step <index> <backend>``), and the host operations running longest across each (any thread)."""
    events = [e for e in prof.events() if e.time_range.end > e.time_range.start]
    gpu = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type.name == "CUDA")
    cpu = [e for e in events if e.device_type.name == "CPU"]
    steps = sorted((e.time_range.start, e.time_range.end, e.name.split(" ", 2)[2]) for e in cpu
                   if e.name.startswith("probe-step "))
    gaps = []
    for (_, end0), (start1, _) in zip(gpu, gpu[1:], strict=False):
        backend = next((name for s0, s1, name in steps if s0 <= end0 <= s1), None)
        if start1 - end0 > 500 and backend is not None:  # us, inside a step
            gaps.append((start1 - end0, end0, start1, backend))
    gaps.sort(reverse=True)
    print("| gap ms | backend | host operations spanning the gap (longest first, ms) |")
    print("| ---: | --- | --- |")
    for length, g0, g1, backend in gaps[:top]:
        spans = sorted((e for e in cpu if e.time_range.start <= g1 and e.time_range.end >= g0
                        and not e.name.startswith(("probe-step ", "ProfilerStep"))),
                       key=lambda e: -(e.time_range.end - e.time_range.start))[:4]
        text = "; ".join(f"{e.name} [{(e.time_range.end - e.time_range.start) / 1e3:.1f}, thread {e.thread}]"
                         for e in spans)
        print(f"| {length / 1e3:.2f} | {backend} | {text} |")
    for name in backends:
        total = sum(length for length, _, _, backend in gaps if backend == name)
        print(f"{name}: GPU idle in gaps > 0.5 ms inside steps: {total / 1e3:.1f} ms in all")
    print()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="2.7B")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--order", default="sdpa,flash_triton")
    p.add_argument("--smi", action="store_true")
    p.add_argument("--trace", action="store_true", help="profile the measured steps (torch.profiler) and print the "
                   "longest GPU idle gaps of each backend with what the host was doing meanwhile")
    a = p.parse_args()
    ft._backward = _timed_backward(ft._backward)
    backends = a.order.split(",")
    config = ModelConfig.from_size(a.size, context_length=a.context)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = TransformerLM(config)
    attn = {name: get_attention(name.split(":")[0]) for name in backends}
    blocks = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    opt = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    total = a.warmup + a.steps * len(backends)
    batches = torch.randint(0, config.vocab_size, (total, a.batch, a.context + 1), device="cuda")
    smi = None
    if a.smi:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                                "--format=csv,noheader,nounits", "-lms", "20"], stdout=subprocess.PIPE, text=True)
    rows = []
    t_origin = time.time()
    prof = None
    for i in range(total):
        if a.trace and i == a.warmup:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        name = backends[i % len(backends)]
        setting = name.partition(":")[2]  # e.g. flash_triton:LMTRAIN_FLASH_LAUNCH_PLANS=0, for this step only
        for item in setting.split("+") if setting else []:
            var, _, value = item.partition("=")
            os.environ[var] = value
        for b in blocks:
            b.attention = attn[name]
        mark = torch.profiler.record_function(f"probe-step {i} {name}") if prof is not None else \
            contextlib.nullcontext()
        mark.__enter__()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        _ATTN_HOST.clear()
        w0 = time.time()
        ev[0].record()
        inputs, targets = batches[i, :, :-1], batches[i, :, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        ev[1].record()
        h0 = time.perf_counter()
        loss.backward()
        host_bwd = time.perf_counter() - h0
        ev[2].record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ev[3].record()
        torch.cuda.synchronize()
        mark.__exit__(None, None, None)
        w1 = time.time()
        for item in setting.split("+") if setting else []:
            os.environ.pop(item.partition("=")[0], None)
        if i < a.warmup:
            continue
        rows.append(dict(backend=name, step=i, fwd=ev[0].elapsed_time(ev[1]), bwd=ev[1].elapsed_time(ev[2]),
                         opt=ev[2].elapsed_time(ev[3]), host_bwd=host_bwd * 1e3,
                         attn_host=sum(_ATTN_HOST) * 1e3, attn_max=max(_ATTN_HOST, default=0.0) * 1e3,
                         retries=torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0,
                         t0=w0 - t_origin, t1=w1 - t_origin))
    if prof is not None:
        prof.__exit__(None, None, None)
        _gaps(prof, backends)
    samples = []
    if smi is not None:
        smi.terminate()
        out = smi.communicate()[0]
        for line in out.splitlines():
            parts = [s.strip() for s in line.split(",")]
            with contextlib.suppress(ValueError, IndexError):
                ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
                ts += float("0." + parts[0].split(".")[1]) - t_origin
                samples.append((ts, float(parts[1]), float(parts[2]), float(parts[3])))
    print("backend,step,fwd_ms,bwd_ms,opt_ms,host_bwd_ms,attn_host_ms,attn_max_ms,retries,sm_mhz_min,power_w_max")
    for r in rows:
        inside = [s for s in samples if r["t0"] <= s[0] <= r["t1"]]
        clk = min((s[1] for s in inside), default=float("nan"))
        pwr = max((s[2] for s in inside), default=float("nan"))
        print(f"{r['backend']},{r['step']},{r['fwd']:.2f},{r['bwd']:.2f},{r['opt']:.2f},{r['host_bwd']:.2f},"
              f"{r['attn_host']:.2f},{r['attn_max']:.2f},{r['retries']},{clk:.0f},{pwr:.0f}")
    print()
    print("| backend | steps | bwd median | bwd max | bwd std | host bwd median | host bwd max | attn host median |"
          " attn max call | slow steps (bwd > median + 5 ms) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in backends:
        rs = [r for r in rows if r["backend"] == name]
        bwd = [r["bwd"] for r in rs]
        med = statistics.median(bwd)
        slow = sum(b > med + 5 for b in bwd)
        print(f"| {name} | {len(rs)} | {med:.2f} | {max(bwd):.2f} | {statistics.pstdev(bwd):.2f} | "
              f"{statistics.median(r['host_bwd'] for r in rs):.2f} | {max(r['host_bwd'] for r in rs):.2f} | "
              f"{statistics.median(r['attn_host'] for r in rs):.2f} | {max(r['attn_max'] for r in rs):.2f} | {slow} |")


if __name__ == "__main__":
    main()
