"""Where a Gluon forward tile's time goes (run on the GPU machine): a copy of ``flash_gluon_hopper``'s forward kernel
with clock stamps (``%clock64``, the multiprocessor's cycle counter) at eight points of every tile of the first
eight programs' consumers, run once on a bf16 causal problem (16 heads, B*H*N = 2^21); then the mean cycles of each
phase per class of tile, and the stamped kernel's time beside the unstamped one's.

    PYTHONPATH=. python benchmarks/scripts/gluon_fwd_stamps.py --head-dim 64 --seq-lens 1024 4096

Phases, per consumer and tile: ``qwait`` its queries' barrier; ``k0wait`` key block 0's barrier; ``s0`` block 0's
``Q K^T`` (issue to completion); ``sm0`` block 0's softmax; ``loop`` the overlapped blocks (each block's ``Q K^T``
with the previous block's ``P V``); ``tail`` the last block (and its ``P V``, with the half-width diagonal block where
it applies); ``epi`` the output's normalisation and copy; ``gap`` from there to the next tile's first stamp (the next
tile's lookup). Tiles are classed by ``2 * blocks - half``: the key blocks the consumer works on, a half-width last
block counting one half (odd classes: the first consumer on the diagonal). The stamps cost a few instructions each;
the table compares the stamped kernel's time with the unstamped one's.
"""
import argparse
import importlib.util
import os
import sys
import tempfile

import torch

from lmtrain.kernels import flash_gluon_hopper as fg

sys.path.insert(0, os.path.dirname(__file__))
from gluon_probe import _median_ms, poisoned  # noqa: E402

PROGRAMS, TILES, SLOTS = 8, 64, 16  # stamped programs, tiles per consumer, slots per tile (8 stamps + the class)
PHASES = ("qwait", "k0wait", "s0", "sm0", "loop", "tail", "epi", "gap")


def _patch(src: str, old: str, new: str, count: int = 1) -> str:
    if src.count(old) != count:
        raise SystemExit(f"the forward kernel changed: {old.strip()[:60]!r} found {src.count(old)} times, not {count}")
    return src.replace(old, new)


def stamped_source(src: str) -> str:
    """``flash_gluon_hopper``'s source with the stamps in ``_fwd_consumer`` and a ``TS`` (int64 pointer) argument
    threaded through ``_fwd_kernel`` and ``forward_args``."""
    src = _patch(src, "    @gluon.jit\n    def _online_softmax(", '''    @gluon.jit
    def _clk():
        return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)

    @gluon.jit
    def _stamp(TS, slot, e, ok):
        if ok:
            gl.store(TS + slot + e, _clk())

    @gluon.jit
    def _online_softmax(''')
    src = _patch(src, "PINGPONG: gl.constexpr):\n        \"\"\"One warpgroup: query rows",
                 "PINGPONG: gl.constexpr, TS=None):\n        \"\"\"One warpgroup: query rows")
    c0, c1 = src.index("    def _fwd_consumer("), src.index("    def _fwd_kernel(")
    body = src[c0:c1]
    body = _patch(body, "        lo, hi, step = _items(NUM_TILES, N_Q, BLOCK_T, ITEMS)\n",
                  "        lo, hi, step = _items(NUM_TILES, N_Q, BLOCK_T, ITEMS)\n"
                  f"        base = (gl.program_id(0) * NUM_WG + WG) * {TILES * SLOTS}\n")
    pre = "                stage = c % NUM_STAGES\n                mbarrier.wait(q_ready.index(WG), it & 1)\n"
    body = _patch(body, pre,
                  "                stage = c % NUM_STAGES\n"
                  f"                ok = (gl.program_id(0) < {PROGRAMS}) & (it < {TILES})\n"
                  f"                slot = base + it * {SLOTS}\n"
                  "                _stamp(TS, slot, 0, ok)\n"
                  "                if ok:\n"
                  "                    gl.store(TS + slot + 8, (n_mine * 2 - half).to(gl.int64))\n"
                  "                mbarrier.wait(q_ready.index(WG), it & 1)\n"
                  "                _stamp(TS, slot, 1, ok)\n")
    body = _patch(body, "                k = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])\n"
                  "                _turn_wait(turns, turn, WG, PINGPONG)\n                s_tok",
                  "                _stamp(TS, slot, 2, ok)\n"
                  "                k = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])\n"
                  "                _turn_wait(turns, turn, WG, PINGPONG)\n                s_tok")
    body = _patch(body, "                s = warpgroup_mma_wait(0, deps=(s_tok,))\n"
                  "                mbarrier.arrive(k_empty.index(stage), count=1)\n",
                  "                s = warpgroup_mma_wait(0, deps=(s_tok,))\n"
                  "                _stamp(TS, slot, 3, ok)\n"
                  "                mbarrier.arrive(k_empty.index(stage), count=1)\n")
    body = _patch(body, "                acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)\n\n",
                  "                acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)\n"
                  "                _stamp(TS, slot, 4, ok)\n\n")
    body = _patch(body, "                last = (c + n_mine - 1) % NUM_STAGES\n",
                  "                _stamp(TS, slot, 5, ok)\n                last = (c + n_mine - 1) % NUM_STAGES\n")
    body = _patch(body, "                turn += 1\n                mbarrier.arrive(v_empty.index(last), count=1)\n",
                  "                turn += 1\n                _stamp(TS, slot, 6, ok)\n"
                  "                mbarrier.arrive(v_empty.index(last), count=1)\n")
    body = _patch(body, "                c += n_blocks\n                it += 1\n",
                  "                _stamp(TS, slot, 7, ok)\n                c += n_blocks\n                it += 1\n")
    src = src[:c0] + body + src[c1:]
    src = _patch(src, "PINGPONG: gl.constexpr):\n        \"\"\"Program p takes tiles",
                 "PINGPONG: gl.constexpr, TS=None):\n        \"\"\"Program p takes tiles")
    k0, k1 = src.index("    def _fwd_kernel("), src.index("# Backward: dQ")
    kernel = src[k0:k1]
    calls = kernel.count("REG_A, ITEMS, PINGPONG)),")
    kernel = _patch(kernel, "REG_A, ITEMS, PINGPONG)),", "REG_A, ITEMS, PINGPONG, TS)),", calls)
    src = src[:k0] + kernel + src[k1:]
    f0 = src.index("def forward_args(")
    f1 = src.index("\ndef ", f0 + 1)
    fn = _patch(src[f0:f1], "programs: int | None = None)", "programs: int | None = None, TS=None)")
    fn = _patch(fn, "return grid, args, dict(", "return grid, args, dict(TS=TS, ")
    return src[:f0] + fn + src[f1:]

def load_stamped():
    with open(fg.__file__) as f:
        src = stamped_source(f.read())
    path = os.path.join(tempfile.mkdtemp(), "flash_gluon_stamped.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("lmtrain.kernels._flash_gluon_stamped", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    a = p.parse_args()
    st = load_stamped()
    d = a.head_dim
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for n in a.seq_lens:
        b, h = 2**21 // (16 * n), 16
        q, k, v, do, o, lse, *_ = poisoned(b, h, n, d)
        cfg = fg.config(fg.FWD, d, n)
        ts = torch.zeros(PROGRAMS * cfg.num_wg * TILES * SLOTS, dtype=torch.int64, device="cuda")
        stamped = (st._fwd_kernel, st.forward_args(q, k, v, o, lse, True, TS=ts))
        plain = (fg._fwd_kernel, fg.forward_args(q, k, v, o, lse, True))
        runs = {"plain": [], "stamped": []}
        for _ in range(3):
            runs["plain"].append(_median_ms(*plain))
            runs["stamped"].append(_median_ms(*stamped))
        ts.zero_()
        grid, args, kwargs = stamped[1]
        st._fwd_kernel[grid](*args, **kwargs)
        torch.cuda.synchronize()
        t = ts.view(PROGRAMS, cfg.num_wg, TILES, SLOTS).cpu()
        print(f"\nd {d}, N {n}, configuration {cfg}: plain {min(runs['plain']):.3f} ms, stamped "
              f"{min(runs['stamped']):.3f} ms (fastest of 3)")
        print("| consumer | 2 * blocks - half | tiles | " + " | ".join(PHASES) + " | total |")
        print("| ---: | ---: | ---: | " + " | ".join("---:" for _ in PHASES) + " | ---: |")
        for wg in range(cfg.num_wg):
            classes = {}
            for prog in range(PROGRAMS):
                for i in range(TILES - 1):
                    e, nxt = t[prog, wg, i].tolist(), t[prog, wg, i + 1].tolist()
                    if e[0] == 0 or e[7] == 0 or nxt[0] == 0:
                        continue
                    phases = [e[j + 1] - e[j] for j in range(7)] + [nxt[0] - e[7], nxt[0] - e[0]]
                    classes.setdefault(e[8], []).append(phases)
            for cls in sorted(classes):
                rows = classes[cls]
                means = [sum(col) / len(rows) for col in zip(*rows, strict=True)]
                print(f"| {wg} | {cls} | {len(rows)} | " + " | ".join(f"{x:.0f}" for x in means) + " |", flush=True)


if __name__ == "__main__":
    main()
