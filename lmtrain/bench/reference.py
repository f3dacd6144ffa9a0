"""The plain-PyTorch reference of ``bench model``: the same model trained by a bare loop, without Lightning.

A ``runner="plain"`` cell of the sweep (``lmtrain.bench.model``) runs :func:`train_plain`, which sets the pace
a Lightning cell of the same size and context could reach::

    model      lmtrain.model.TransformerLM(config) built on the GPU from seed 0; torch.compile(model,
               mode="reduce-overhead") (CUDA graphs through torch.compile) with compile and cuda_graphs,
               torch.compile(model) with compile alone, the eager model without
    optimizer  torch.optim.AdamW(fused=True), LMModule's hyperparameters: lr 3e-4 (constant: no schedule),
               betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices only
    data       random token ids, one batch (B, T + 1) per step, drawn on the GPU before the first step
    step       torch.compiler.cudagraph_mark_step_begin(); forward under autocast (bf16-mixed: bfloat16;
               32-true: none); next-token cross-entropy in fp32; backward; optimizer.step();
               optimizer.zero_grad(set_to_none=True)

Timing: a CUDA event is recorded before and after each step and all are read after one synchronisation at the
end; the first ``warmup`` steps (compilation, CUDA-graph recording) are not counted. The pipeline time is the
first measured step's start to the last one's end, over the measured steps. Each step's loss stays on the GPU
until the end. Needs a CUDA GPU (importable without one).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmtrain.blas import apply_blas_workspace
from lmtrain.config import ModelConfig
from lmtrain.errors import LmtrainError
from lmtrain.model import TransformerLM
from lmtrain.optim import weight_decay_groups

#: Lightning precision -> autocast dtype of the loop (None: no autocast).
AUTOCAST: dict[str, torch.dtype | None] = {"32-true": None, "bf16-mixed": torch.bfloat16}
#: LMModule's AdamW hyperparameters (its defaults).
LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1


@dataclass
class PlainRun:
    """Times (ms) and losses of one run of the loop."""

    warmup_ms: list[float]  # the warm-up steps, start to end
    step_ms: list[float]  # the measured steps, start to end
    pipeline_step_ms: float  # first measured start to last measured end, over the measured steps
    losses: list[float]  # every step's loss, warm-up included


def train_plain(config: ModelConfig, batch_size: int, precision: str, *, compile: bool, cuda_graphs: bool,
                warmup: int, steps: int) -> PlainRun:
    """Train ``TransformerLM(config)`` for ``warmup + steps`` steps with the plain loop and time each step.

    Raises:
        LmtrainError: no CUDA GPU is visible, the precision has no autocast counterpart here, or ``cuda_graphs``
            is asked for without ``compile`` (the loop gets its CUDA graphs from torch.compile).
    """
    if not torch.cuda.is_available():
        raise LmtrainError("--runner", "the plain reference loop times GPU steps (fused AdamW, CUDA events, "
                           "CUDA graphs) and no CUDA GPU is visible.",
                           "run plain cells on a GPU machine, or leave them out (--runner lightning).")
    if precision not in AUTOCAST:
        raise LmtrainError("--precision", f"the plain reference loop has no counterpart for {precision!r}.",
                           f"use {' or '.join(AUTOCAST)} for plain cells.")
    if cuda_graphs and not compile:
        raise LmtrainError("--cuda-graphs", "the plain reference loop gets its CUDA graphs from torch.compile's "
                           "reduce-overhead mode, and compile is off.", "use --compile on with plain graph cells.")
    # The cell's cuBLAS workspace, as LMModule applies it (each cell runs in a process of its own): a plain cell and
    # a Lightning cell of the same options then run with the same workspace
    note = apply_blas_workspace(config.blas_workspace, cuda_graphs)
    if note:
        warnings.warn(note, stacklevel=2)
    device = torch.device("cuda")
    torch.manual_seed(0)
    with device:
        model = TransformerLM(config)
    model.train()
    optimizer = torch.optim.AdamW(weight_decay_groups(model, WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS, fused=True)
    if compile:
        model = torch.compile(model, mode="reduce-overhead" if cuda_graphs else None)
    dtype = AUTOCAST[precision]
    total = warmup + steps
    batches = torch.randint(0, config.vocab_size, (total, batch_size, config.context_length + 1), device=device,
                            generator=torch.Generator(device=device).manual_seed(0))  # (steps, B, T + 1)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
    losses = []
    for i in range(total):
        starts[i].record()
        torch.compiler.cudagraph_mark_step_begin()
        inputs, targets = batches[i, :, :-1], batches[i, :, 1:]  # (B, T) each
        with torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext():
            logits = model(inputs)  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ends[i].record()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]
    pipeline = starts[warmup].elapsed_time(ends[-1]) / steps
    return PlainRun(warmup_ms=times[:warmup], step_ms=times[warmup:], pipeline_step_ms=pipeline,
                    losses=torch.stack(losses).tolist())
