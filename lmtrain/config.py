"""Model configuration: a typed, validated dataclass and the named sizes of the reference profiling study."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

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
        activation_checkpointing: recompute each block's activations in the backward pass instead of
            storing them (less memory, about one extra forward of compute).
        norm_eps: epsilon added inside RMSNorm's square root.
    """

    vocab_size: int = 10_000
    context_length: int = 512
    d_model: int = 768
    num_layers: int = 12
    num_heads: int = 12
    d_ff: int = 3072
    rope_theta: float = 10_000.0
    attention: str = "sdpa"
    activation_checkpointing: bool = False
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
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
