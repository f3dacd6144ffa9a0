"""Where the host time of one flash_triton fwd+bwd goes (B1 H12 N128 d64 bf16 causal)."""
import cProfile, pstats, statistics, time, io
import torch
import torch.nn.functional as F
from lmtrain.kernels import flash_triton as ft

g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = [torch.randn(1, 12, 128, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
o, lse = ft._forward(q, k, v, True)

def flash_fb():
    ft.flash_attention(*leaves, causal=True).backward(do)
def sdpa_fb():
    F.scaled_dot_product_attention(*leaves, is_causal=True).backward(do)
def flash_f():
    ft.flash_attention(q, k, v, causal=True)
def direct_fwd():
    ft._forward(q, k, v, True)
def direct_bwd():
    ft._backward(do, q, k, v, o, lse, True)
n_key = ft._n_key(128, 128)
q4 = q
args = (q4, k, v, o, lse, *q4.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], 12, 128, 128, n_key, 0.125 * ft._LOG2E)
consts = dict(HEAD_DIM=64, BLOCK_D=64, IS_CAUSAL=True, DOT_PRECISION="ieee")
def one_launch():
    ft._launch(ft._fwd_kernel, lambda m: (triton_cdiv(128, m["BLOCK_M"]) * 12,), args, consts, (n_key, 64, True, "ieee", q.dtype))
def triton_cdiv(a, b): return -(-a // b)
def empty_autograd_fn():
    class F_(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x): return x.clone()
        @staticmethod
        def backward(ctx, g): return g
    return F_
EF = empty_autograd_fn()
def autograd_only():
    EF.apply(leaves[0]).backward(do)

fns = dict(flash_fwd_bwd=flash_fb, sdpa_fwd_bwd=sdpa_fb, flash_fwd=flash_f, direct_fwd=direct_fwd,
           direct_bwd=direct_bwd, one_fwd_launch=one_launch, pyfunction_clone_fwd_bwd=autograd_only)
for f in fns.values():
    for _ in range(5): f()
torch.cuda.synchronize()
res = {name: [] for name in fns}
for rnd in range(40):
    for name, f in fns.items():
        torch.cuda.synchronize()
        for _ in range(4): f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(16): f()
        res[name].append((time.perf_counter() - t0) / 16 * 1e6)
        for t in leaves: t.grad = None
torch.cuda.synchronize()
pr = cProfile.Profile()
pr.enable()
for _ in range(300):
    flash_fb()
    if _ % 16 == 0: torch.cuda.synchronize()
pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue()[-4500:])
print("| call | host us (median of 40 bursts) |\n|---|---|")
for name, xs in res.items():
    print(f"| {name} | {statistics.median(xs):.1f} |")
