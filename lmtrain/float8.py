"""Float8 training of a ``TransformerLM``'s linear layers through torchao (``model.float8``).

torchao's ``torchao.float8`` swaps each chosen ``nn.Linear`` for a ``Float8Linear`` that runs its three matrix
products (output = input x weight^T, grad_input = grad_output x weight, grad_weight = grad_output^T x input) as
scaled float8 GEMMs (``torch._scaled_mm``) with dynamic scales: each operand's amax is taken when it is cast, and
its scale is ``float8 max / amax``. The weight stays a parameter of the same name, shape and dtype, so checkpoints
load across ``float8`` settings and every optimizer (master weights, the compact state, in-backward updates) sees
the same parameters.

Which layers (:func:`converts`): the blocks' linear layers whose in and out features are both at least
``model.float8_min_features`` and multiples of 16 (float8 GEMMs need that); the output head only with
``model.float8_head``; never the embedding (not a linear layer).

Where (the order of torchtitan): after the model is built and before ``torch.compile`` (which fuses the casts
into the surrounding kernels) and before FSDP2's ``fully_shard`` (with ``tensorwise`` the weights are then
all-gathered in float8, ``enable_fsdp_float8_all_gather``): ``LMModule.configure_model`` and
``lmtrain.distributed.build_sharded_model`` call :func:`convert_model`.

torchao is an optional dependency (``pip install lmtrain[float8]``), imported only when a model is converted or a
float8 run is checked; without it ``model.float8`` is refused with one line (:func:`load_float8`).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from torch import nn

from lmtrain.analysis.float8 import CastSpec
from lmtrain.config import ModelConfig, TrainerSettings
from lmtrain.errors import LmtrainError

#: Smallest CUDA compute capability with float8 tensor cores (Ada 8.9, Hopper 9.0).
FLOAT8_MIN_CAPABILITY: tuple[int, int] = (8, 9)
#: Float8 GEMMs need every dimension to be a multiple of this.
FLOAT8_ALIGNMENT = 16
#: Trainer precisions float8 runs under: the high precision of torchao's recipes is bf16 or fp32.
FLOAT8_PRECISIONS: tuple[str, ...] = ("bf16-mixed", "bf16-true", "32-true")
#: Name of the output head in ``TransformerLM``.
HEAD = "lm_head"

Importer = Callable[[str], ModuleType]


class _DropImportNotes(logging.Filter):
    """Drops the lines importing torchao logs that concern nothing float8 training uses: its optional C++ extensions
    (MX formats, CUTLASS kernels) that a build without them cannot load, and torch's deprecation of the way torchao
    registers an enum with ``torch.compile``."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not (text.startswith("Failed to load") or "register_constant()" in text)


@contextmanager
def _import_notes_off() -> Iterator[None]:
    drop = _DropImportNotes()
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    for lg in loggers:
        lg.addFilter(drop)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(drop)


def load_float8(importer: Importer = importlib.import_module) -> ModuleType:
    """``torchao.float8``, or one ``LmtrainError`` naming ``model.float8`` whose fix installs it.

    Args:
        importer: imports a module by name (tests pass one that fails, to see the refusal).

    Raises:
        LmtrainError: torchao is not installed.
    """
    try:
        with _import_notes_off():
            return importer("torchao.float8")
    except ImportError as error:
        raise LmtrainError("model.float8", f"needs torchao's float8 training, which is not installed ({error}).",
                           "pip install lmtrain[float8]") from None


def converts(module: nn.Module, name: str, cfg: ModelConfig) -> bool:
    """Whether :func:`convert_model` turns submodule ``name`` of a ``TransformerLM`` into float8 (the size rule).

    Args:
        module: the submodule.
        name: its path in the model (``blocks.0.attn.qkv``, ``lm_head``).
        cfg: the model's options (``float8_min_features``, ``float8_head``).
    """
    if not isinstance(module, nn.Linear):
        return False
    return converts_shape(module.in_features, module.out_features, name.split(".")[-1] == HEAD, cfg)


def converts_shape(in_features: int, out_features: int, head: bool, cfg: ModelConfig) -> bool:
    """The size rule on a linear layer's widths: both at least ``cfg.float8_min_features`` and multiples of 16;
    the output head only with ``cfg.float8_head``; nothing with ``cfg.float8: none`` (what the memory planner
    reads)."""
    if cfg.float8 == "none" or (head and not cfg.float8_head):
        return False
    return all(w >= cfg.float8_min_features and w % FLOAT8_ALIGNMENT == 0 for w in (in_features, out_features))


def block_linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear layer of a ``TransformerLM`` block, by its path in the block."""
    d, f = cfg.d_model, cfg.d_ff
    return {"attn.qkv": (d, 3 * d), "attn.out": (d, d), "mlp.w1": (d, f), "mlp.w2": (f, d), "mlp.w3": (d, f)}


def linear_config(recipe: str, fsdp: bool = False, importer: Importer = importlib.import_module) -> Any:
    """torchao's ``Float8LinearConfig`` for a ``model.float8`` recipe (``tensorwise`` or ``rowwise``).

    Args:
        recipe: the recipe's name (``Float8LinearConfig.from_recipe_name``).
        fsdp: the model is sharded with FSDP2: with ``tensorwise``, all-gather the weights in float8 (half the
            bytes of bf16); ``rowwise`` all-gathers them in the high precision (torchao casts per row after the
            gather).
        importer: imports a module by name (:func:`load_float8`).
    """
    config = load_float8(importer).Float8LinearConfig.from_recipe_name(recipe)
    if fsdp and recipe == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def convert_model(model: nn.Module, cfg: ModelConfig, fsdp: bool = False,
                  importer: Importer = importlib.import_module) -> list[str]:
    """Convert ``model``'s linear layers to float8 training in place, as ``cfg.float8`` asks; nothing for ``none``.

    Call it before ``torch.compile`` and before FSDP2's ``fully_shard``.

    Args:
        model: a ``TransformerLM`` (its submodule names decide which layer is the head).
        cfg: the options (``float8``, ``float8_min_features``, ``float8_head``).
        fsdp: the model will be sharded with FSDP2 (:func:`linear_config`).
        importer: imports a module by name (:func:`load_float8`).

    Returns:
        The paths of the converted layers, in module order.

    Raises:
        LmtrainError: torchao is not installed.
    """
    if cfg.float8 == "none":
        return []
    float8 = load_float8(importer)
    chosen = [name for name, module in model.named_modules() if converts(module, name, cfg)]
    float8.convert_to_float8_training(model, config=linear_config(cfg.float8, fsdp, importer),
                                      module_filter_fn=lambda module, name: converts(module, name, cfg))
    return chosen


def float8_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The float8 layers of ``model`` (torchao ``Float8Linear`` modules) by path; empty when torchao was never
    imported (then nothing can have been converted, and nothing is imported here)."""
    if "torchao.float8" not in sys.modules:
        return {}
    linear = sys.modules["torchao.float8"].float8_linear.Float8Linear
    return {name: module for name, module in model.named_modules() if isinstance(module, linear)}


def check_float8_device(device: torch.device, capability: tuple[int, int] | None = None) -> None:
    """Refuse a device without float8 tensor cores: a CPU, or a GPU below compute capability 8.9.

    Args:
        device: the device the model trains on.
        capability: the GPU's compute capability (default: asked from CUDA for ``device``).

    Raises:
        LmtrainError: naming ``model.float8``.
    """
    if device.type != "cuda":
        raise LmtrainError("model.float8", f"runs float8 GEMMs on GPU tensor cores; this run trains on "
                           f"{device.type}.", "set model.float8: none, or train on a GPU of compute capability 8.9 "
                           "or more (Ada, Hopper).")
    major, minor = capability or torch.cuda.get_device_capability(device)
    if (major, minor) < FLOAT8_MIN_CAPABILITY:
        raise LmtrainError("model.float8", f"needs float8 tensor cores (compute capability 8.9 or more); this GPU "
                           f"has {major}.{minor}.", "set model.float8: none on this GPU, or use an Ada or Hopper GPU.")


def check_float8_run(settings: TrainerSettings, importer: Importer = importlib.import_module) -> None:
    """Refuse a fit that float8 training cannot run: no torchao, a precision it cannot cast from, or a device
    without float8 tensor cores.

    Args:
        settings: the trainer's settings (``LMModule.check_settings``: at parse time, where the device is known only
            for a run that can train on the CPU alone, and when a fit starts).
        importer: imports a module by name (:func:`load_float8`).

    Raises:
        LmtrainError: torchao is missing, the precision is fp16, or the device has no float8 tensor cores.
    """
    load_float8(importer)
    if settings.precision not in FLOAT8_PRECISIONS:
        raise LmtrainError("model.float8", f"casts bf16 or fp32 values to float8 (torchao's recipes); this run's "
                           f"trainer.precision is {settings.precision}.",
                           f"use trainer.precision: bf16-mixed (or one of {', '.join(FLOAT8_PRECISIONS)}).")
    if settings.device is not None:
        check_float8_device(torch.device(settings.device))


def gemm_specs(config: Any) -> dict[str, tuple[CastSpec, CastSpec] | None]:
    """How a torchao ``Float8LinearConfig`` casts the operands (A, B) of each GEMM of a layer
    (``lmtrain.analysis.float8.GEMMS``); None for a GEMM it leaves in high precision."""

    def spec(cast_config: Any) -> CastSpec | None:
        if cast_config.scaling_type.value == "disabled":
            return None
        return CastSpec(cast_config.target_dtype, rowwise=cast_config.scaling_granularity.value == "axiswise",
                        pow2=config.round_scales_to_power_of_2)

    pairs = {
        "output": (config.cast_config_input, config.cast_config_weight),
        "grad_input": (config.cast_config_grad_output, config.cast_config_weight_for_grad_input),
        "grad_weight": (config.cast_config_grad_output_for_grad_weight, config.cast_config_input_for_grad_weight),
    }
    out: dict[str, tuple[CastSpec, CastSpec] | None] = {}
    for name, (a, b) in pairs.items():
        a_spec, b_spec = spec(a), spec(b)
        out[name] = None if a_spec is None or b_spec is None else (a_spec, b_spec)
    return out
