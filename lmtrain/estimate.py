"""Memory plan of a config: parameters, gradients, AdamW states, activations, peak, and the largest context that fits.

    python -m lmtrain estimate --config configs/tiny.yaml [--model.context_length 1024] [--data.batch_size 8]
        [--trainer.precision bf16-mixed] [--model.attention naive] [--gpu-memory-gib 80] [--mode train]

The config is resolved by the parser of ``python -m lmtrain fit`` (``lmtrain.configuration``): the same
sections, links, defaults and dotted overrides, so any option of ``fit`` is accepted here. The formula is in
``lmtrain.memory_plan``; no model is built and no GPU is needed.
"""

from __future__ import annotations

import argparse

from lmtrain.configuration import ResolvedConfig, resolve_args
from lmtrain.errors import LmtrainError
from lmtrain.flops import STEP_MODES, parameter_count
from lmtrain.memory_plan import GIB, PRECISIONS, estimate_memory, max_fitting

#: Arguments this command does not know itself go to the ``fit`` parser.
PASS_UNKNOWN_ARGUMENTS = True


def help_epilog() -> str:
    """The end of ``--help``: the ``fit`` options and the registered attention backends."""
    from lmtrain.attention import available_backends, backend_info

    lines = ["Every option of `python -m lmtrain fit` is accepted too: --config FILE, --model.*, --data.*, --trainer.*",
             "(e.g. --model.context_length 1024, --data.batch_size 8, --trainer.precision bf16-mixed).",
             f"Precisions the planner knows: {', '.join(PRECISIONS)}.", "", "attention backends (--model.attention):"]
    for name in available_backends():
        info = backend_info(name)
        notes = [text for flag, text in ((info.needs_gpu, "CUDA GPU"), (info.materializes_scores,
                                                                        "stores the N x N scores")) if flag]
        lines.append(f"  {name:<14} {info.description}" + (f" ({'; '.join(notes)})" if notes else ""))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``python -m lmtrain estimate`` (the ``fit`` options are parsed by the ``fit`` parser)."""
    parser.add_argument("--mode", choices=STEP_MODES, default=None,
                        help="step to plan: train, forward_backward or forward (default: model.step_mode, train)")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0,
                        help="memory to fit the plan into, GiB (default 80, an 80 GB H100/A100)")


def resolve(args: argparse.Namespace) -> tuple[ResolvedConfig, str]:
    """(resolved config, step mode) of the command line: the ``fit`` options and ``--mode``."""
    resolved = resolve_args(list(getattr(args, "config_args", []) or []))
    mode = args.mode or resolved.model.get("step_mode") or "train"
    if resolved.precision not in PRECISIONS:
        raise LmtrainError("trainer.precision", f"the planner does not know {resolved.precision!r}.",
                           f"use one of {', '.join(PRECISIONS)}.")
    return resolved, mode


def run(args: argparse.Namespace) -> int:
    resolved, mode = resolve(args)
    cfg = resolved.model_config()
    batch = int(resolved.data["batch_size"])
    precision = resolved.precision
    plan = estimate_memory(cfg, batch, cfg.context_length, precision, mode)
    budget = int(args.gpu_memory_gib * GIB)
    print(f"model: {parameter_count(cfg):,} parameters (d_model {cfg.d_model}, {cfg.num_layers} layers, "
          f"{cfg.num_heads} heads, d_ff {cfg.d_ff}, vocab {cfg.vocab_size}), attention {cfg.attention}, "
          f"activation checkpointing {'on' if cfg.activation_checkpointing else 'off'}")
    print(f"step: batch {batch} x context {cfg.context_length}, {precision}, mode {mode}")
    print()
    print(plan.table())
    print()
    max_t = max_fitting(cfg, budget, batch_size=batch, precision=precision, mode=mode)
    max_b = max_fitting(cfg, budget, seq_len=cfg.context_length, precision=precision, mode=mode)
    verdict = "fits" if plan.peak <= budget else "does NOT fit"
    print(f"{plan.peak_gib:.2f} GiB {verdict} in {args.gpu_memory_gib:g} GiB. Largest context at batch {batch}: "
          f"{max_t}; largest batch at context {cfg.context_length}: {max_b}.")
    return 0
