"""Split the host time of flash_attention(...).backward(do): call -> backward entry -> kernels issued -> return."""
import statistics, time, threading
import torch
import torch.nn.functional as F
from lmtrain.kernels import flash_triton as ft

g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = [torch.randn(1, 12, 128, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
marks = {}
orig = ft._backward
def wrapped(*a, **kw):
    marks["enter"] = time.perf_counter()
    r = orig(*a, **kw)
    marks["exit"] = time.perf_counter()
    return r
ft._backward = wrapped
rows = {"fwd": [], "to_entry": [], "in_backward": [], "to_return": [], "total": []}
for i in range(400):
    if i % 16 == 0:
        torch.cuda.synchronize()
        for t in leaves: t.grad = None
    t0 = time.perf_counter()
    o = ft.flash_attention(*leaves, causal=True)
    t1 = time.perf_counter()
    o.backward(do)
    t2 = time.perf_counter()
    if i > 50:
        rows["fwd"].append(t1 - t0); rows["to_entry"].append(marks["enter"] - t1)
        rows["in_backward"].append(marks["exit"] - marks["enter"]); rows["to_return"].append(t2 - marks["exit"])
        rows["total"].append(t2 - t0)
print("| phase | median us |\n|---|---|")
for kk, xs in rows.items():
    print(f"| {kk} | {statistics.median(xs) * 1e6:.1f} |")
print("thread of backward:", "main" if threading.current_thread() is threading.main_thread() else "other")
# the same for sdpa, and for direct _backward called from a worker thread
rows2 = []
for i in range(400):
    if i % 16 == 0:
        torch.cuda.synchronize()
        for t in leaves: t.grad = None
    t0 = time.perf_counter()
    F.scaled_dot_product_attention(*leaves, is_causal=True).backward(do)
    rows2.append(time.perf_counter() - t0)
print("sdpa fwd+bwd median us", statistics.median(rows2[50:]) * 1e6)
o, lse = ft._forward(q, k, v, True)
res = []
def worker():
    for i in range(400):
        if i % 16 == 0: torch.cuda.synchronize()
        t0 = time.perf_counter(); orig(do, q, k, v, o, lse, True); res.append(time.perf_counter() - t0)
th = threading.Thread(target=worker); th.start(); th.join()
print("direct _backward in a thread, median us", statistics.median(res[50:]) * 1e6)
res.clear(); worker()
print("direct _backward in main thread, median us", statistics.median(res[50:]) * 1e6)
