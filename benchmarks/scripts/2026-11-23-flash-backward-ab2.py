"""GPU-bound A/B at N 1024: old (preprocess + dK/dV + dQ) vs new (dQ with D + dK/dV); big batch so host time hides."""
import importlib.util, statistics, sys
import torch, triton.testing
sys.path.insert(0, ".")
from lmtrain.kernels import flash_triton as new
spec = importlib.util.spec_from_file_location("flash_old", "scratch/flash_old.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
print("| shape | old bwd ms | new bwd ms | new/old | old fwd+bwd ms | new fwd+bwd ms | new/old |\n|---|---|---|---|---|---|---|")
for (b, h, n, d) in [(64, 16, 1024, 64), (16, 16, 1024, 64), (32, 32, 1024, 80), (8, 16, 4096, 64)]:
    g = torch.Generator(device="cuda").manual_seed(n + b)
    q, k, v, do = [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]
    res = {}
    for _ in range(2):
        for name, m in (("old", old), ("new", new)):
            o, lse = m._forward(q, k, v, True)
            m._backward(do, q, k, v, o, lse, True)
            tb = triton.testing.do_bench(lambda: m._backward(do, q, k, v, o, lse, True), warmup=20, rep=200, return_mode="median")
            tf = triton.testing.do_bench(lambda: (m._forward(q, k, v, True), m._backward(do, q, k, v, o, lse, True)), warmup=20, rep=200, return_mode="median")
            res.setdefault(name, []).append((tb, tf))
    ob, of = [min(x[i] for x in res["old"]) for i in (0, 1)]
    nb, nf = [min(x[i] for x in res["new"]) for i in (0, 1)]
    print(f"| B{b} H{h} N{n} d{d} | {ob:.3f} | {nb:.3f} | {nb/ob:.3f} | {of:.3f} | {nf:.3f} | {nf/of:.3f} |")
