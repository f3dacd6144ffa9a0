"""How much slower a GEMM runs beside a collective than alone, per setting: what KernelShare's
``kernels/compute_beside_comm_slowdown`` measures in a training step, isolated.

Run with torchrun, one process per GPU (NVLink multicast off, as in every lmtrain measurement on these machines);
NCCL's own settings come from the environment, so each NCCL setting is its own run:

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 benchmarks/scripts/comm_interference_probe.py \
        [--op all_reduce] [--mib 100] [--gemm 8192,6400,1600] [--gemms 10] [--carveout 0 16 32]
    NCCL_PROTO=Simple NCCL_NVLS_ENABLE=0 torchrun ... (the same)

A smoke test on the CPU (gloo, fp32, the host clock): ``--device cpu --mib 1 --gemm 64,64,64 --gemms 2``.

Per ``--carveout`` value (SMs that the matrix products leave free, ``torch._C._set_sm_carveout_experimental``;
0: none) it times, on random bf16 data (fp32 on the CPU), medians of ``--repeats`` after 3 warm-ups. PyTorch
applies the carve-out on its cuBLASLt path only, so with any carve-out above 0 every setting of the run, 0 included,
runs its products through cuBLASLt (``torch.backends.cuda.preferred_blas_library``; each row names the library):

- ``comm_ms``: the collective alone;
- ``gemms_alone_ms``: ``--gemms`` products of the ``--gemm`` M,N,K shape back to back, alone;
- ``gemms_beside_ms``: the same products while the collective runs on a side stream, started just before them
  (repeated ``--comm-repeats`` times, so that it outlasts the products: every product then runs beside it; the
  line says when it did not);
- ``slowdown``: beside / alone; ``together_ms``: the products and the collectives from start to end.

Rank 0 prints one JSON line per setting and a table. Exit status 0, or 2 for bad options.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lmtrain.analysis.tables import markdown_table
from lmtrain.bench.clock import Clock

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cuda: NCCL, one GPU per rank; cpu: gloo")
    p.add_argument("--op", choices=OPS, default="all_reduce", help="the collective")
    p.add_argument("--mib", type=float, default=100.0, help="the collective's whole buffer, MiB (DDP's bucket: 100)")
    p.add_argument("--gemm", default="8192,6400,1600",
                   help="M,N,K of one product (default: xl's MLP down projection at 8,192 tokens)")
    p.add_argument("--gemms", type=int, default=10, help="products per burst")
    p.add_argument("--comm-repeats", type=int, default=4, help="collectives per burst beside the products")
    p.add_argument("--repeats", type=int, default=20, help="timed bursts per measurement (median)")
    p.add_argument("--carveout", type=int, nargs="+", default=[0],
                   help="SMs cuBLAS leaves free, one setting each (CUDA only; 0: none)")
    args = p.parse_args(argv)
    try:
        args.shape = tuple(int(x) for x in args.gemm.split(","))
    except ValueError:
        p.error(f"--gemm: give M,N,K as three integers, got {args.gemm!r}")
    if len(args.shape) != 3 or min(args.shape) < 1:
        p.error(f"--gemm: give M,N,K as three positive integers, got {args.gemm!r}")
    for name in ("gemms", "comm_repeats", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be at least 1")
    if args.mib <= 0:
        p.error("--mib: must be above 0")
    if args.device == "cpu" and any(args.carveout):
        p.error("--carveout: CUDA only (give 0 with --device cpu)")
    if min(args.carveout) < 0:
        p.error("--carveout: SMs left free cannot be negative")
    return args


def repeated(fn: Callable[[], Any], repeats: int, clock: Clock) -> list[Any]:
    """``fn``'s results over ``repeats`` runs after 3 warm-ups, the ranks starting each run together."""
    for _ in range(3):
        fn()
    clock.sync()
    out = []
    for _ in range(repeats):
        dist.barrier()
        out.append(fn())
    return out


def refuse(rank: int, message: str) -> int:
    """One line on rank 0, the process group ended, exit status 2."""
    if rank == 0:
        print(f"error: {message}", file=sys.stderr)
    dist.destroy_process_group()
    return 2


def collective(op: str, buf: torch.Tensor, out: torch.Tensor | None) -> Callable[[bool], object]:
    """The collective on these buffers, as ``fn(async_op)``."""
    if op == "all_reduce":
        return lambda async_op=False: dist.all_reduce(buf, async_op=async_op)
    if op == "all_gather":
        return lambda async_op=False: dist.all_gather_into_tensor(out, buf, async_op=async_op)
    return lambda async_op=False: dist.reduce_scatter_tensor(out, buf, async_op=async_op)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    blas = "-"
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if not all(0 <= c < sms for c in args.carveout):
            return refuse(rank, f"--carveout: each value must be in [0, {sms}) on this GPU")
        if any(args.carveout):
            torch.backends.cuda.preferred_blas_library("cublaslt")
        blas = str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1]
    torch.manual_seed(rank)
    elements = int(args.mib * 2**20) // dtype.itemsize // world * world  # divisible by the ranks
    if elements < world:
        return refuse(rank, f"--mib: {args.mib} MiB is less than one element per rank")
    m, n, k = args.shape
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    if args.op == "all_reduce":
        buf, out = torch.randn(elements, device=device, dtype=dtype), None
    elif args.op == "all_gather":
        buf = torch.randn(elements // world, device=device, dtype=dtype)
        out = torch.full((elements,), float("nan"), device=device, dtype=dtype)
    else:
        buf = torch.randn(elements, device=device, dtype=dtype)
        out = torch.full((elements // world,), float("nan"), device=device, dtype=dtype)
    comm = collective(args.op, buf, out)
    clock = Clock(device.type == "cuda")
    side = torch.cuda.Stream() if device.type == "cuda" else None

    def gemms() -> None:
        for _ in range(args.gemms):
            torch.mm(a, b)

    def comms() -> None:
        for _ in range(args.comm_repeats):
            comm()

    def timed(fn: Callable[[], None]) -> Callable[[], float]:
        def run() -> float:
            start = clock.mark()
            fn()
            end = clock.mark()
            clock.sync()
            return clock.ms(start, end)

        return run

    def beside() -> tuple[float, float]:
        """(products' ms, whole burst's ms): the collectives started first (on the side stream; on the CPU gloo
        runs them on its own threads), then the products on this stream."""
        first = clock.mark()
        if side is None:
            handles = [comm(True) for _ in range(args.comm_repeats)]
        else:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                comms()
        mid = clock.mark()
        gemms()
        done = clock.mark()
        if side is None:
            for handle in handles:
                handle.wait()
        else:
            torch.cuda.current_stream().wait_stream(side)
        end = clock.mark()
        clock.sync()
        return clock.ms(mid, done), clock.ms(first, end)

    rows = []
    for carveout in args.carveout:
        if device.type == "cuda":
            torch._C._set_sm_carveout_experimental(carveout or None)
        comm_ms = statistics.median(repeated(timed(comms), args.repeats, clock)) / args.comm_repeats
        alone_ms = statistics.median(repeated(timed(gemms), args.repeats, clock))
        pairs = repeated(beside, args.repeats, clock)
        beside_ms = statistics.median(p for p, _ in pairs)
        together_ms = statistics.median(t for _, t in pairs)
        nccl = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_") and k != "NCCL_NVLS_ENABLE"}
        row = {"op": args.op, "mib": args.mib, "gemm": list(args.shape), "gemms": args.gemms, "world_size": world,
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "carveout": carveout,
               "blas": blas,
               "nccl_env": nccl, "comm_ms": comm_ms, "gemms_alone_ms": alone_ms, "gemms_beside_ms": beside_ms,
               "slowdown": beside_ms / alone_ms, "together_ms": together_ms,
               "comm_outlasts_gemms": comm_ms * args.comm_repeats >= beside_ms}
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if device.type == "cuda":
        torch._C._set_sm_carveout_experimental(None)
    if rank == 0:
        first = " (the collectives ended first)"
        table = [[r["carveout"], r["blas"], " ".join(f"{k}={v}" for k, v in r["nccl_env"].items()) or "default",
                  f"{r['comm_ms']:.3f}", f"{r['gemms_alone_ms']:.3f}",
                  f"{r['gemms_beside_ms']:.3f}" + ("" if r["comm_outlasts_gemms"] else first),
                  f"{r['slowdown']:.3f}", f"{r['together_ms']:.3f}"] for r in rows]
        print("\n" + markdown_table(["carveout", "BLAS", "NCCL settings", "comm ms", "GEMMs alone ms",
                                     "GEMMs beside ms", "slowdown", "together ms"], table))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
