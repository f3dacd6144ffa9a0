"""Attention sweep: forward/backward time, TFLOP/s and memory of each attention backend over (d, N) grids.

Grids (``--grid``):
    study   the attention grid of the reference profiling study (``seeds``, its former name, still works):
            batch 8, one head, d in {16, 32, 64, 128} x N in {256, 1024, 4096, 8192, 16384}.
    lm      multi-head LM shapes: bf16, causal, d in {64, 80, 128}, N in {1024, ..., 16384}, 16 heads and a
            batch chosen so that batch x heads x N = ``--tokens-heads`` (default 2^21): the GPU stays full
            at every N and the inputs stay at 2^21 x d elements each.
    memory  long sequences, one head of d 64, batch 1, N in {16384, 32768, 65536, 131072}: peak memory must
            grow linearly in N for the flash backends.
    launch  the small model's attention at batch 1 (12 heads, d 64, N in {128, 512, 2048}): calls so short
            that the host time to issue them (the ``host us`` columns) decides the step time.
``--head-dims``, ``--seq-lens``, ``--batch-size``, ``--heads`` override a grid's values.

Backends (``--backends``): every backend registered in ``lmtrain.attention`` (its facts say which need a
GPU), and bench-only variants: ``naive`` (materialised scores), ``naive_compiled`` (the
same under ``torch.compile``), ``flash_pytorch`` (tiled reference, Python loop: skipped above
``--flash-pytorch-max-n``), ``flash_triton`` (our kernels), ``sdpa_flash`` / ``sdpa_cudnn`` /
``sdpa_efficient`` / ``sdpa_math`` (``scaled_dot_product_attention`` restricted to one kernel with
``torch.nn.attention.sdpa_kernel``).

Per cell: median forward, backward and forward+backward milliseconds over ``--rep`` timed runs after ``--warmup``
untimed ones (CUDA events; the backward is timed alone: its forward runs before the start event). The backends of one
shape share its inputs and take turns: ``--rounds`` rounds (default 3), each timing every backend in turn, the order
rotated from round to round, the round's first measurement after as many more untimed runs as keep the GPU busy
``--warmup-ms`` (default 1000), so that all see the clock speed of sustained load and the same mix of its swings; each
figure is the median over the rounds, and the JSON keeps every round's. TFLOP/s (forward 4·B·H·N_q·N_k·d, halved when
causal; backward 2.5x forward), GiB allocated after the forward (before the backward: inputs, output and what autograd
saved) and the peak GiB of one forward+backward, both as ``torch.cuda.memory_allocated``: they include whatever stays
allocated across cells (for example a cuBLAS workspace once a matmul-based backend has run). Host time: the CPU time
to issue one forward, and one forward+backward, in microseconds: the median over ``--rep`` bursts (fewer for long
calls: ``host_bursts``) of 16 calls issued back to back after 4 untimed ones, each burst started on an idle GPU and
timed without waiting for it (a burst is too short to fill the launch queue); where it exceeds the GPU time the
backend is launch-bound at that size. One untimed forward+backward comes first, so compilation and autotuning stay out
of both. Inputs are random (never zeros), fresh per shape and the same for its backends. A cell that runs out of
memory is recorded as ``OOM`` and the sweep goes on; a backend that cannot run a cell is recorded as ``n/a`` with the
reason.

flash_triton's kernels follow ``lmtrain.kernels.flash.FlashSettings``, one ``--flash-<field>`` flag per field (e.g.
``--flash-gluon off``, ``--no-flash-autotune``, ``--flash-gluon-dkdv-config 2,64,3,1,1,2``); the settings and the
kernels that served each flash_triton shape go into the JSON's ``meta.flash_kernels``.

Output: a short Markdown table on stdout, one progress line per cell on stderr, and with ``--out PATH``
a CSV at PATH and the same rows as JSON beside it (PATH with suffix .json). Needs a CUDA GPU;
``--allow-cpu`` runs a tiny smoke sweep on the CPU (wall-clock timing, no memory figures).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from lmtrain.analysis import tables
from lmtrain.bench.clock import Clock
from lmtrain.bench.environment import device_name, environment, flash_kernels
from lmtrain.bench.model import command_line

#: Bench-only variants of the registered backends: (what it is, whether it needs CUDA). The registered backends
#: themselves (``lmtrain.attention``) are always offered; ``sdpa`` itself is left out of the default list because
#: the ``sdpa_*`` variants time each of its kernels.
VARIANTS: dict[str, tuple[str, bool]] = {
    "naive_compiled": ("naive under torch.compile", False),
    "sdpa_flash": ("scaled_dot_product_attention, flash kernel only", True),
    "sdpa_cudnn": ("scaled_dot_product_attention, cuDNN kernel only", True),
    "sdpa_efficient": ("scaled_dot_product_attention, memory-efficient kernel only", True),
    "sdpa_math": ("scaled_dot_product_attention, math fallback only", False),
}
_SDPA_KERNELS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
                 "sdpa_efficient": "EFFICIENT_ATTENTION", "sdpa_math": "MATH"}
#: Backends whose Python tile loop takes seconds per call: skipped above ``--flash-pytorch-max-n``.
SLOW_BACKENDS = ("flash_pytorch",)


def all_backends() -> tuple[str, ...]:
    """Every backend this sweep can time: the registered ones, then the bench-only variants."""
    from lmtrain.attention import available_backends

    return (*available_backends(), *VARIANTS)


def default_backends() -> tuple[str, ...]:
    """The default ``--backends``: every registered backend but ``sdpa`` (timed per kernel), every variant but
    ``sdpa_math`` (the slow fallback)."""
    from lmtrain.attention import available_backends

    return (*(b for b in available_backends() if b != "sdpa"), *(v for v in VARIANTS if v != "sdpa_math"))


GRIDS: dict[str, dict] = {
    "study": {"head_dims": [16, 32, 64, 128], "seq_lens": [256, 1024, 4096, 8192, 16384], "batch_size": 8, "heads": 1},
    "lm": {"head_dims": [64, 80, 128], "seq_lens": [1024, 2048, 4096, 8192, 16384], "batch_size": None, "heads": 16},
    "memory": {"head_dims": [64], "seq_lens": [16384, 32768, 65536, 131072], "batch_size": 1, "heads": 1},
    "launch": {"head_dims": [64], "seq_lens": [128, 512, 2048], "batch_size": 1, "heads": 12},
}
#: Former grid names.
GRID_ALIASES = {"seeds": "study"}
#: The CPU smoke run (``--allow-cpu``): longest N timed, and the most warm-up and timed runs per measurement.
CPU_MAX_N, CPU_WARMUP, CPU_REP, CPU_ROUNDS = 512, 1, 3, 1
#: ``--warmup-ms``'s default. A GPU at its power limit changes its clock under load, most right after an idle
#: moment (an H100 at 700 W: 1980 MHz after idle,
#: 1215-1410 MHz at the lowest, a median of 1515-1665 MHz over a cell of N 16384); runs timed right after the load
#: starts measure the transition, not the sustained speed a training run sees.
DEFAULT_WARMUP_MS = 1000.0
#: ``--rounds``'s default: each shape's backends timed in turn this many times, the median kept. One backend timed
#: after another sees another stretch of the power-limited clock: at head dim 64 and 1024 keys on an H100, five
#: calls with one round each put flash_triton's forward at 0.932-1.078 of cuDNN's, while windows of both taking
#: turns gave 1.018-1.084.
DEFAULT_ROUNDS = 3
#: The most untimed runs ``--warmup-ms`` adds before one measurement (a bound for calls of microseconds).
MAX_SUSTAINED_RUNS = 20_000
HOST_BUDGET_MS = 2000.0  # GPU time the host-time bursts of one measurement may take (``host_bursts``)
HOST_LEAD, HOST_BURST = 4, 16  # untimed and timed calls per host-time burst: 20 forward+backward calls of any
# backend here stay below the GPU's launch queue (about 1,000 kernels), so a burst never waits for the GPU
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CSV_FIELDS = (
    "backend", "dtype", "causal", "batch", "heads", "seq_len", "head_dim", "status", "reason",
    "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_tflops", "bwd_tflops", "fwd_bwd_tflops", "mem_before_bwd_gib", "peak_gib",
    "fwd_host_us", "fwd_bwd_host_us",
)

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


class Unsupported(Exception):
    """The backend cannot run this cell (recorded as n/a with the message as the reason)."""


@dataclass
class Cell:
    """One row of the sweep."""

    backend: str
    dtype: str
    causal: bool
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    status: str = "ok"  # ok | OOM | n/a | error
    reason: str = ""
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    fwd_bwd_ms: float | None = None
    fwd_tflops: float | None = None
    bwd_tflops: float | None = None
    fwd_bwd_tflops: float | None = None
    mem_before_bwd_gib: float | None = None
    peak_gib: float | None = None
    fwd_host_us: float | None = None
    fwd_bwd_host_us: float | None = None
    extra: dict = field(default_factory=dict, repr=False)


def _at_least_one(text: str) -> int:
    """An integer flag that must be 1 or more (argparse reports anything else as a usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``python -m lmtrain bench attention``."""
    parser.add_argument("--grid", choices=sorted([*GRIDS, *GRID_ALIASES]), default="study",
                        help="base grid (default: study)")
    parser.add_argument("--head-dims", type=_at_least_one, nargs="+", help="head dims d (default: the grid's)")
    parser.add_argument("--seq-lens", type=_at_least_one, nargs="+", help="sequence lengths N (default: the grid's)")
    parser.add_argument("--batch-size", type=_at_least_one,
                        help="batch size B (default: the grid's; lm: tokens-heads / (H N))")
    parser.add_argument("--heads", type=_at_least_one, help="heads H (default: the grid's)")
    parser.add_argument("--tokens-heads", type=_at_least_one, default=2**21,
                        help="lm grid: B x H x N per cell (default 2^21)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="input dtype (default bf16)")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                        help="causal mask (default on)")
    parser.add_argument("--backends", nargs="+", choices=all_backends(), default=list(default_backends()),
                        help="backends to time: registered backends (lmtrain.attention) and the variants "
                             f"{', '.join(VARIANTS)} (default: {' '.join(default_backends())})")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs before timing (default 5)")
    parser.add_argument("--warmup-ms", type=float, default=DEFAULT_WARMUP_MS,
                        help="after the --warmup runs of each round's first measurement, more untimed runs that keep "
                             "the GPU busy this many milliseconds right before its timed runs, so that the round sees "
                             "the clock speed sustained load settles at; 0: none (default %(default)g)")
    parser.add_argument("--rep", type=_at_least_one, default=30,
                        help="timed runs per measurement; the median is kept (default 30)")
    parser.add_argument("--rounds", type=_at_least_one, default=DEFAULT_ROUNDS,
                        help="rounds per shape: in each, every backend is timed in turn (the order rotated from "
                             "round to round, the round's first measurement after --warmup-ms of sustained calls); "
                             "each figure is the median over the rounds (default %(default)d)")
    parser.add_argument("--flash-pytorch-max-n", type=int, default=1024,
                        help="skip flash_pytorch above this N: its Python tile loop takes seconds per call")
    parser.add_argument("--out", type=Path, help="CSV path; the JSON goes beside it with suffix .json")
    parser.add_argument("--allow-cpu", action="store_true",
                        help=f"run on the CPU as a smoke run: N up to {CPU_MAX_N}, at most {CPU_WARMUP} warm-up and "
                             f"{CPU_REP} timed runs per measurement, no --warmup-ms (a minute or two on 2 cores)")
    add_flash_arguments(parser)


def add_flash_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flash-<field>`` flag per field of ``lmtrain.kernels.flash.FlashSettings`` (default: the field's)."""
    from lmtrain.kernels.flash import FlashSettings

    group = parser.add_argument_group("flash_triton settings (lmtrain.kernels.flash.FlashSettings)")
    for f in dataclasses.fields(FlashSettings):
        flag = "--flash-" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            group.add_argument(flag, dest=f"flash_{f.name}", action=argparse.BooleanOptionalAction, default=f.default,
                               help=f"FlashSettings.{f.name} (default {f.default})")
        else:
            group.add_argument(flag, dest=f"flash_{f.name}", default=f.default,
                               help=f"FlashSettings.{f.name} (default {f.default})")


def flash_settings(args: argparse.Namespace):
    """The ``FlashSettings`` of the ``--flash-*`` flags (``LmtrainError`` for a bad value)."""
    from lmtrain.kernels.flash import FlashSettings

    return FlashSettings(**{f.name: getattr(args, f"flash_{f.name}", f.default)
                            for f in dataclasses.fields(FlashSettings)})


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------


def _sdpa(kernel_name: str) -> AttentionFn:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, kernel_name)

    def fn(q, k, v, causal):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return fn


def _backend(name: str, device: torch.device, seq_len: int, max_pytorch_n: int) -> AttentionFn:
    """The attention function of a backend for one cell; raises Unsupported when it cannot run there."""
    from lmtrain.attention import available_backends, backend_info
    from lmtrain.kernels import triton_interpreted

    if name in available_backends():
        info = backend_info(name)
        if info.needs_gpu and device.type != "cuda" and not triton_interpreted():
            raise Unsupported("needs CUDA")
        if name in SLOW_BACKENDS and seq_len > max_pytorch_n:
            raise Unsupported(f"N > --flash-pytorch-max-n {max_pytorch_n} (Python tile loop)")
        return info.fn
    if name not in VARIANTS:
        raise ValueError(f"unknown backend {name!r}")
    if VARIANTS[name][1] and device.type != "cuda":
        raise Unsupported("needs CUDA")
    if name == "naive_compiled":
        torch._dynamo.reset()  # a fresh graph per cell: no recompile limit, no dynamic-shape fallback
        return torch.compile(backend_info("naive").fn, dynamic=False)
    return _sdpa(_SDPA_KERNELS[name])


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def sustained_runs(warmup_ms: float, run_ms: float) -> int:
    """Untimed runs of ``run_ms`` each (setup included) that keep the device busy for ``warmup_ms`` (at most
    ``MAX_SUSTAINED_RUNS``; none without ``warmup_ms``)."""
    if warmup_ms <= 0:
        return 0
    return min(MAX_SUSTAINED_RUNS, math.ceil(warmup_ms / max(run_ms, 1e-3)))


def _median_ms(setup: Callable[[], object], timed: Callable[[object], None], warmup: int, rep: int,
               device: torch.device, warmup_ms: float = 0.0) -> float:
    """Median milliseconds of ``timed(setup())`` over ``rep`` runs; ``setup`` runs outside the timed region.

    ``warmup`` untimed runs first; with ``warmup_ms``, their time per run (setup included) decides how many more
    untimed runs then keep the device busy for ``warmup_ms`` right before the timed ones, with no synchronisation
    between (``sustained_runs``): the timed runs then see the clock speed that sustained load settles at.
    On a GPU the marks are stream-ordered events: the start fires after the setup's kernels.
    """
    clock = Clock(device.type == "cuda")
    first = max(warmup, 1) if warmup_ms > 0 else warmup  # at least one run to time when warmup_ms needs it
    start = clock.mark()
    for _ in range(first):
        timed(setup())
    if warmup_ms > 0:
        end = clock.mark()
        clock.sync()
        for _ in range(sustained_runs(warmup_ms, clock.ms(start, end) / first)):
            timed(setup())
    starts, ends = [], []
    for _ in range(rep):
        state = setup()
        starts.append(clock.mark())
        timed(state)
        ends.append(clock.mark())
        del state
    return statistics.median(clock.intervals_ms(starts, ends))


def host_bursts(rep: int, gpu_ms: float) -> int:
    """Host-time bursts for a call of ``gpu_ms`` on the GPU: ``rep``, but no more than keep the GPU busy about
    ``HOST_BUDGET_MS`` (each burst waits for the last one's calls), and at least 3 (or ``rep`` if fewer). Host time
    decides only calls shorter than it, and those get all ``rep`` bursts; a forward+backward of 57 ms (head dim 128,
    16384 keys) would otherwise spend 34 s of a sweep on 30 bursts."""
    return max(min(rep, 3), min(rep, math.ceil(HOST_BUDGET_MS / ((HOST_LEAD + HOST_BURST) * max(gpu_ms, 1e-6)))))


def _median_host_us(setup: Callable[[], object], timed: Callable[[object], None], rep: int,
                    device: torch.device) -> float:
    """Median host microseconds per ``timed`` call over ``rep`` bursts: each burst starts on an idle device,
    issues ``HOST_LEAD`` untimed calls (so that the CPU is not timed waking up from the wait), then
    ``HOST_BURST`` calls back to back on the CPU clock, without waiting for the device."""
    per_call = []
    host = Clock(cuda=False)  # host time: what the CPU spends issuing the calls
    for _ in range(max(rep, 1)):
        states = [setup() for _ in range(HOST_LEAD + HOST_BURST)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for state in states[:HOST_LEAD]:
            timed(state)
        t0 = host.mark()
        for state in states[HOST_LEAD:]:
            timed(state)
        per_call.append(host.ms(t0, host.mark()) / HOST_BURST * 1e3)
        del states
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(per_call)


def attention_flops(batch: int, heads: int, n_q: int, n_k: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs: two matmuls of 2·N_q·N_k·d per (batch, head); half when causal. Backward: 2.5x."""
    flops = 4.0 * batch * heads * n_q * n_k * head_dim
    return flops / 2 if causal else flops


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def make_inputs(cell: Cell, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Random (never zero) q, k, v (needing gradients) and the output gradient of a cell's shape, the same values
    for every backend of that shape (seeded by N and d)."""
    dtype = DTYPES[cell.dtype]
    shape = (cell.batch, cell.heads, cell.seq_len, cell.head_dim)  # (B, H, N, d)
    gen = torch.Generator(device=device).manual_seed(cell.seq_len * 1000 + cell.head_dim)
    q, k, v, do = (torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    return q, k, v, do


def _clear_grads(inputs: tuple[torch.Tensor, ...]) -> None:
    """Drop the gradients a backward left on q, k and v (``make_inputs``' first three)."""
    for t in inputs[:3]:
        t.grad = None


class Calls:
    """A backend's forward, backward and forward+backward on one set of inputs (gradients cleared by
    ``clear_grads``; the inputs may be shared with other backends of the same shape)."""

    def __init__(self, fn: AttentionFn, inputs: tuple[torch.Tensor, ...], causal: bool) -> None:
        self.fn, self.inputs, self.causal = fn, inputs, causal

    def clear_grads(self) -> None:
        _clear_grads(self.inputs)

    def forward(self, _=None) -> torch.Tensor:
        q, k, v, _ = self.inputs
        return self.fn(q, k, v, self.causal)

    def backward(self, out: torch.Tensor) -> None:
        out.backward(self.inputs[3])

    def forward_backward(self, _=None) -> None:
        self.forward().backward(self.inputs[3])

    def setup_backward(self) -> torch.Tensor:
        self.clear_grads()
        return self.forward()


def prepare_cell(cell: Cell, calls: Calls, device: torch.device) -> None:
    """One untimed forward+backward (compilation and autotuning, whose benchmark buffers would count towards the
    peak, happen here), then the cell's memory figures: one forward with the graph alive, its backward, the peak of
    both."""
    calls.forward_backward()
    calls.clear_grads()
    _free(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    out = calls.forward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        cell.mem_before_bwd_gib = torch.cuda.memory_allocated(device) / 2**30
    calls.backward(out)
    del out
    calls.clear_grads()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        cell.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30


def time_round(calls: Calls, device: torch.device, warmup: int, rep: int,
               warmup_ms: float = 0.0) -> tuple[float, float, float]:
    """(forward, backward, forward+backward) median milliseconds of one round (``_median_ms`` each; ``warmup_ms``
    before the forward's timed runs only: the two measurements after it follow on a busy GPU)."""
    fwd = _median_ms(lambda: None, calls.forward, warmup, rep, device, warmup_ms)
    bwd = _median_ms(calls.setup_backward, calls.backward, warmup, rep, device)
    fwd_bwd = _median_ms(calls.clear_grads, calls.forward_backward, warmup, rep, device)
    calls.clear_grads()
    return fwd, bwd, fwd_bwd


def finish_cell(cell: Cell, calls: Calls, device: torch.device, rep: int) -> None:
    """The cell's times (median over its rounds, ``cell.extra["rounds"]``), TFLOP/s and host times."""
    rounds = cell.extra["rounds"]
    cell.fwd_ms, cell.bwd_ms, cell.fwd_bwd_ms = (statistics.median(r[i] for r in rounds) for i in range(3))
    cell.fwd_host_us = _median_host_us(lambda: None, calls.forward, host_bursts(rep, cell.fwd_ms), device)
    cell.fwd_bwd_host_us = _median_host_us(lambda: None, calls.forward_backward, host_bursts(rep, cell.fwd_bwd_ms),
                                           device)
    calls.clear_grads()
    flops = attention_flops(cell.batch, cell.heads, cell.seq_len, cell.seq_len, cell.head_dim, cell.causal)
    cell.fwd_tflops = flops / (cell.fwd_ms * 1e-3) / 1e12
    cell.bwd_tflops = 2.5 * flops / (cell.bwd_ms * 1e-3) / 1e12
    cell.fwd_bwd_tflops = 3.5 * flops / (cell.fwd_bwd_ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------------
# Sweep
# ---------------------------------------------------------------------------------------------


def plan_cells(args: argparse.Namespace) -> list[Cell]:
    """The grid's cells, in sweep order (N outermost within each d, backends innermost)."""
    grid = GRIDS[GRID_ALIASES.get(args.grid, args.grid)]
    head_dims = args.head_dims or grid["head_dims"]
    seq_lens = args.seq_lens or grid["seq_lens"]
    heads = args.heads or grid["heads"]
    dtype = args.dtype
    causal = args.causal
    cells = []
    for d in head_dims:
        for n in seq_lens:
            batch = args.batch_size or grid["batch_size"] or max(1, args.tokens_heads // (heads * n))
            for backend in args.backends:
                cells.append(Cell(backend, dtype, causal, batch, heads, n, d))
    return cells


_TIMES = ("fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_tflops", "bwd_tflops", "fwd_bwd_tflops", "mem_before_bwd_gib",
          "peak_gib", "fwd_host_us", "fwd_bwd_host_us")


def _record_failure(cell: Cell, exc: Exception) -> None:
    """A failed cell: ``n/a`` (the backend cannot run it), ``OOM``, or ``error``, with the reason; no figures."""
    if isinstance(exc, Unsupported):
        cell.status, cell.reason = "n/a", str(exc)
    else:
        message = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        if _is_oom(exc):
            cell.status, cell.reason = "OOM", message
        elif isinstance(exc, RuntimeError) and ("No available kernel" in message or "not supported" in message.lower()):
            cell.status, cell.reason = "n/a", message
        else:
            cell.status, cell.reason = "error", f"{type(exc).__name__}: {message}"
    for attr in _TIMES:
        setattr(cell, attr, None)
    cell.extra.pop("rounds", None)


def shape_groups(cells: list[Cell]) -> list[list[Cell]]:
    """The cells in runs of one shape (dtype, causal, B, H, N, d: the backends of one grid point), in order."""
    groups: list[list[Cell]] = []
    for cell in cells:
        shape = (cell.dtype, cell.causal, cell.batch, cell.heads, cell.seq_len, cell.head_dim)
        if groups and shape == groups[-1][0].extra["shape"]:
            groups[-1].append(cell)
        else:
            groups.append([cell])
        cell.extra["shape"] = shape
    return groups


def measure_shape(cells: list[Cell], device: torch.device, args: argparse.Namespace,
                  log: Callable[[str], None] = lambda line: None) -> None:
    """Measure the backends of one shape interleaved: one set of inputs for all; each backend compiled and its
    memory measured in turn; then ``args.rounds`` rounds in each of which every backend runs ``time_round``, the
    order rotated by one backend per round and the round's first forward after ``--warmup-ms`` of sustained calls,
    so that every backend is timed in the same mix of the GPU's clock states (under a power limit the clock moves
    over seconds, and one backend measured after another would see a different part of that); each figure is the
    median over the rounds. Failures become the cells' status; the other backends go on."""
    live: list[tuple[Cell, Calls]] = []
    inputs = None
    for cell in cells:
        if cell.status == "n/a":
            continue
        try:
            fn = _backend(cell.backend, device, cell.seq_len, args.flash_pytorch_max_n)
            inputs = inputs or make_inputs(cell, device)
            calls = Calls(fn, inputs, cell.causal)
            prepare_cell(cell, calls, device)
            cell.extra["rounds"] = []
            live.append((cell, calls))
        except Exception as exc:  # noqa: BLE001 - a sweep records failures and goes on
            _record_failure(cell, exc)
            if inputs is not None:
                _clear_grads(inputs)
            _free(device)
    rounds = args.rounds
    for r in range(rounds):
        turn = r % max(len(live), 1)
        order = [(cell, calls) for cell, calls in live[turn:] + live[:turn] if cell.status == "ok"]
        for i, (cell, calls) in enumerate(order):
            try:
                times = time_round(calls, device, args.warmup, args.rep, args.warmup_ms if i == 0 else 0.0)
                cell.extra["rounds"].append(times)
                log(f"  round {r + 1}/{rounds} {cell.backend}: fwd {times[0]:.3f}, bwd {times[1]:.3f}, "
                    f"fwd+bwd {times[2]:.3f} ms")
            except Exception as exc:  # noqa: BLE001
                calls.clear_grads()
                _record_failure(cell, exc)
                log(f"  round {r + 1}/{rounds} {cell.backend}: {cell.status} {cell.reason}")
                _free(device)
    for cell, calls in live:
        if cell.status == "ok":
            try:
                finish_cell(cell, calls, device, args.rep)
            except Exception as exc:  # noqa: BLE001
                calls.clear_grads()
                _record_failure(cell, exc)
    del live, inputs
    _free(device)


def _fmt(x: float | None, digits: int = 2) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def markdown_table(cells: list[Cell]) -> str:
    """The short table: one row per cell, times in ms, throughput in TFLOP/s, memory in GiB."""
    header = ["backend", "B", "H", "N", "d", "fwd ms", "bwd ms", "fwd+bwd ms", "fwd TFLOP/s", "fwd+bwd TFLOP/s",
              "mem before bwd GiB", "peak GiB", "fwd host us", "fwd+bwd host us"]
    rows = []
    for c in cells:
        shape = [c.backend, c.batch, c.heads, c.seq_len, c.head_dim]
        if c.status != "ok":
            rows.append([*shape, c.status if c.status == "OOM" else f"{c.status}: {c.reason}", *[""] * 8])
            continue
        rows.append([*shape, _fmt(c.fwd_ms, 3), _fmt(c.bwd_ms, 3), _fmt(c.fwd_bwd_ms, 3), _fmt(c.fwd_tflops, 1),
                     _fmt(c.fwd_bwd_tflops, 1), _fmt(c.mem_before_bwd_gib, 3), _fmt(c.peak_gib, 3),
                     _fmt(c.fwd_host_us, 1), _fmt(c.fwd_bwd_host_us, 1)])
    return tables.markdown_table(header, rows)


def _row(cell: Cell) -> dict:
    row = asdict(cell)
    row.pop("extra")
    return row


def _json_row(cell: Cell) -> dict:
    """A JSON row: the CSV's fields and, for a measured cell, each round's forward, backward and forward+backward
    milliseconds (``rounds``)."""
    row = _row(cell)
    if cell.status == "ok" and cell.extra.get("rounds"):
        row["rounds"] = [list(r) for r in cell.extra["rounds"]]
    return row


def write_results(cells: list[Cell], out: Path, meta: dict) -> None:
    """CSV at ``out`` and JSON (metadata + rows) beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for c in cells:
            writer.writerow({k: ("" if v is None else v) for k, v in _row(c).items()})
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": [_json_row(c) for c in cells]}, indent=1))


def run(args: argparse.Namespace) -> int:
    """Run the sweep under the ``--flash-*`` settings (checked before anything runs, restored after); 0 on success, 2
    when no GPU is there and ``--allow-cpu`` is not given."""
    from lmtrain.kernels.flash import use_settings

    with use_settings(flash_settings(args)):
        return _sweep(args)


def _sweep(args: argparse.Namespace) -> int:
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.allow_cpu:
        device = torch.device("cpu")
    else:
        print("bench attention: no CUDA GPU found; the timings and memory figures need one. "
              "Run it on a GPU machine, or pass --allow-cpu for a tiny smoke run.", file=sys.stderr)
        return 2
    cells = plan_cells(args)
    if device.type == "cpu":  # a smoke run: small cells, few repetitions
        args.warmup, args.rep, args.warmup_ms = min(args.warmup, CPU_WARMUP), min(args.rep, CPU_REP), 0.0
        args.rounds = min(args.rounds, CPU_ROUNDS)
        for cell in cells:
            if cell.seq_len > CPU_MAX_N:
                cell.status, cell.reason = "n/a", f"CPU smoke run: N above {CPU_MAX_N} is not timed"
    meta = {"device": device_name(device.type == "cuda"), **environment(), "command": command_line(args),
            "flash_kernels": flash_kernels(sorted({(c.seq_len, c.head_dim) for c in cells
                                                   if c.backend == "flash_triton"}), args.dtype,
                                           device.type == "cuda")}
    print(f"bench attention: {len(cells)} cells on {meta['device']} (torch {meta['torch']}, triton {meta['triton']})",
          file=sys.stderr)
    done = 0
    for group in shape_groups(cells):
        try:
            measure_shape(group, device, args, log=lambda line: print(line, file=sys.stderr, flush=True))
        except KeyboardInterrupt:
            raise KeyboardInterrupt("stopped by Ctrl-C; " + (f"the cells finished so far are in {args.out}."
                                                              if args.out else "no --out was given.")) from None
        for cell in group:
            done += 1
            if cell.status == "ok":
                summary = (f"fwd {cell.fwd_ms:.3f} ms ({cell.fwd_tflops:.1f} TFLOP/s), fwd+bwd {cell.fwd_bwd_ms:.3f} "
                           f"ms ({cell.fwd_bwd_tflops:.1f} TFLOP/s), peak {_fmt(cell.peak_gib, 3) or '-'} GiB, "
                           f"host {cell.fwd_host_us:.0f} / {cell.fwd_bwd_host_us:.0f} us")
            else:
                summary = f"{cell.status} {cell.reason}"
            print(f"[{done}/{len(cells)}] {cell.backend} B={cell.batch} H={cell.heads} N={cell.seq_len} "
                  f"d={cell.head_dim} {cell.dtype}{' causal' if cell.causal else ''}: {summary}", file=sys.stderr,
                  flush=True)
        if args.out:  # keep what is done if the sweep is cut short
            write_results(cells[:done], args.out, meta)
    print(markdown_table(cells))
    return 0


__all__ = ["Cell", "add_arguments", "attention_flops", "markdown_table", "measure_shape", "plan_cells", "run"]

if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m lmtrain.bench.attention", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))

