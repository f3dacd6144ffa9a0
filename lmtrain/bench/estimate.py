"""Memory plan of a config: parameters, gradients, AdamW states, activations, peak, and the largest context that fits.

    python -m lmtrain estimate --config configs/tiny.yaml [--model.context_length 1024] [--data.batch_size 8]
        [--trainer.precision bf16-mixed] [--model.attention naive] [--gpu-memory-gib 80] [--mode train]

The config is read like ``python -m lmtrain fit`` reads it (the ``model``, ``data`` and ``trainer``
sections; the dotted flags override single fields; unset fields take ``LMModule`` / ``LMDataModule``
defaults). The formula is in ``lmtrain.memory_plan``; no model is built and no GPU is needed.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lmtrain.config import ModelConfig
from lmtrain.errors import LmtrainError
from lmtrain.flops import STEP_MODES, parameter_count
from lmtrain.memory_plan import GIB, PRECISIONS, estimate_memory, max_fitting

_MODEL_FIELDS = ("size", "vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff", "rope_theta",
                 "attention", "activation_checkpointing")


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="a YAML config of `python -m lmtrain fit`")
    parser.add_argument("--model.size", dest="size", help="named size (tiny, small .. 2.7B)")
    parser.add_argument("--model.vocab_size", dest="vocab_size", type=int)
    parser.add_argument("--model.context_length", dest="context_length", type=int)
    parser.add_argument("--model.d_model", dest="d_model", type=int)
    parser.add_argument("--model.num_layers", dest="num_layers", type=int)
    parser.add_argument("--model.num_heads", dest="num_heads", type=int)
    parser.add_argument("--model.d_ff", dest="d_ff", type=int)
    parser.add_argument("--model.attention", dest="attention", help="naive, sdpa, flash_pytorch, flash_triton")
    parser.add_argument("--model.activation_checkpointing", dest="activation_checkpointing", type=_bool)
    parser.add_argument("--model.step_mode", "--mode", dest="mode", choices=STEP_MODES,
                        help="train (default), forward_backward or forward")
    parser.add_argument("--data.batch_size", dest="batch_size", type=int)
    parser.add_argument("--trainer.precision", dest="precision", help=", ".join(PRECISIONS))
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0,
                        help="memory to fit the plan into, GiB (default 80, an 80 GB H100/A100)")


def resolve(args: argparse.Namespace) -> tuple[ModelConfig, int, str, str]:
    """(model config, batch size, precision, step mode) from the YAML and the flags."""
    sections: dict[str, Any] = {}
    if args.config is not None:
        import yaml

        if not args.config.is_file():
            raise LmtrainError("--config", f"{args.config} does not exist.", "give the path of a YAML config.")
        sections = yaml.safe_load(args.config.read_text()) or {}
    model = dict(sections.get("model") or {})
    data = dict(sections.get("data") or {})
    trainer = dict(sections.get("trainer") or {})
    for name in _MODEL_FIELDS:
        if getattr(args, name, None) is not None:
            model[name] = getattr(args, name)
    if args.batch_size is not None:
        data["batch_size"] = args.batch_size
    if args.precision is not None:
        trainer["precision"] = args.precision
    mode = args.mode or model.get("step_mode", "train")
    precision = str(trainer.get("precision", "32-true"))
    if precision in ("32", "bf16", "16"):  # Lightning's short forms
        precision = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}[precision]
    if precision not in PRECISIONS:
        raise LmtrainError("trainer.precision", f"the planner does not know {precision!r}.",
                           f"use one of {', '.join(PRECISIONS)}.")
    defaults = {"vocab_size": 10_000, "context_length": 512}  # LMModule's defaults
    cfg_kwargs = {k: model.get(k, defaults.get(k)) for k in _MODEL_FIELDS if k != "size"}
    cfg = ModelConfig.from_size(model.get("size", "small"), **cfg_kwargs)
    batch = int(data.get("batch_size", 4))
    if batch < 1:
        raise LmtrainError("data.batch_size", f"must be positive, got {batch}.", "use 1 or more.")
    return cfg, batch, precision, mode


def run(args: argparse.Namespace) -> int:
    cfg, batch, precision, mode = resolve(args)
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
