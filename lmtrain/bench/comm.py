"""Collective bandwidth: all-gather, reduce-scatter and all-reduce bus bandwidth over N local GPUs, per message size.

What FSDP2 and DDP move per step, measured on the machine at hand, for ``python -m lmtrain estimate`` to predict
step times from (``--comm`` there). One process per device (spawned), one process group (NCCL on GPUs, gloo on
the CPU); per operation and message size, ``--warmup`` untimed then ``--iters`` timed calls back to back between
two clock marks (CUDA events on the GPU, the host clock on the CPU), after a barrier. A row's time is the slowest
rank's mean per call: a collective is done when its last rank is.

Bandwidths as nccl-tests defines them, with ``size`` the bytes of the whole buffer (all-gather: the gathered
output; reduce-scatter: the input before scattering; all-reduce: the buffer) and n the ranks:

    algbw = size / time
    busbw = algbw * (n - 1) / n        all-gather, reduce-scatter
    busbw = algbw * 2 (n - 1) / n      all-reduce

``busbw`` is what each rank's link carries in a ring, comparable across n and with the hardware's link bandwidth.
Default dtypes are lmtrain's FSDP2 policy: bf16 all-gather, fp32 reduce-scatter, fp32 all-reduce (DDP's gradients).
NCCL reads its settings (e.g. ``NCCL_NVLS_ENABLE=0``) from the environment, which the spawned ranks inherit; the
record lists every ``NCCL_*`` variable that was set.

    python -m lmtrain bench comm --devices 2 --out benchmarks/DATE-H100x2-comm.json
    python -m lmtrain bench comm --allow-cpu --devices 2 --sizes 4K,64K      # a functional check over gloo

Sizes take the suffixes K, M, G (powers of 1024).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmtrain.bench.tables import markdown_table
from lmtrain.errors import LmtrainError
from lmtrain.step_time import bus_factor

OPERATIONS = ("all_gather", "reduce_scatter", "all_reduce")
#: The dtype each operation moves by default: FSDP2's bf16 parameters, fp32 gradients.
DEFAULT_DTYPES = {"all_gather": "bf16", "reduce_scatter": "fp32", "all_reduce": "fp32"}
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
DEFAULT_SIZES = ("1M", "4M", "16M", "64M", "256M", "1G")
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


@dataclass
class Row:
    """One operation at one message size."""

    op: str
    dtype: str
    bytes: int  # the whole buffer (see the module docstring)
    ms: float  # the slowest rank's mean time per call
    algbw_gbps: float  # GB/s (1e9 bytes)
    busbw_gbps: float


def bandwidths(op: str, size_bytes: int, ms: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of ``op`` moving a ``size_bytes`` buffer in ``ms`` milliseconds."""
    algbw = size_bytes / (ms * 1e-3) / 1e9
    return algbw, algbw * bus_factor(op, world_size)


def parse_size(text: str) -> int:
    """Bytes of ``4K``, ``16M``, ``1G`` or a plain number.

    Raises:
        LmtrainError: not a size.
    """
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    number = text[: len(text) - len(unit)]
    if not number.isdigit() or int(number) <= 0:
        raise LmtrainError("--sizes", f"{text!r} is not a size.", "give sizes such as 64K,16M,1G (powers of 1024).")
    return int(number) * _UNITS[unit]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``python -m lmtrain bench comm``."""
    parser.add_argument("--devices", type=int, default=None,
                        help="ranks, one per local GPU (default: every visible GPU; 2 on the CPU)")
    parser.add_argument("--sizes", default=",".join(DEFAULT_SIZES),
                        help=f"message sizes, whole-buffer bytes (default {','.join(DEFAULT_SIZES)})")
    parser.add_argument("--ops", default=",".join(OPERATIONS), help=f"operations (default {','.join(OPERATIONS)})")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None,
                        help="element type of every operation (default: bf16 all-gather, fp32 otherwise)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per row (default 5)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per row (default 20)")
    parser.add_argument("--allow-cpu", action="store_true", help="run over gloo on the CPU (a functional check)")
    parser.add_argument("--out", default=None, help="write the JSON record here")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, cuda: bool, plan: list[tuple[str, str, int]], warmup: int,
            iters: int, out: str) -> None:
    """One rank: time every (op, dtype, bytes) of ``plan``; rank 0 writes the slowest rank's times to ``out``."""
    import torch
    import torch.distributed as dist

    from lmtrain.bench.clock import Clock

    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, **({"device_id": device} if cuda else {}))
    # torch 2.13 names them *_single; the GPU machine's torch has only the older names.
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    clock = Clock(cuda)
    times = []
    for op, dtype, size in plan:
        numel = size // DTYPE_BYTES[dtype] // world_size * world_size  # a whole number of elements per rank
        full = torch.ones(numel, dtype=dtypes[dtype], device=device)
        shard = torch.ones(numel // world_size, dtype=dtypes[dtype], device=device)
        calls = {"all_gather": lambda f=full, s=shard: all_gather(f, s),
                 "reduce_scatter": lambda f=full, s=shard: reduce_scatter(s, f),
                 "all_reduce": lambda f=full, s=shard: dist.all_reduce(f)}
        call = calls[op]
        for _ in range(warmup):
            call()
        dist.barrier()
        clock.sync()
        start = clock.mark()
        for _ in range(iters):
            call()
        end = clock.mark()
        times.append(clock.intervals_ms([start], [end])[0] / iters)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(json.dumps(slowest.tolist()))
    dist.barrier()
    dist.destroy_process_group()


def measure(world_size: int, plan: list[tuple[str, str, int]], warmup: int, iters: int, cuda: bool) -> list[Row]:
    """Spawn ``world_size`` ranks, time ``plan`` ((op, dtype, whole-buffer bytes) per row), return the rows."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="lmtrain-comm-") as tmp:
        out = str(Path(tmp) / "times.json")
        mp.start_processes(_worker, args=(world_size, _free_port(), cuda, plan, warmup, iters, out),
                           nprocs=world_size, start_method="spawn")
        times = json.loads(Path(out).read_text())
    rows = []
    for (op, dtype, size), ms in zip(plan, times, strict=True):
        size = size // DTYPE_BYTES[dtype] // world_size * world_size * DTYPE_BYTES[dtype]
        rows.append(Row(op, dtype, size, ms, *bandwidths(op, size, ms, world_size)))
    return rows


def table(rows: list[Row]) -> str:
    """The rows as a markdown table."""
    body = [[r.op, r.dtype, _size_text(r.bytes), f"{r.ms:.3f}", f"{r.algbw_gbps:.3g}", f"{r.busbw_gbps:.3g}"]
            for r in rows]
    return markdown_table(["operation", "dtype", "size", "ms", "algbw GB/s", "busbw GB/s"], body)


def _size_text(size: int) -> str:
    for unit in ("G", "M", "K"):
        if size >= _UNITS[unit]:
            return f"{size / _UNITS[unit]:.4g}{unit}"
    return str(size)


def run(args: argparse.Namespace) -> int:
    """Measure, print the table, write the JSON record; 0 on success."""
    import torch

    from lmtrain.bench.environment import device_name, environment

    cuda = torch.cuda.is_available() and not args.allow_cpu
    if not torch.cuda.is_available() and not args.allow_cpu:
        raise LmtrainError("device", "no CUDA GPU is visible, and this benchmark measures NCCL between GPUs.",
                           "run it on a machine with several GPUs, or pass --allow-cpu for a check over gloo.")
    visible = torch.cuda.device_count() if cuda else None
    world = args.devices if args.devices is not None else (visible or 2)
    if world < 2 or (visible is not None and world > visible):
        raise LmtrainError("--devices", f"needs 2 to {visible or 'any number of'} ranks, got {world}.",
                           f"give --devices between 2 and {visible}." if visible else "give --devices 2 or more.")
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    if not ops or set(ops) - set(OPERATIONS):
        raise LmtrainError("--ops", f"unknown operations {sorted(set(ops) - set(OPERATIONS)) or ops}.",
                           f"use some of {','.join(OPERATIONS)}.")
    if args.warmup < 0 or args.iters < 1:
        raise LmtrainError("--iters", f"needs --iters >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}.",
                           "e.g. --iters 20 --warmup 5.")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes:
        raise LmtrainError("--sizes", f"{args.sizes!r} names no message size.", "give sizes, e.g. 1M,16M,256M.")
    if args.out:
        from lmtrain.errors import check_writable_folder

        check_writable_folder("--out", Path(args.out).resolve().parent)  # before the ranks start, not after
    plan = [(op, args.dtype or DEFAULT_DTYPES[op], size) for op in ops for size in sizes]
    small = [s for op, dtype, s in plan if s // DTYPE_BYTES[dtype] < world]
    if small:
        raise LmtrainError("--sizes", f"{_size_text(small[0])} holds fewer elements than there are ranks ({world}).",
                           "give larger sizes.")
    device = device_name(cuda)
    print(f"{world} ranks ({'NCCL' if cuda else 'gloo'}, {device}); {args.warmup} warm-up + {args.iters} timed calls "
          "per row", flush=True)
    rows = measure(world, plan, args.warmup, args.iters, cuda)
    print()
    print(f"### Collective bandwidth, {world} x {device}")
    print()
    print(table(rows))
    if args.out:
        meta = {"command": getattr(args, "command_line", None), "device": device, "world_size": world, "nodes": 1,
                "scope": "intra-node", "backend": "nccl" if cuda else "gloo", "warmup": args.warmup,
                "iters": args.iters, "environment": environment(),
                "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    return 0


def read_record(path: str | os.PathLike) -> dict[str, Any]:
    """A ``bench comm`` JSON record.

    Raises:
        LmtrainError: the file is missing or is not such a record.
    """
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise LmtrainError("--comm", f"{path} cannot be read as a bench comm record ({exc}).",
                           "give the JSON file that `python -m lmtrain bench comm --out FILE` wrote.") from None
    if not isinstance(record, dict) or not isinstance(record.get("rows"), list) or "world_size" not in \
            record.get("meta", {}):
        raise LmtrainError("--comm", f"{path} is not a bench comm record (no meta.world_size and rows).",
                           "give the JSON file that `python -m lmtrain bench comm --out FILE` wrote.")
    return record
