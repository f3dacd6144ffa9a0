"""The option schema: every option of the ``model:`` section, declared once, in groups by concern.

Each option is one field of a frozen dataclass group, with its default, its help text (``option(default, doc)``)
and its checks; :class:`ModelConfig` joins the groups into one flat, validated object:

    ========================  ===========================================================================
    :class:`ShapeOptions`     what the weights are: widths, depth, heads, vocabulary, RoPE and RMSNorm
    :class:`OptimizerOptions` AdamW and the learning-rate schedule
    :class:`MemoryOptions`    what a step keeps in memory: activation checkpointing, loss chunks, the
                              in-backward optimizer
    :class:`SpeedOptions`     how a step is computed: attention backend, compile, CUDA graphs, master weights,
                              the optimizer state's dtype, step mode
    :class:`Float8Options`    float8 training of the linear layers (torchao): recipe, size rule, output head
    ========================  ===========================================================================

Everything else reads these fields instead of declaring the options again:

- ``lmtrain.module.LMModule``'s signature and its ``Args`` are built from them (:func:`cli_parameters`), so
  ``python -m lmtrain fit --help`` lists every field with its help, and ``--model.<field>`` / ``model: {...}`` in
  a YAML set it;
- ``lmtrain.bench.model``'s cells are differences from a config: their keys, names, flags and CSV columns come from
  the fields of the step groups (:func:`step_fields`: memory, speed and float8);
- the memory planner (``lmtrain.memory_plan``) plans a ``ModelConfig`` and records its step options.

Checks happen at construction (``__post_init__``): each field's type, range and choices, then each group's own
rules, then the combinations across groups that cannot work, each as one ``LmtrainError`` naming
``model.<field>`` (and the other option of a combination) and the fix. Checks that need the trainer's settings
(precision, strategy, devices, accumulation, clipping: :class:`TrainerSettings`) are ``LMModule.check_settings``'s,
which the command line calls right after parsing and a fit again when it starts.

A new option is one field in the group it belongs to; a new group (float8, say) is one more dataclass among
``ModelConfig``'s bases, and a subclass of ``ModelConfig`` with an extra group is a full schema on its own
(``LMModule.with_config``).
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Mapping
from dataclasses import Field, asdict, dataclass, field, fields, replace
from typing import Any, Literal

from lmtrain.errors import LmtrainError

#: Named sizes (the model table of the reference profiling study, plus ``tiny``). Vocabulary and context
#: length are not part of a size.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=128, d_ff=512, num_layers=4, num_heads=4),
    "small": dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": dict(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    "xl": dict(d_model=1600, d_ff=6400, num_layers=48, num_heads=25),
    "2.7B": dict(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
}

#: Values of ``ModelConfig.activation_checkpointing`` (what each block keeps for the backward pass).
CHECKPOINTING_POLICIES: tuple[str, ...] = ("none", "full", "selective", "offload")
CheckpointingPolicy = Literal["none", "full", "selective", "offload"]
#: ``torch.compile`` modes of ``compile_mode`` (the modes that add CUDA graphs are refused: ``cuda_graphs``
#: captures the whole step).
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
#: ``optimizer_state_dtype`` values (``lmtrain.optim.OPTIMIZER_STATE_DTYPES`` maps them to torch dtypes).
OPTIMIZER_STATES = ("float32", "bfloat16")
#: ``fsdp_reshard_after_forward`` values: which FSDP2 units free their all-gathered parameters after the forward pass.
RESHARD_POLICIES = ("blocks", "all", "none")
#: ``model.blas_workspace``: lmtrain.blas.
BLAS_WORKSPACES = ("auto", "none", "default")
#: Step modes: what one step does (``step_mode``).
STEP_MODES = ("train", "forward", "forward_backward")
StepMode = Literal["train", "forward", "forward_backward"]

#: The model sizes of the reference profiling study, smallest first (``tiny`` is lmtrain's own CPU demo size).
STUDY_SIZES: tuple[str, ...] = ("small", "medium", "large", "xl", "2.7B")
#: Former name of ``STUDY_SIZES`` (still used by tests/test_model.py).
SEED_SIZES = STUDY_SIZES
#: The size ``LMModule`` builds when none is given (its widths are ``ModelConfig``'s defaults).
DEFAULT_SIZE = "small"


def compile_kwargs(mode: str, fullgraph: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``nn.Module.compile`` for a ``compile_mode`` and ``compile_fullgraph`` (none for
    ``default`` without fullgraph)."""
    return {**({} if mode == "default" else {"mode": mode}), **({"fullgraph": True} if fullgraph else {})}


def option(default: Any, doc: str, *, short: str | None = None, choices: tuple[Any, ...] | None = None,
           minimum: int | None = None, positive: bool = False, fix: str | None = None, kind: str = "value",
           from_size: bool = False, weights: bool = False) -> Any:
    """One option of the schema: a dataclass field with its help text and the facts its checks need.

    Args:
        default: the default value.
        doc: the help text (``--help``, ``LMModule``'s docstring, the bench flags).
        short: how a set option shows in a bench cell's name (``_<short><value>``; default: the field name).
        choices: the values allowed (checked at construction).
        minimum: smallest whole number allowed (integer fields).
        positive: the number must be above 0 (float fields).
        fix: the fix of a range or choice error (default: names the allowed values).
        kind: what a value is called in an unknown-choice error (``unknown <kind> 'x'``).
        from_size: ``LMModule``'s ``size`` sets it unless it is given (its CLI default is then null).
        weights: it fixes the weights (their shapes or what they compute): a checkpoint must agree on it.
    """
    return field(default=default, metadata={"doc": doc, "short": short, "choices": choices, "minimum": minimum,
                                            "positive": positive, "fix": fix, "kind": kind, "from_size": from_size,
                                            "weights": weights})


def doc_of(f: Field) -> str:
    """The help text of a schema field (empty for a field declared without ``option``)."""
    return str(f.metadata.get("doc") or "")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _accepts_none(annotation: Any) -> bool:
    return annotation is type(None) or type(None) in typing.get_args(annotation)


def _base_type(annotation: Any) -> Any:
    """``bool``, ``int``, ``float``, ``str`` or ``tuple`` for a field's annotation (None removed); None for a union
    of several kinds (its choices check it)."""
    if typing.get_origin(annotation) is Literal:
        return type(typing.get_args(annotation)[0])
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args and typing.get_origin(annotation) is not tuple:
        kinds = {_base_type(a) for a in args}
        return kinds.pop() if len(kinds) == 1 else None
    return typing.get_origin(annotation) or annotation


def _check_field(f: Field, annotation: Any, value: Any) -> None:
    """Check one value against its field's type, range and choices (one ``LmtrainError`` naming the field)."""
    name, meta = f"model.{f.name}", f.metadata
    if value is None and _accepts_none(annotation):
        return
    kind = _base_type(annotation)
    null = " or null" if _accepts_none(annotation) else ""
    if kind is bool and not isinstance(value, bool):
        raise LmtrainError(name, f"must be true or false, got {value!r}.", f"set {name} to true or false.")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)
                        or value < (meta.get("minimum") or 0)):
        low = meta.get("minimum") or 0
        raise LmtrainError(name, f"must be a whole number >= {low}{null}, got {value!r}.",
                           meta.get("fix") or f"set {name} to a whole number >= {low}{null}.")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))
                          or (meta.get("positive") and value <= 0)):
        raise LmtrainError(name, f"must be a positive number, got {value!r}.",
                           meta.get("fix") or f"set {name} to a number above 0.")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise LmtrainError(name, f"unknown {meta.get('kind', 'value')} {value!r}.",
                           meta.get("fix") or f"use one of {', '.join(map(str, choices))}.")


def check_option(config_class: type, name: str, value: Any) -> None:
    """Check one value of field ``name`` of a schema alone: type, range and choices (not the combinations).

    Raises:
        LmtrainError: the value is not allowed (the field is ``model.<name>``).
    """
    f = next(f for f in fields(config_class) if f.name == name)
    _check_field(f, _hints(config_class)[name], value)


@dataclass(frozen=True)
class OptionGroup:
    """Base of the option groups: ``__post_init__`` normalises, checks every field, then each group's rules.

    A group may define ``_prepare`` (turn accepted spellings into the one the field holds, or refuse a value whose
    generic error would mislead) and ``_check``
    (rules between its own fields; in ``ModelConfig``, the combinations across groups). Each class's own
    methods run once, base groups first.
    """

    def __post_init__(self) -> None:
        own = [cls.__dict__ for cls in reversed(type(self).__mro__)]
        for methods in own:
            if "_prepare" in methods:
                methods["_prepare"](self)
        hints = _hints(type(self))
        for f in fields(self):
            _check_field(f, hints[f.name], getattr(self, f.name))
        for methods in own:
            if "_check" in methods:
                methods["_check"](self)


@dataclass(frozen=True)
class ShapeOptions(OptionGroup):
    """What the weights are: a GPT-style transformer with pre-norm RMSNorm, RoPE, SwiGLU, an untied head and no
    biases."""

    vocab_size: int = option(10_000, "number of token ids; the embedding and the output head have this many rows.",
                             minimum=1, weights=True)
    context_length: int = option(512, "longest sequence the model accepts (tokens per training window; RoPE tables "
                                 "are built for it).", minimum=1)
    d_model: int = option(768, "width of the residual stream.", minimum=1, from_size=True, weights=True)
    num_layers: int = option(12, "number of transformer blocks.", minimum=1, from_size=True, weights=True)
    num_heads: int = option(12, "attention heads per block; must divide d_model into an even head dimension.",
                            minimum=1, from_size=True, weights=True)
    d_ff: int = option(3072, "inner width of the SwiGLU feed-forward block.", minimum=1, from_size=True,
                       weights=True)
    rope_theta: float = option(10_000.0, "RoPE base frequency.", positive=True, fix="use the usual 10000.",
                               weights=True)
    norm_eps: float = option(1e-5, "epsilon added inside RMSNorm's square root.", positive=True, fix="use 1e-5.")

    def _check(self) -> None:
        if self.d_model % self.num_heads:
            raise LmtrainError(
                "model.num_heads", f"{self.num_heads} heads do not divide d_model={self.d_model}.",
                f"choose num_heads among the divisors of {self.d_model} "
                f"(e.g. {_nearest_divisor(self.d_model, self.num_heads)}) or change d_model.")
        if self.head_dim % 2:
            raise LmtrainError("model.num_heads", f"head dimension {self.head_dim} is odd; RoPE rotates pairs.",
                               "choose d_model and num_heads so that d_model / num_heads is even.")

    @property
    def head_dim(self) -> int:
        """Dimension of one attention head (``d_model // num_heads``)."""
        return self.d_model // self.num_heads


@dataclass(frozen=True)
class OptimizerOptions(OptionGroup):
    """AdamW and its learning-rate schedule (linear warmup, then cosine decay)."""

    lr: float = option(3e-4, "peak learning rate, reached after warmup_steps.", positive=True,
                       fix="use lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0.")
    min_lr_ratio: float = option(0.1, "the cosine schedule decays to lr * min_lr_ratio.")
    warmup_steps: int = option(100, "linear warmup from 0 to lr.",
                               fix="use lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0.")
    decay_steps: int | None = option(None, "end of the cosine decay (None: the trainer's total number of "
                                     "steps); a resumed run keeps its checkpoint's.",
                                     minimum=1)
    weight_decay: float = option(0.1, "AdamW decoupled weight decay, applied to matrices only (not to norm gains).")
    betas: tuple[float, float] = option((0.9, 0.95), "AdamW betas.")
    eps: float = option(1e-8, "AdamW epsilon.", positive=True)
    fused_adamw: bool = option(True, "use the fused CUDA AdamW kernel when the parameters are on a GPU.",
                               short="fused")

    def _prepare(self) -> None:
        if isinstance(self.betas, list):  # YAML and the command line give lists; the field holds a tuple
            object.__setattr__(self, "betas", tuple(self.betas))

    def _check(self) -> None:
        if not 0 <= self.min_lr_ratio <= 1:
            raise LmtrainError("model.lr", f"bad schedule lr={self.lr}, min_lr_ratio={self.min_lr_ratio}, "
                               f"warmup_steps={self.warmup_steps}.",
                               "use lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0.")


@dataclass(frozen=True)
class MemoryOptions(OptionGroup):
    """What a step keeps in memory (``docs/long_context.md``); the memory planner reads every field."""

    activation_checkpointing: CheckpointingPolicy | bool = option(
        "none", "what each block keeps for the backward pass: none (everything autograd saves), full (only the "
        "block's input; the backward pass runs the block's forward again, about one extra forward of compute), "
        "selective (the outputs of the matrix products and of attention; the backward pass recomputes only the "
        "elementwise work: norms, RoPE, SiLU, products, residual adds) or offload (full, with the block's input "
        "kept in pinned host memory and copied back for the backward pass). true and false are accepted as full "
        "and none; the field always holds the name.", short="ac", choices=CHECKPOINTING_POLICIES, kind="policy",
        fix=f"use one of {', '.join(CHECKPOINTING_POLICIES)} (true = full, false = none).")
    optimizer_in_backward: bool = option(
        False, "update each parameter with its own AdamW inside the backward pass, as soon as its gradient is "
        "complete, and free the gradient at once (lmtrain.optim.InBackwardAdamW): no full set of gradients ever "
        "exists (saves the gradient bytes, 4 per parameter in fp32 and *-mixed). Same updates, schedule and "
        "weight-decay groups as the ordinary step. Refused with trainer.accumulate_grad_batches > 1, "
        "trainer.gradient_clip_val, trainer.precision: 16-mixed, step modes other than train and DDP on several "
        "ranks (the update would come before the gradient's all-reduce). Under FSDP2 each update follows its "
        "gradient's reduce-scatter.", short="ib")
    loss_chunk_tokens: int = option(
        0, "compute the output head and the cross-entropy over this many tokens at a time, in the forward and the "
        "backward pass, so that the (tokens x vocabulary) logits never exist whole (same loss and gradients); 0 "
        "computes them whole.", short="chunk", fix="use 0 (logits computed whole) or a token count such as 4096.")
    checkpoint_layers: int | None = option(
        None, "how many blocks, counted from the first, activation_checkpointing applies to; the remaining (last) "
        "blocks keep everything for the backward pass, as with none. The last blocks are the first the backward "
        "pass needs, so keeping them whole costs memory only while the backward pass reaches them. None: every "
        "block.", short="cl",
        fix="leave it null (every block) or give how many blocks, from the first, to checkpoint.")
    checkpoint_rest: str = option(
        "none", "what the blocks past checkpoint_layers keep: none (everything) or selective (matrix-product and "
        "attention outputs: about 2.5x less memory per block than none at the 2.7B model's shapes, for nearly the "
        "same saving of recomputation).", short="rest", choices=("none", "selective"), kind="policy",
        fix="use none or selective.")

    def _prepare(self) -> None:
        # Booleans are the older spelling of the two ends (``true`` = ``full``); the field always holds the name
        # so that everything downstream compares strings. Frozen dataclass: set through object.__setattr__.
        checkpointing = self.activation_checkpointing
        if isinstance(checkpointing, str) and checkpointing.lower() in ("true", "false"):
            checkpointing = checkpointing.lower() == "true"  # a command line's `true` can arrive as text
        if isinstance(checkpointing, bool):
            object.__setattr__(self, "activation_checkpointing", "full" if checkpointing else "none")


@dataclass(frozen=True)
class SpeedOptions(OptionGroup):
    """How a step is computed: kernels, compilation, CUDA graphs and the optimizer's storage (``docs/speed.md``)."""

    attention: str = option(
        "sdpa", "attention backend, a name registered in lmtrain.attention: naive (materialised scores), sdpa "
        "(PyTorch's fused kernels), flash_pytorch (tiled reference), flash_triton (Triton kernels, GPU).")
    compile: bool = option(False, "compile the model with torch.compile, in place (nn.Module.compile: checkpoint "
                           "keys stay those of the eager model).")
    step_mode: str = option(
        "train", "train (forward, backward, AdamW step), forward_backward (no optimizer step) or forward (no "
        "gradients at all), for benchmarks that time part of a step with the same loop; those two take no "
        "trainer.accumulate_grad_batches or trainer.gradient_clip_val.", choices=STEP_MODES,
        kind="step mode", short="mode")
    cuda_graphs: bool = option(
        False, "capture the whole training step (forward, backward, optimizer update) as one CUDA graph after "
        "cuda_graph_warmup eager steps and replay it for every later step (lmtrain.graphs, docs/speed.md): one "
        "launch per step instead of one per kernel. Needs a CUDA device, step mode train, batches of one shape "
        "(another shape runs eagerly) and no host work inside the step: refused with gradient accumulation, "
        "trainer.gradient_clip_val, 16-mixed, several devices and activation_checkpointing: offload. The optimizer "
        "is AdamW with capturable=True and the learning rate a device tensor; checkpoints are those of an eager "
        "run. Callbacks see a replayed step as one phase, cuda graph.", short="graphs")
    optimizer_overlap: bool = option(
        False, "with optimizer_in_backward, run the per-parameter updates on a second CUDA stream so that they "
        "overlap with the rest of the backward pass (the same updates; no effect on a CPU).", short="ovl")
    master_weights: bool = option(
        False, "keep the weights of the linear layers (blocks and output head) in bf16, the values autocast would "
        "cast them to, with their fp32 master copies in the optimizer (lmtrain.optim.MasterWeightAdamW): the "
        "forward pass casts no weight, gradients stay bf16, and a fused kernel updates master and moments and "
        "writes the bf16 weight; 12 fewer bytes of memory traffic per parameter and step. Needs "
        "trainer.precision: bf16-mixed; refused with gradient accumulation, gradient clipping and "
        "optimizer_in_backward. Under DDP the weights turn bf16 before DDP wraps the model, so its buckets and "
        "all-reduce are bf16. Under FSDP2 the fp32 shards are the masters (its policy "
        "all-gathers them in bf16): the weights stay fp32 and the fused kernel updates the shards in place. The "
        "fp32 masters are in the optimizer state of a checkpoint (a resumed fit continues exactly).", short="mw")
    compile_mode: str = option(
        "default", "torch.compile's mode with compile: default, or max-autotune-no-cudagraphs (inductor benchmarks "
        "Triton matrix-product templates against cuBLAS for each shape and keeps the fastest; the first steps take "
        "minutes longer). The modes that add CUDA graphs (reduce-overhead, max-autotune) are refused: cuda_graphs "
        "captures the whole step, the optimizer included.", short="cm", choices=COMPILE_MODES, kind="mode")
    optimizer_state_dtype: str = option(
        "float32", "the optimizer state of those bf16 weights under master_weights: float32 (fp32 masters and "
        "moments; the update is AdamW's) or bfloat16, the compact state: each fp32 master stored split into the "
        "bf16 weight and its low 16 bits (exact), the moments in bf16, rounded stochastically so that they stay "
        "unbiased (18 instead of 28 bytes of memory traffic per parameter and step, 6 fewer bytes of memory). "
        "Under FSDP2 the shards stay fp32 and only the moments are bf16 (20 instead of 28 bytes per parameter "
        "and step, 4 fewer bytes of memory). The embedding and norm gains keep an fp32 state. Needs "
        "master_weights: true.", short="state",
        choices=OPTIMIZER_STATES, kind="dtype")
    compile_fullgraph: bool = option(
        False, "with compile: compile each unit (the model, or each block under FSDP2) as one graph "
        "(torch.compile's fullgraph=True), so that a graph break stops the run instead of splitting the unit into "
        "graphs with eager code between them. Needs model.compile: true.", short="fg")
    fsdp_reshard_after_forward: str = option(
        "blocks", "under FSDP2 (ModelParallelStrategy), which units free their all-gathered parameters (in the "
        "compute dtype) after the forward pass: blocks (every block but the last, torchtitan's default: the backward "
        "pass all-gathers each again, one block ahead; the last block, where the backward pass starts, and the root, "
        "which holds the embedding, final norm and output head, stay unsharded), all (the last block too) or none "
        "(every block stays gathered from its forward to its backward: no all-gathers in the backward pass, at the "
        "memory of the whole model in the compute dtype on every GPU). Without FSDP2 it changes nothing.",
        short="reshard",
        choices=RESHARD_POLICIES, kind="policy")
    fsdp_prefetch: bool = option(
        True, "under FSDP2, prefetch explicitly: each block's forward starts the next block's all-gather and each "
        "block's backward the previous block's (FSDPModule.set_modules_to_forward_prefetch / "
        "set_modules_to_backward_prefetch, as torchtitan does), so that the all-gathers run one block ahead of "
        "the compute even where the compiled blocks leave FSDP2's own ordering nothing to go by. false: FSDP2's "
        "implicit prefetching only. Without FSDP2 it changes nothing.", short="pf")
    blas_workspace: str = option(
        "auto", "the workspace cuBLAS gets for matrix products on a CUDA device (lmtrain.blas, docs/speed.md): none "
        "(no workspace: cuBLAS runs the same Hopper GEMM kernels without the 4-byte memset it puts before each, "
        "one GPU operation fewer per product; a CUDA-graph step of 2.7B 1.02x as fast, but an eager step that the "
        "host bounds slower, each product costing the host more), default (PyTorch's workspace) or auto: none "
        "under cuda_graphs, default otherwise. Read when the process makes its first cuBLAS "
        "handle: the module sets it when it is built, before any product runs; CUBLASLT_WORKSPACE_SIZE / "
        "CUBLAS_WORKSPACE_CONFIG set in the environment win over it.",
        short="blasws", choices=BLAS_WORKSPACES, kind="setting")
    cuda_graph_warmup: int = option(3, "eager steps of each fit before the capture (compilation, autotuning, "
                                    "optimizer state).", minimum=1, short="gw",
                                    fix="use 3 (compilation, autotuning and the optimizer state need eager steps "
                                    "first).")

    def _prepare(self) -> None:
        if self.compile_mode in ("reduce-overhead", "max-autotune"):  # known modes, refused for a reason
            raise LmtrainError("model.compile_mode", f"{self.compile_mode!r} adds torch.compile's own CUDA graphs of "
                               "the forward and backward passes.", "use model.cuda_graphs: true (the whole step, "
                               "optimizer included, as one graph) with model.compile_mode: default or "
                               "max-autotune-no-cudagraphs.")

    def _check(self) -> None:
        mode = self.compile_mode
        if mode != "default" and not self.compile:
            raise LmtrainError("model.compile_mode", f"{mode!r} is torch.compile's mode, but model.compile is false.",
                               "set model.compile: true, or leave model.compile_mode: default.")
        if self.compile_fullgraph and not self.compile:
            raise LmtrainError("model.compile_fullgraph", "compiles each unit as one graph, but model.compile is "
                               "false.", "set model.compile: true, or leave model.compile_fullgraph: false.")
        if self.cuda_graphs and self.step_mode != "train":
            raise LmtrainError("model.cuda_graphs", f"captures a whole training step, but step_mode="
                               f"{self.step_mode!r}.", "use step_mode: train with cuda_graphs, or set cuda_graphs: "
                               "false.")
        if self.optimizer_state_dtype != "float32" and not self.master_weights:
            raise LmtrainError("model.optimizer_state_dtype", f"{self.optimizer_state_dtype} is the state of the "
                               "master-weight optimizer only.",
                               "set model.master_weights: true (bf16-mixed), or optimizer_state_dtype: float32.")
        from lmtrain.attention import available_backends

        if self.attention not in available_backends():
            raise LmtrainError("model.attention", f"unknown attention backend {self.attention!r}.",
                               f"use one of {', '.join(available_backends())}.")


#: Values of ``Float8Options.float8``: torchao's float8 training recipes (``lmtrain.float8``).
FLOAT8_RECIPES: tuple[str, ...] = ("none", "tensorwise", "rowwise")


@dataclass(frozen=True)
class Float8Options(OptionGroup):
    """Float8 training of the transformer's linear layers through torchao (``lmtrain.float8``, ``docs/speed.md``).

    Needs ``pip install lmtrain[float8]`` and a GPU of compute capability 8.9 or more (Ada, Hopper); refused on a
    CPU. The embedding is never converted; the output head only with ``float8_head``.
    """

    float8: str = option(
        "none", "float8 training of the linear layers (torchao.float8): none, tensorwise (one scale per tensor, "
        "e4m3 activations and weights, e5m2 gradients; under FSDP2 the weights are all-gathered in float8) or "
        "rowwise (one scale per row, all e4m3, scales rounded down to powers of two). Each converted layer runs "
        "its three matrix products (output, input gradient, weight gradient) as scaled float8 GEMMs; weights, "
        "gradients and optimizer state keep their dtypes, so checkpoints load across float8 settings. Needs a GPU "
        "of compute capability 8.9 or more and torchao (pip install lmtrain[float8]); compile fuses the casts.",
        short="f8", choices=FLOAT8_RECIPES, kind="recipe")
    float8_min_features: int = option(
        2048, "size rule: a linear layer is converted only if its in_features and out_features are both at least "
        "this (and multiples of 16, which float8 GEMMs need); smaller ones stay in the trainer's precision, where "
        "the casts would cost more than the faster GEMM saves. The default is torchao's guidance (its recipe "
        "filters, from H100 GEMM benchmarks; docs/speed.md), not a measurement: 2.7B's block layers (2560 and "
        "10240 wide) are converted, small's (768) are not.", short="f8min", minimum=16,
        fix="use a width such as 2048 (16 converts every layer whose widths are multiples of 16).")
    float8_head: bool = option(
        False, "convert the output head too (under the same size rule); the embedding is never converted. The "
        "head's logits feed the loss directly, so its float8 error reaches the loss unaveraged.", short="f8head")

    def _check(self) -> None:
        if self.float8_head and self.float8 == "none":
            raise LmtrainError("model.float8_head", "converts the output head to float8, but model.float8 is none.",
                               "set model.float8: tensorwise (or rowwise), or leave float8_head false.")


@dataclass(frozen=True)
class ModelConfig(Float8Options, SpeedOptions, MemoryOptions, OptimizerOptions, ShapeOptions):
    """Every option of the ``model:`` section: the groups' fields, flat (``cfg.d_model``, ``cfg.cuda_graphs``).

    ``lmtrain.model.TransformerLM`` reads the shape and memory fields, ``lmtrain.module.LMModule`` the rest, the
    memory planner and the benchmarks the same object. Construction checks every field and the combinations below;
    an error is one ``LmtrainError`` naming ``model.<field>`` and the fix.
    """

    def _check(self) -> None:
        # Combinations across groups that cannot work, refused when the options are parsed.
        if self.optimizer_overlap and not self.optimizer_in_backward:
            raise LmtrainError("model.optimizer_overlap", "overlaps the in-backward optimizer updates, which are off.",
                               "also set model.optimizer_in_backward: true, or leave optimizer_overlap false.")
        if self.master_weights and self.optimizer_in_backward:
            raise LmtrainError("model.master_weights", "is not available with model.optimizer_in_backward (each "
                               "in-backward update is a plain AdamW).",
                               "set one of model.master_weights and model.optimizer_in_backward to false.")
        if self.optimizer_in_backward and self.step_mode != "train":
            raise LmtrainError("model.optimizer_in_backward", f"updates parameters inside the backward pass, but "
                               f"step_mode={self.step_mode!r} takes no optimizer step.",
                               "set model.optimizer_in_backward: false for forward or forward_backward timing.")
        if self.cuda_graphs and self.activation_checkpointing == "offload":
            raise LmtrainError("model.cuda_graphs", "replays the whole step as one graph, so it cannot copy saved "
                               "tensors to freshly pinned host memory (model.activation_checkpointing: offload).",
                               "use model.activation_checkpointing: full or selective, or set model.cuda_graphs: "
                               "false.")
        if self.float8_head and self.loss_chunk_tokens:
            raise LmtrainError("model.float8_head", "converts the output head, but model.loss_chunk_tokens computes "
                               "the head's product itself, a chunk at a time, in the trainer's precision.",
                               "set one of model.float8_head: false and model.loss_chunk_tokens: 0.")

    @classmethod
    def from_size(cls, size: str, **overrides: Any) -> ModelConfig:
        """The named size (``small`` .. ``2.7B``, or ``tiny``) with any field overridden (None: the default).

        Raises:
            LmtrainError: the size is unknown or an override is not a field.
        """
        if size not in SIZES:
            raise LmtrainError("model.size", f"unknown size {size!r}.", f"use one of {', '.join(SIZES)}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise LmtrainError(f"model.{unknown[0]}", f"is not a {cls.__name__} field.",
                               f"use one of {sorted(known)}.")
        return cls(**{**SIZES[size], **{k: v for k, v in overrides.items() if v is not None}})

    @classmethod
    def from_module_kwargs(cls, kwargs: Mapping[str, Any]) -> ModelConfig:
        """The config that ``LMModule(**kwargs)`` builds: ``size`` plus the keys that are fields (None: from size
        or the default). Keys that are not fields are ignored."""
        known = {f.name for f in fields(cls)}
        return cls.from_size(kwargs.get("size", DEFAULT_SIZE), **{k: v for k, v in kwargs.items() if k in known})

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TrainerSettings:
    """The trainer's settings that the model options are checked against (``LMModule.check_settings``): read from a
    Lightning trainer when a fit starts (``lmtrain.module.trainer_settings``), or from the parsed ``trainer:`` section
    before the trainer exists (``lmtrain.cli_config.parsed_trainer_settings``), so that the command line refuses a
    combination with one line before Lightning prints anything.

    Attributes:
        precision: Lightning's long precision name (``32-true``, ``bf16-mixed``, ...).
        strategy: ``single``, ``ddp``, ``fsdp`` or ``other`` (``lmtrain.memory_plan.strategy_kind``).
        world_size: processes of the run; None where not known yet (checks that need it pass).
        device: the device the model trains on (``cpu``, ``cuda:0``); None where not known yet (checks that need
            it pass).
        accumulate_grad_batches: ``trainer.accumulate_grad_batches``.
        gradient_clip_val: ``trainer.gradient_clip_val`` (None or 0: no clipping).
    """

    precision: str = "32-true"
    strategy: str = "single"
    world_size: int | None = 1
    device: str | None = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None

    @property
    def several_ranks(self) -> bool:
        """The run is known to have more than one process."""
        return self.world_size is not None and self.world_size > 1


#: The groups whose fields describe how a step is computed and what it keeps: the options of a bench cell and of
#: the memory plan.
STEP_GROUPS: tuple[type, ...] = (MemoryOptions, SpeedOptions, Float8Options)


def step_fields(config_class: type = ModelConfig) -> tuple[Field, ...]:
    """The step options of a schema: the fields of ``config_class`` that come from a step group (``STEP_GROUPS``,
    or a group derived from one), in declaration order."""
    step = [c for c in config_class.__mro__ if any(issubclass(c, g) for g in STEP_GROUPS)
            and not issubclass(c, ModelConfig)]  # a schema's own fields belong to no group
    names = {name for c in step for name in c.__dict__.get("__annotations__", {})}
    return tuple(f for f in fields(config_class) if f.name in names)


def weight_fields(config_class: type = ModelConfig) -> tuple[str, ...]:
    """Fields that fix the weights: a checkpoint must agree on all of them."""
    return tuple(f.name for f in fields(config_class) if f.metadata.get("weights"))


def cli_parameters(config_class: type = ModelConfig) -> list[tuple[inspect.Parameter, str]]:
    """``LMModule``'s keyword parameters and their help, from the schema: ``size``, then every field.

    A field that ``size`` sets (``from_size``) defaults to None (from the size); the rest default to the field's
    default. Annotations are the fields' own, so the command line parses and checks types as the schema does.
    """
    kw = inspect.Parameter.KEYWORD_ONLY
    size_doc = (f"named size ({', '.join(SIZES)}) giving d_model, d_ff, num_layers and num_heads; each of those "
                "four can be overridden.")
    params = [(inspect.Parameter("size", kw, default=DEFAULT_SIZE, annotation=str), size_doc)]
    hints = _hints(config_class)
    for f in fields(config_class):
        annotation = hints[f.name]
        doc = doc_of(f)
        if f.metadata.get("from_size"):
            annotation, default, doc = annotation | None, None, f"{doc} (None: from size)"
        else:
            default = f.default
        params.append((inspect.Parameter(f.name, kw, default=default, annotation=annotation), doc))
    return params


def _nearest_divisor(n: int, near: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - near), d))
