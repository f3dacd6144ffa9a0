"""Model configuration: a typed, validated dataclass and the named sizes of the reference profiling study."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
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

#: ``torch.compile`` modes of ``LMModule(compile_mode=...)`` (the modes that add CUDA graphs are refused: the
#: module's ``cuda_graphs`` captures the whole step).
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
#: ``optimizer_state_dtype`` values (``lmtrain.optim.OPTIMIZER_STATE_DTYPES`` maps them to torch dtypes).
OPTIMIZER_STATES = ("float32", "bfloat16")


def compile_kwargs(mode: str) -> dict[str, str]:
    """Keyword arguments of ``nn.Module.compile`` for a ``compile_mode`` (none for ``default``)."""
    return {} if mode == "default" else {"mode": mode}

#: The model sizes of the reference profiling study, smallest first (``tiny`` is lmtrain's own CPU demo size).
STUDY_SIZES: tuple[str, ...] = ("small", "medium", "large", "xl", "2.7B")
#: Former name of ``STUDY_SIZES`` (still used by tests/test_model.py).
SEED_SIZES = STUDY_SIZES
#: The size ``LMModule`` builds when none is given (its widths are ``ModelConfig``'s defaults).
DEFAULT_SIZE = "small"


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a GPT-style transformer LM: pre-norm RMSNorm, RoPE, SwiGLU, untied head, no biases.

    Attributes:
        vocab_size: number of token ids; the embedding and the output head have this many rows.
        context_length: longest sequence the model accepts (RoPE tables are built for it).
        d_model: width of the residual stream.
        num_layers: number of transformer blocks.
        num_heads: attention heads per block; must divide ``d_model`` into an even head dimension.
        d_ff: inner width of the SwiGLU feed-forward block.
        rope_theta: RoPE base frequency.
        attention: attention backend name from ``lmtrain.attention`` (``naive``, ``sdpa``,
            ``flash_pytorch``, ``flash_triton``).
        activation_checkpointing: what each block keeps for the backward pass (``docs/long_context.md``):
            ``none`` (everything autograd saves), ``full`` (only the block's input; the backward pass runs the
            block's forward again, about one extra forward of compute), ``selective`` (the outputs of the
            matrix products and of attention; the backward pass recomputes only the elementwise work: norms,
            RoPE, SiLU, products, residual adds) or ``offload`` (``full``, with the block's input kept in
            pinned host memory and copied back for the backward pass). ``true`` and ``false`` are accepted as
            ``full`` and ``none``; the field always holds the name.
        checkpoint_layers: how many blocks, counted from the first, ``activation_checkpointing`` applies to;
            the remaining (last) blocks keep everything for the backward pass, as with ``none``. Trades memory for
            recomputation block by block: the last blocks are the first the backward pass needs, so keeping them
            whole costs memory only while the backward pass reaches them. None: every block.
        checkpoint_rest: what the blocks past ``checkpoint_layers`` keep: ``none`` (everything) or ``selective``
            (matrix-product and attention outputs: about 2.5x less memory per block than ``none`` at the 2.7B
            model's shapes, for nearly the same saving of recomputation).
        norm_eps: epsilon added inside RMSNorm's square root.
        optimizer_in_backward: apply each parameter's AdamW update inside the backward pass, as soon as its
            gradient is complete, and free that gradient at once, so no full set of gradients ever exists
            (saves the gradient bytes, one per parameter, 4 bytes each in fp32 and *-mixed). Incompatible
            with gradient accumulation, global-norm gradient clipping, ``16-mixed`` (loss scaling) and step
            modes other than ``train``; ``lmtrain.module.LMModule`` checks those against the trainer.
        optimizer_overlap: with ``optimizer_in_backward``, run the per-parameter updates on a second CUDA
            stream so that they overlap with the rest of the backward pass (the same updates; on a CPU there
            is no second stream and it changes nothing).
        loss_chunk_tokens: compute the output head and the cross-entropy over this many tokens at a time, in
            the forward and the backward pass, so that the (tokens x vocabulary) logits never exist whole;
            0 computes them whole.
        master_weights: the linear layers' weights are stored in bf16 with fp32 masters in the optimizer
            (``lmtrain.optim.MasterWeightAdamW``; bf16-mixed only, checked by ``lmtrain.module.LMModule``).
        optimizer_state_dtype: that optimizer's state: ``float32`` (fp32 masters and moments) or ``bfloat16``
            (masters split into the bf16 weight and their low 16 bits, bf16 moments); ``bfloat16`` needs
            ``master_weights``. These two fields are step options like ``optimizer_in_backward``: the memory
            planner reads them.
    """

    vocab_size: int = 10_000
    context_length: int = 512
    d_model: int = 768
    num_layers: int = 12
    num_heads: int = 12
    d_ff: int = 3072
    rope_theta: float = 10_000.0
    attention: str = "sdpa"
    activation_checkpointing: CheckpointingPolicy | bool = "none"
    norm_eps: float = 1e-5
    checkpoint_layers: int | None = None
    checkpoint_rest: Literal["none", "selective"] = "none"
    optimizer_in_backward: bool = False
    optimizer_overlap: bool = False
    loss_chunk_tokens: int = 0
    master_weights: bool = False
    optimizer_state_dtype: str = "float32"

    def __post_init__(self) -> None:
        # Booleans are the older spelling of the two ends (``true`` = ``full``); the field always holds the name
        # so that everything downstream compares strings. Frozen dataclass: set through object.__setattr__.
        checkpointing = self.activation_checkpointing
        if isinstance(checkpointing, str) and checkpointing.lower() in ("true", "false"):
            checkpointing = checkpointing.lower() == "true"  # a command line's `true` can arrive as text
        if isinstance(checkpointing, bool):
            object.__setattr__(self, "activation_checkpointing", "full" if checkpointing else "none")
        elif checkpointing not in CHECKPOINTING_POLICIES:
            raise LmtrainError("model.activation_checkpointing", f"unknown policy {checkpointing!r}.",
                               f"use one of {', '.join(CHECKPOINTING_POLICIES)} (true = full, false = none).")
        layers = self.checkpoint_layers
        if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 0):
            raise LmtrainError("model.checkpoint_layers", f"must be a whole number >= 0 or null, got {layers!r}.",
                               "leave it null (every block) or give how many blocks, from the first, to checkpoint.")
        if self.checkpoint_rest not in ("none", "selective"):
            raise LmtrainError("model.checkpoint_rest", f"unknown policy {self.checkpoint_rest!r}.",
                               "use none or selective.")
        for name in ("optimizer_in_backward", "optimizer_overlap", "master_weights"):
            if not isinstance(getattr(self, name), bool):
                raise LmtrainError(f"model.{name}", f"must be true or false, got {getattr(self, name)!r}.",
                                   f"set model.{name} to true or false.")
        if self.optimizer_overlap and not self.optimizer_in_backward:
            raise LmtrainError("model.optimizer_overlap", "overlaps the in-backward optimizer updates, which are off.",
                               "also set model.optimizer_in_backward: true, or leave optimizer_overlap false.")
        if self.optimizer_state_dtype not in OPTIMIZER_STATES:
            raise LmtrainError("model.optimizer_state_dtype", f"unknown dtype {self.optimizer_state_dtype!r}.",
                               f"use one of {', '.join(OPTIMIZER_STATES)}.")
        if self.optimizer_state_dtype != "float32" and not self.master_weights:
            raise LmtrainError("model.optimizer_state_dtype", f"{self.optimizer_state_dtype} is the state of the "
                               "master-weight optimizer only.",
                               "set model.master_weights: true (bf16-mixed), or optimizer_state_dtype: float32.")
        if self.master_weights and self.optimizer_in_backward:
            raise LmtrainError("model.master_weights", "is not available with model.optimizer_in_backward (each "
                               "in-backward update is a plain AdamW).",
                               "set one of model.master_weights and model.optimizer_in_backward to false.")
        chunk = self.loss_chunk_tokens
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise LmtrainError("model.loss_chunk_tokens", f"must be a whole number >= 0, got {chunk!r}.",
                               "use 0 (logits computed whole) or a token count such as 4096.")
        for name in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise LmtrainError(f"model.{name}", f"must be a positive integer, got {value!r}.",
                                   f"set model.{name} to a whole number above 0.")
        if self.rope_theta <= 0:
            raise LmtrainError("model.rope_theta", f"must be positive, got {self.rope_theta!r}.",
                               "use the usual 10000.")
        if self.norm_eps <= 0:
            raise LmtrainError("model.norm_eps", f"must be positive, got {self.norm_eps!r}.", "use 1e-5.")
        if self.d_model % self.num_heads:
            raise LmtrainError(
                "model.num_heads",
                f"{self.num_heads} heads do not divide d_model={self.d_model}.",
                f"choose num_heads among the divisors of {self.d_model} "
                f"(e.g. {_nearest_divisor(self.d_model, self.num_heads)}) or change d_model.",
            )
        if self.head_dim % 2:
            raise LmtrainError("model.num_heads", f"head dimension {self.head_dim} is odd; RoPE rotates pairs.",
                               "choose d_model and num_heads so that d_model / num_heads is even.")
        from lmtrain.attention import available_backends

        if self.attention not in available_backends():
            raise LmtrainError("model.attention", f"unknown attention backend {self.attention!r}.",
                               f"use one of {', '.join(available_backends())}.")

    @property
    def head_dim(self) -> int:
        """Dimension of one attention head (``d_model // num_heads``)."""
        return self.d_model // self.num_heads

    @classmethod
    def from_size(cls, size: str, **overrides: Any) -> ModelConfig:
        """The named size (``small`` .. ``2.7B``, or ``tiny``) with any field overridden.

        Raises:
            LmtrainError: the size is unknown or an override is not a field.
        """
        if size not in SIZES:
            raise LmtrainError("model.size", f"unknown size {size!r}.", f"use one of {', '.join(SIZES)}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise LmtrainError(f"model.{unknown[0]}", "is not a ModelConfig field.", f"use one of {sorted(known)}.")
        return cls(**{**SIZES[size], **{k: v for k, v in overrides.items() if v is not None}})

    @classmethod
    def from_module_kwargs(cls, kwargs: Mapping[str, Any]) -> ModelConfig:
        """The config that ``LMModule(**kwargs)`` builds: ``size`` plus the keys that are fields (None: from size).

        Keys that are not fields (``lr``, ``compile``, ...) are ignored.
        """
        known = {f.name for f in fields(cls)}
        return cls.from_size(kwargs.get("size", DEFAULT_SIZE), **{k: v for k, v in kwargs.items() if k in known})

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nearest_divisor(n: int, near: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - near), d))
