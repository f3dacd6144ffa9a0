"""A/B: previous flash_triton (4 launches, Triton's tuning bench) vs current (3 launches, L2-sized tuning flush)."""
import importlib.util, statistics, sys, time
import torch
import triton.testing

sys.path.insert(0, ".")
from lmtrain.kernels import flash_triton as new
spec = importlib.util.spec_from_file_location("flash_old", "scratch/flash_old.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
VERS = {"old": old, "new": new}

def inputs(b, h, n, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(4)]

def fwd_bwd(mod, q, k, v, do, causal):
    o = mod.flash_attention(q, k, v, causal=causal)
    o.backward(do)
    return o

rows = []
# 1) first-call memory transient (tuning) and correctness vs fp64, per version, fresh tuning key per version
for name, mod in VERS.items():
    q, k, v, do = inputs(2, 3, 3000, 48, torch.float16, seed=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    peaks = []
    for _ in range(2):
        torch.cuda.synchronize(); base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
        o = fwd_bwd(mod, *leaves, do, True); torch.cuda.synchronize()
        peaks.append((torch.cuda.max_memory_allocated() - base) / 2**20)
        grads = [t.grad.clone() for t in leaves]
        for t in leaves: t.grad = None
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ro = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True); ro.backward(do.double())
    err = max((a.double() - b).abs().max().item() for a, b in zip([o] + grads, [ro] + [t.grad for t in ref]))
    print(f"{name}: first-call peak {peaks[0]:.1f} MiB, second {peaks[1]:.1f} MiB, max abs err vs fp64 {err:.2e}", flush=True)
    rows.append((name, "tuning transient MiB", peaks[0] - peaks[1]))

# 2) GPU time, alternating versions (tuned; configs printed)
shapes = [(16, 16, 1024, 64, True), (4, 16, 4096, 64, True), (1, 8, 16384, 64, True),
          (4, 16, 4096, 80, True), (4, 16, 4096, 128, True), (4, 16, 4096, 128, False)]
gpu = {}
for (b, h, n, d, causal) in shapes:
    q, k, v, do = inputs(b, h, n, d, seed=n + d)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    for name, mod in VERS.items():
        fwd_bwd(mod, *leaves, do, causal)  # tune
    for rnd in range(3):
        for name, mod in VERS.items():
            f = lambda: mod.flash_attention(*leaves, causal=causal)
            fb = lambda: fwd_bwd(mod, *leaves, do, causal)
            t_f = triton.testing.do_bench(f, warmup=10, rep=100, return_mode="median")
            t_fb = triton.testing.do_bench(fb, warmup=10, rep=100, grad_to_none=leaves, return_mode="median")
            gpu.setdefault((b, h, n, d, causal, name), []).append((t_f, t_fb))
    chosen = {nm: [(getattr(getattr(kk[0], "base_fn", None), "__name__", "?"), c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                   for kk, c in m._CHOSEN.items() if kk[2] == d and kk[3] == causal and kk[1] == m._n_key(n, n)] for nm, m in VERS.items()}
    print(f"shape B{b} H{h} N{n} d{d} causal={causal} chosen: {chosen}", flush=True)

# 3) host time per fwd+bwd call at small size (launch-bound), alternating, bursts of 16 after 4 untimed
host = {}
for (b, h, n, d) in [(1, 12, 128, 64), (1, 12, 512, 64), (4, 32, 128, 80)]:
    q, k, v, do = inputs(b, h, n, d, seed=7)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    for name, mod in VERS.items():
        fwd_bwd(mod, *leaves, do, True)
    for rnd in range(30):
        for name, mod in (VERS.items() if rnd % 2 == 0 else reversed(list(VERS.items()))):
            torch.cuda.synchronize()
            for _ in range(4): fwd_bwd(mod, *leaves, do, True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(16): fwd_bwd(mod, *leaves, do, True)
            t1 = time.perf_counter()
            host.setdefault((b, h, n, d, name), []).append((t1 - t0) / 16 * 1e6)
            for t in leaves: t.grad = None

print("\n| shape | old fwd ms | new fwd ms | new/old | old fwd+bwd ms | new fwd+bwd ms | new/old |")
print("|---|---|---|---|---|---|---|")
for (b, h, n, d, causal) in shapes:
    o_ = [statistics.median(x[i] for x in gpu[(b, h, n, d, causal, "old")]) for i in (0, 1)]
    n_ = [statistics.median(x[i] for x in gpu[(b, h, n, d, causal, "new")]) for i in (0, 1)]
    print(f"| B{b} H{h} N{n} d{d} {'causal' if causal else 'full'} | {o_[0]:.3f} | {n_[0]:.3f} | {n_[0]/o_[0]:.3f} | {o_[1]:.3f} | {n_[1]:.3f} | {n_[1]/o_[1]:.3f} |")
print("\n| shape (bf16 causal) | old host us per fwd+bwd | new host us | new/old |")
print("|---|---|---|---|")
for (b, h, n, d) in [(1, 12, 128, 64), (1, 12, 512, 64), (4, 32, 128, 80)]:
    o_ = statistics.median(host[(b, h, n, d, "old")]); n_ = statistics.median(host[(b, h, n, d, "new")])
    print(f"| B{b} H{h} N{n} d{d} | {o_:.1f} | {n_:.1f} | {n_/o_:.3f} |")
for r in rows: print(r)
