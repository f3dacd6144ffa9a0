"""The settings of the FlashAttention kernels: one frozen object, validated once, set through a function.

Every field's default selects the kernels that serve a call by default (see ``lmtrain.kernels.flash.dispatch``);
the other values exist for measurement (``python -m lmtrain bench attention`` has a flag per field) and for the
determinism or start-up time a user may want. Set them for the whole process with ``set_settings`` or for a block
with ``use_settings``::

    from lmtrain.kernels.flash import use_settings

    with use_settings(gluon="off", autotune=False):
        out = flash_attention(q, k, v)

A bad value stops with one ``LmtrainError`` line naming the field. Settings are part of every launch plan's key,
so a change takes effect on the next call. This module imports neither Triton nor torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from lmtrain.errors import LmtrainError
from lmtrain.kernels.flash.tuning import Config

#: The Gluon kernels a ``gluon`` list may name.
GLUON_KERNELS = ("fwd", "dq", "dkdv")
_GLUON_MODES = ("auto", "all", "off")
_FUSED_MODES = ("auto", "on", "off")
_PLAN_MODES = ("c", "python", "off")


@dataclasses.dataclass(frozen=True)
class FlashSettings:
    """Which FlashAttention kernels may serve a call, and how they launch.

    Attributes:
        gluon: the Gluon (warp-specialised, sm_90) kernels. ``auto``: each where it measured faster than the TMA
            kernel of the same job; ``all``: every Gluon kernel wherever it applies; ``off``: none; or a
            comma-separated list of ``fwd``, ``dq``, ``dkdv``: those wherever they apply.
        fused_backward: the Gluon fused backward (dQ, dK and dV in one kernel, dQ summed by TMA reductions, so dQ
            may differ in its last bits between runs). ``auto``: at head dims 64 and 128 from 4096 keys, with
            ``gluon=auto``; ``on``: wherever it applies; ``off``: never. Never under
            ``torch.use_deterministic_algorithms(True)``.
        tma: the TMA kernels (sm_90 and later, fp16/bf16, head dims multiple of 8 up to 128) for both passes.
        tma_split_head_dim: the TMA kernels cover a head dim that is not a power of two with two column tiles
            (80 -> 64 + 16) rather than one padded tile.
        autotune: autotune the pointer and TMA kernels' block sizes on first use (off: the first configuration
            that fits, a faster start).
        launch_plans: replay a call like an earlier one without re-deciding its launches. ``c``: through Triton's C
            launch function where its launcher has the shape Triton 3.4-3.6 builds, else through the Python
            launcher; ``python``: always through the Python launcher; ``off``: no plans.
        gluon_fwd_config, gluon_dq_config, gluon_dkdv_config: a Gluon kernel's launch configuration instead of the
            tuned one, ``num_wg,block,num_stages[,per_sm[,reg_a[,schedule[,pingpong]]]]`` (see
            ``lmtrain.kernels.flash.tuning.Config``); None: the tuned configuration. ``reg_a`` is refused for dQ
            (it gave wrong dQ at head dim 64 on an H100).
    """

    gluon: str = "auto"
    fused_backward: str = "auto"
    tma: bool = True
    tma_split_head_dim: bool = True
    autotune: bool = True
    launch_plans: str = "c"
    gluon_fwd_config: str | None = None
    gluon_dq_config: str | None = None
    gluon_dkdv_config: str | None = None

    def __post_init__(self) -> None:
        gluon = self.gluon.replace(" ", "") if isinstance(self.gluon, str) else self.gluon
        if not isinstance(gluon, str) or gluon not in _GLUON_MODES and (
                not gluon or any(name not in GLUON_KERNELS for name in gluon.split(","))):
            raise LmtrainError("flash.gluon", f"{self.gluon!r} is not a Gluon setting.",
                               f"use one of {', '.join(_GLUON_MODES)} or a list of {', '.join(GLUON_KERNELS)} "
                               "(e.g. fwd,dq).")
        if gluon not in _GLUON_MODES:  # one spelling per set of kernels, so equal settings compare equal
            gluon = ",".join(name for name in GLUON_KERNELS if name in gluon.split(","))
        object.__setattr__(self, "gluon", gluon)
        for name, allowed in (("fused_backward", _FUSED_MODES), ("launch_plans", _PLAN_MODES)):
            if getattr(self, name) not in allowed:
                raise LmtrainError(f"flash.{name}", f"{getattr(self, name)!r} is not a setting of {name}.",
                                   f"use one of {', '.join(allowed)}.")
        for name in ("tma", "tma_split_head_dim", "autotune"):
            if not isinstance(getattr(self, name), bool):
                raise LmtrainError(f"flash.{name}", f"{getattr(self, name)!r} is not a boolean.", "use true or false.")
        configs = {kernel: self._parse_config(kernel) for kernel in GLUON_KERNELS}
        if configs["dq"] is not None and configs["dq"].reg_a:
            raise LmtrainError("flash.gluon_dq_config", f"reg_a 1 in {self.gluon_dq_config!r} gives wrong dQ.",
                               "leave reg_a at 0 for the dQ kernel.")
        object.__setattr__(self, "_configs", configs)  # parsed once: launchers ask on every call
        # Plan keys hash the settings on every call: once here, not per lookup.
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash

    def gluon_config(self, kernel: str) -> Config | None:
        """The launch configuration given for Gluon kernel ``kernel`` (``fwd``, ``dq``, ``dkdv``), or None."""
        return self._configs[kernel]

    def _parse_config(self, kernel: str) -> Config | None:
        text = getattr(self, f"gluon_{kernel}_config")
        if text is None:
            return None
        try:
            return Config.parse(text)
        except ValueError as exc:
            raise LmtrainError(f"flash.gluon_{kernel}_config", str(exc),
                               "give num_wg,block,num_stages[,per_sm[,reg_a[,schedule[,pingpong]]]].") from None

    def gluon_kernels(self) -> frozenset[str]:
        """The Gluon kernels a list setting names (empty for ``auto``, ``all``, ``off``)."""
        return frozenset() if self.gluon in _GLUON_MODES else frozenset(self.gluon.split(","))

    def as_dict(self) -> dict[str, object]:
        """The fields and their values (what a record stores)."""
        return dataclasses.asdict(self)


_CURRENT = FlashSettings()


def current() -> FlashSettings:
    """The settings in force."""
    return _CURRENT


def set_settings(settings: FlashSettings | None = None, **changes: object) -> FlashSettings:
    """Put ``settings`` (default: those in force), with ``changes`` applied, in force for the whole process.

    Returns:
        The settings in force before.

    Raises:
        LmtrainError: a field has a bad value or does not exist.
    """
    global _CURRENT
    base = settings if settings is not None else _CURRENT
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(FlashSettings)})
    if unknown:
        raise LmtrainError(f"flash.{unknown[0]}", "is not a FlashAttention setting.",
                           f"use one of {', '.join(f.name for f in dataclasses.fields(FlashSettings))}.")
    previous, _CURRENT = _CURRENT, dataclasses.replace(base, **changes)
    return previous


@contextlib.contextmanager
def use_settings(settings: FlashSettings | None = None, **changes: object) -> Iterator[FlashSettings]:
    """``set_settings`` for the block inside, the earlier settings restored after it."""
    previous = set_settings(settings, **changes)
    try:
        yield _CURRENT
    finally:
        set_settings(previous)


__all__ = ["GLUON_KERNELS", "FlashSettings", "current", "set_settings", "use_settings"]
