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
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

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


class Clock:
    """Elapsed milliseconds of a callable: CUDA events on the current stream, or the host clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], None]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3


def median_ms(clock: Clock, fn: Callable[[], None], repeats: int) -> float:
    for _ in range(3):
        fn()
    sync()
    dist.barrier()
    times = []
    for _ in range(repeats):
        dist.barrier()
        times.append(clock(fn))
    return statistics.median(times)


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


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
            if rank == 0:
                print(f"error: --carveout: each value must be in [0, {sms}) on this GPU", file=sys.stderr)
            dist.destroy_process_group()
            return 2
        if any(args.carveout):
            torch.backends.cuda.preferred_blas_library("cublaslt")
        blas = str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1]
    torch.manual_seed(rank)
    elements = int(args.mib * 2**20) // dtype.itemsize // world * world  # divisible by the ranks
    if elements < world:
        if rank == 0:
            print(f"error: --mib: {args.mib} MiB is less than one element per rank", file=sys.stderr)
        dist.destroy_process_group()
        return 2
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
    clock = Clock(device)
    side = torch.cuda.Stream() if device.type == "cuda" else None

    def gemms() -> None:
        for _ in range(args.gemms):
            torch.mm(a, b)

    def comms() -> None:
        for _ in range(args.comm_repeats):
            comm()

    def beside() -> tuple[float, float]:
        """(products' ms, whole burst's ms): the collectives on the side stream, the products on this one."""
        if side is None:  # gloo runs its collectives on its own threads: start them asynchronously
            start = time.perf_counter()
            handles = [comm(True) for _ in range(args.comm_repeats)]
            t = time.perf_counter()
            gemms()
            products = (time.perf_counter() - t) * 1e3
            for handle in handles:
                handle.wait()
            return products, (time.perf_counter() - start) * 1e3
        first, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        side.wait_stream(torch.cuda.current_stream())
        first.record()
        with torch.cuda.stream(side):
            comms()
        mid.record()
        gemms()
        done = torch.cuda.Event(enable_timing=True)
        done.record()
        torch.cuda.current_stream().wait_stream(side)
        end.record()
        end.synchronize()
        return mid.elapsed_time(done), first.elapsed_time(end)

    rows = []
    for carveout in args.carveout:
        if device.type == "cuda":
            torch._C._set_sm_carveout_experimental(carveout or None)
        comm_ms = median_ms(clock, comms, args.repeats) / args.comm_repeats
        alone_ms = median_ms(clock, gemms, args.repeats)
        for _ in range(3):
            beside()
        sync()
        pairs = []
        for _ in range(args.repeats):
            dist.barrier()
            pairs.append(beside())
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
        print("\n| carveout | BLAS | NCCL settings | comm ms | GEMMs alone ms | GEMMs beside ms | slowdown | "
              "together ms |")
        print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            env = " ".join(f"{k}={v}" for k, v in r["nccl_env"].items()) or "default"
            note = "" if r["comm_outlasts_gemms"] else " (the collectives ended first)"
            print(f"| {r['carveout']} | {r['blas']} | {env} | {r['comm_ms']:.3f} | {r['gemms_alone_ms']:.3f} | "
                  f"{r['gemms_beside_ms']:.3f}{note} | {r['slowdown']:.3f} | {r['together_ms']:.3f} |")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
