"""The order in which single tiles go out when each program takes one tile (run on the GPU machine): head by head
against position by position (every head's longest causal tile first; ``flash_gluon_hopper._item_tile``'s ITEMS 2,
which the library takes where persistent pairs fell back and heads are few, ``_few_heads``). The probe forces one
order or the other on every launch of one program per tile. First the float64 check of every Gluon kernel with tiles
position by position wherever one program takes one tile; then each kernel alone, four runs per order (interleaved),
in milliseconds, on shapes whose launches take one program per tile: the leaderboard's 1 x 16 heads x 16384 (forward
and dQ fall back from persistent pairs there) at head dims 64 and 128, and the dK/dV kernel of the acceptance grid's
N 4096 and 16384 cells (one program per tile by configuration).

    PYTHONPATH=. python benchmarks/scripts/gluon_order_probe.py [--no-check]

With head-by-head order and few heads, the last head's longest tiles start late and the end of the launch waits for
them; position by position, the longest tiles of all heads go first.
"""
import argparse
import os
import sys
import time

import torch

from lmtrain.kernels import flash_gluon_hopper as fg

sys.path.insert(0, os.path.dirname(__file__))
from gluon_probe import _median_ms, check, poisoned  # noqa: E402

_LAUNCH_SHAPE = fg._launch_shape


def force_order(order: str) -> None:
    """Every launch of one program per tile from here on takes its tiles ``order`` ("head" or "position")."""
    def launch_shape(*args, **kwargs):
        grid, tiles, options = _LAUNCH_SHAPE(*args, **kwargs)
        if options["ITEMS"] != 1:
            options = dict(options, ITEMS=2 if order == "position" else 0)
        return grid, tiles, options

    fg._launch_shape = launch_shape


def time_case(b: int, h: int, n: int, d: int, kernels: tuple[str, ...]) -> None:
    """Print a row per kernel: four runs per order, interleaved, and the ratio of the fastest runs."""
    force_order("head")
    q, k, v, do, o, lse, dq, dk, dv, delta = poisoned(b, h, n, d)
    launches = {"fwd": (fg._fwd_kernel, fg.FWD, lambda: fg.forward_args(q, k, v, o, lse, True)),
                "dq": (fg._dq_kernel, fg.DQ, lambda: fg.dq_args(q, k, v, o, do, dq, lse, delta, True)),
                "dkdv": (fg._dkdv_kernel, fg.DKDV, lambda: fg.dkdv_args(q, k, v, do, dk, dv, lse, delta, True))}
    for name in kernels:
        kernel, mode, args = launches[name]
        runs = {"head": [], "position": []}
        for _ in range(4):
            for order in ("head", "position"):
                force_order(order)
                runs[order].append(_median_ms(kernel, args()))
        cfg = ",".join(map(str, fg.dataclasses.astuple(fg.config(mode, d, n))))
        print(f"| {b}x{h}x{n} d{d} | {name} | {cfg} | " + ", ".join(f"{x:.3f}" for x in runs["head"]) + " | "
              + ", ".join(f"{x:.3f}" for x in runs["position"])
              + f" | {min(runs['position']) / min(runs['head']):.3f} |", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--no-check", action="store_true")
    a = p.parse_args()
    t0 = time.time()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if not a.no_check:
        force_order("position")
        ok = check(None, "all")
        print("CHECK", "PASSED" if ok else "FAILED", f"{time.time() - t0:.0f}s", flush=True)
        if not ok:
            sys.exit(1)
    print("\n| shape | kernel | config | head by head, ms | position by position, ms | position / head (fastest) |")
    print("| --- | --- | --- | --- | --- | ---: |")
    for b, h, n, d, kernels in [(1, 16, 16384, 64, ("fwd", "dq", "dkdv")), (1, 16, 16384, 128, ("fwd", "dq", "dkdv")),
                                (32, 16, 4096, 64, ("dkdv",)), (8, 16, 16384, 64, ("dkdv",)),
                                (8, 16, 16384, 128, ("dkdv",))]:
        time_case(b, h, n, d, kernels)
    fg._launch_shape = _LAUNCH_SHAPE
    print(f"{time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
