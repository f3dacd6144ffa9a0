"""Optimizer update bandwidth: each AdamW step over a model's parameters, in GB/s against a device-to-device copy.

AdamW is memory-bound: a step reads and writes every parameter's state once, and its floor is the bytes it moves
divided by the memory bandwidth. This benchmark times, over the parameters of a ``TransformerLM`` of a named size
(built on the device in fp32, with random gradients):

    copy                 ``dst.copy_(src)`` of one fp32 buffer as large as the model: what bandwidth a plain
                         streaming kernel reaches on this device (8 bytes per element), the reference
    adamw                ``torch.optim.AdamW`` over fp32 parameters and gradients (fused on CUDA, foreach on the
                         CPU), the step of ``bf16-mixed`` without master weights: 28 bytes per parameter
    master BLOCK/WARPS   ``lmtrain.optim.MasterWeightAdamW`` (``model.master_weights``): the linear weights in bf16
                         with fp32 masters, updated by its Triton kernel with ``block_size`` BLOCK and ``num_warps``
                         WARPS (one row per pair of ``--blocks`` x ``--warps`` and per ``--state-dtypes`` entry),
                         the other parameters by a fused fp32 AdamW: 28 bytes per parameter with the full fp32
                         state, 18 per bf16 weight with the compact one (``model.optimizer_state_dtype: bfloat16``:
                         the master split into the weight and its low 16 bits, bf16 moments)

Each row: median milliseconds per step over ``--steps`` steps after ``--warmup`` (CUDA events around each step),
the bytes the step must move, GB/s (bytes / time), and that as a fraction of the copy's GB/s. The implementations
run one after the other, each freed before the next (at 2.7B each holds 16 bytes per parameter: 55 GB).

    python -m lmtrain bench optimizer --size 2.7B
    python -m lmtrain bench optimizer --size small --blocks 1024,2048,4096,8192 --warps 4,8 --out optim.json

Needs a CUDA GPU; ``--allow-cpu`` runs on the CPU as a functional check (host clock; the torch-operation paths).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lmtrain.bench.clock import Clock
from lmtrain.bench.environment import device_name, environment
from lmtrain.bench.model import comma_list
from lmtrain.bench.tables import markdown_table
from lmtrain.config import SIZES, ModelConfig
from lmtrain.errors import LmtrainError
from lmtrain.flops import parameter_count
from lmtrain.optim import (
    DEFAULT_BLOCK_SIZE,
    OPTIMIZER_STATE_DTYPES,
    MasterWeightAdamW,
    check_kernel_launch,
    linear_weights,
    weight_decay_groups,
)

#: Bytes a step moves per parameter: AdamW reads parameter, gradient, exp_avg and exp_avg_sq and writes parameter,
#: exp_avg and exp_avg_sq, all fp32 (7 x 4); the master-weight step reads the bf16 gradient and the fp32 master and
#: moments and writes those and the bf16 weight (2 + 12 + 12 + 2). Both 28. With the compact state the master-weight
#: step reads the gradient, the weight, the master's low halves and the bf16 moments and writes all but the
#: gradient: 2 + 4 + 4 + 8 = 18.
ADAMW_BYTES = 28
MASTER_BYTES = {"float32": 28, "bfloat16": 18}
COPY_BYTES = 8  # read and write one fp32 element


@dataclass
class Row:
    """One implementation's measurement."""

    name: str
    kernel: str
    ms: float
    gbytes: float
    steps_ms: list[float]

    @property
    def gb_per_s(self) -> float:
        return self.gbytes / self.ms * 1e3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="2.7B", help=f"model size whose parameters are updated ({', '.join(SIZES)};"
                        " default 2.7B)")
    parser.add_argument("--vocab-size", type=int, default=10_000, help="vocabulary of the size (default 10000)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per implementation (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before them, not counted (default 3)")
    parser.add_argument("--blocks", type=comma_list(int), default=[DEFAULT_BLOCK_SIZE],
                        help=f"MasterWeightAdamW block sizes to time, comma-separated (default {DEFAULT_BLOCK_SIZE}, "
                             "its default)")
    parser.add_argument("--warps", type=comma_list(int), default=[8],
                        help="MasterWeightAdamW warps per program, comma-separated (default 8)")
    parser.add_argument("--state-dtypes", type=comma_list(str), default=["float32"],
                        help="MasterWeightAdamW states to time: float32 (full), bfloat16 (compact) or both, "
                             "comma-separated (default float32)")
    parser.add_argument("--only", type=comma_list(str), default=["copy", "adamw", "master"],
                        help="implementations to run, comma-separated (default copy,adamw,master)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU (a functional check, no GPU)")


def build_model(size: str, vocab_size: int, device: torch.device) -> torch.nn.Module:
    """``TransformerLM`` at ``size``, fp32, built on ``device`` (its parameters are the ones updated)."""
    from lmtrain.model import TransformerLM

    with device:
        return TransformerLM(ModelConfig.from_size(size, vocab_size=vocab_size))


def _random_grads(model: torch.nn.Module) -> None:
    # Random gradients (never zeros: a kernel could skip work on them), in each parameter's dtype.
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3


def _time(clock: Clock, step: Callable[[], None], warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    starts, ends = [], []
    for _ in range(steps):
        starts.append(clock.mark())
        step()
        ends.append(clock.mark())
    return clock.intervals_ms(starts, ends)


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_copy(numel: int, device: torch.device, clock: Clock, warmup: int, steps: int) -> Row:
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    copy = functools.partial(dst.copy_, src)
    times = _time(clock, copy, warmup, steps)
    del src, dst, copy
    _release()
    return Row("copy", "fp32 copy_", statistics.median(times), numel * COPY_BYTES / 1e9, times)


def time_adamw(size: str, vocab_size: int, device: torch.device, clock: Clock, warmup: int, steps: int) -> Row:
    model = build_model(size, vocab_size, device)
    _random_grads(model)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=3e-4, fused=fused or None,
                                  foreach=None if fused else True)
    times = _time(clock, optimizer.step, warmup, steps)
    numel = sum(p.numel() for p in model.parameters())
    del model, optimizer
    _release()
    return Row("adamw", "fused" if fused else "foreach", statistics.median(times), numel * ADAMW_BYTES / 1e9, times)


def time_master(size: str, vocab_size: int, device: torch.device, clock: Clock, warmup: int, steps: int,
                launches: list[tuple[int, int]], state_dtype: str = "float32") -> list[Row]:
    """One row per (block_size, num_warps) in ``launches`` (one row, "torch operations", without the kernel), with
    the bf16 weights' moments in ``state_dtype``."""
    model = build_model(size, vocab_size, device)
    # As LMModule(master_weights=True) builds it; the linear weights are bf16 from here on.
    optimizer = MasterWeightAdamW(weight_decay_groups(model, 0.1), lr=3e-4, bf16_params=linear_weights(model),
                                  state_dtype=OPTIMIZER_STATE_DTYPES[state_dtype])
    _random_grads(model)
    gbytes = sum(p.numel() * (MASTER_BYTES[state_dtype] if p.dtype == torch.bfloat16 else ADAMW_BYTES)
                 for p in model.parameters()) / 1e9
    rows = []
    uses_kernel = optimizer.uses_kernel and device.type == "cuda"
    name = "master" if state_dtype == "float32" else f"master, {state_dtype} state"
    for block, warps in launches if uses_kernel else launches[:1]:
        optimizer.block_size, optimizer.num_warps = block, warps
        times = _time(clock, optimizer.step, warmup, steps)
        kernel = f"Triton, block {block}, {warps} warps" if uses_kernel else "torch operations"
        rows.append(Row(name, kernel, statistics.median(times), gbytes, times))
    del model, optimizer
    _release()
    return rows


def table(rows: list[Row]) -> str:
    copy = next((r for r in rows if r.name == "copy"), None)
    body = [[r.name, r.kernel, f"{r.ms:.2f}", f"{r.gbytes:.2f}", f"{r.gb_per_s:,.0f}",
             f"{r.gb_per_s / copy.gb_per_s:.0%}" if copy else "-"] for r in rows]
    return markdown_table(["implementation", "kernel", "ms per step", "GB per step", "GB/s", "of copy"], body)


def run(args: argparse.Namespace) -> int:
    """Time the implementations, print the table, write the JSON; 0 on success."""
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        raise LmtrainError("device", "no CUDA GPU is visible, and this benchmark times GPU kernels.",
                           "run it on a GPU machine, or pass --allow-cpu for a functional check on the CPU.")
    if args.size not in SIZES:
        raise LmtrainError("--size", f"unknown size {args.size!r}.", f"use one of {', '.join(SIZES)}.")
    if args.warmup < 0 or args.steps < 1:
        raise LmtrainError("--steps", f"needs --steps >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}.",
                           "e.g. --steps 10 --warmup 3.")
    only = args.only
    unknown = sorted(set(only) - {"copy", "adamw", "master"})
    if unknown or not only:
        raise LmtrainError("--only", f"unknown implementations {unknown or only}.", "use some of copy,adamw,master.")
    unknown = sorted(set(args.state_dtypes) - set(OPTIMIZER_STATE_DTYPES))
    if unknown or not args.state_dtypes:
        raise LmtrainError("--state-dtypes", f"unknown dtypes {unknown or args.state_dtypes}.",
                           f"use some of {','.join(OPTIMIZER_STATE_DTYPES)}.")
    launches = [(b, w) for b in args.blocks for w in args.warps]
    if not launches:
        raise LmtrainError("--blocks/--warps", "no block size or no warp count given.", "e.g. --blocks 2048 --warps 8.")
    for block, warps in launches:
        try:
            check_kernel_launch(block, warps)
        except ValueError as err:
            raise LmtrainError("--blocks/--warps", str(err).split(". Fix:")[0] + ".",
                               "block sizes: powers of two from 128 to 65536; warps: 1, 2, 4, 8 or 16.") from None
    config = ModelConfig.from_size(args.size, vocab_size=args.vocab_size)
    numel = parameter_count(config)
    device = torch.device("cuda" if cuda else "cpu")
    clock = Clock(cuda)
    print(f"{args.size}: {numel:,} parameters; {args.warmup} warm-up + {args.steps} measured steps each", flush=True)
    rows: list[Row] = []
    for name in only:
        if name == "copy":
            rows.append(time_copy(numel, device, clock, args.warmup, args.steps))
        elif name == "adamw":
            rows.append(time_adamw(args.size, args.vocab_size, device, clock, args.warmup, args.steps))
        else:
            for state_dtype in args.state_dtypes:
                rows += time_master(args.size, args.vocab_size, device, clock, args.warmup, args.steps, launches,
                                    state_dtype)
        print(f"  {rows[-1].name}: {rows[-1].ms:.2f} ms", flush=True)
    print()
    print(f"### Optimizer update, {args.size} ({numel:,} parameters), {device_name(cuda)}")
    print()
    print(table(rows))
    if args.out:
        record = {"size": args.size, "vocab_size": args.vocab_size, "parameters": numel, "device": device_name(cuda),
                  "environment": environment(), "warmup": args.warmup, "steps": args.steps,
                  "rows": [{**asdict(r), "gb_per_s": r.gb_per_s} for r in rows]}
        Path(args.out).write_text(json.dumps(record, indent=1))
    return 0
