"""Float8 numerics of a scaled GEMM, from its high-precision operands: what ``PrecisionInspector`` reports.

A float8 training layer (torchao's ``Float8Linear``, ``lmtrain.float8``) casts each operand of each of its three
GEMMs to float8 with a dynamic scale: ``amax`` is the largest magnitude over the scaled block (the whole tensor
for ``tensorwise``; each row of A and each column of B for ``rowwise``, that is along the contraction dimension),
``scale = float8 max / amax`` (rounded down to a power of two where the recipe says so), and the cast is
``clamp(x * scale, -max, max)`` rounded to float8. This module replays those casts with plain float8 dtype
conversions (``torch.float8_e4m3fn`` / ``float8_e5m2``, which work on a CPU as well as a GPU) and never runs a
float8 GEMM, so every number here can be checked on a CPU:

- ``saturated``: the fraction of the operand's values that the clamp changes, those beyond ``max`` by more than
  half a float8 step at ``max`` (round-to-nearest would bring the ones closer to ``max`` anyway; for e5m2 also those
  exactly half a step beyond, which round to inf);
- ``underflow``: the fraction of its values that are not zero but whose float8 cast is zero (flushed);
- ``rel_err``: ``||C8 - C16|| / ||C16||`` (Frobenius norms) between the GEMM of the dequantised float8 operands,
  accumulated in fp32, and the same GEMM of the operands rounded to bf16 (fp32 accumulation, a bf16 GEMM before
  its output is rounded). It is the error of the casts alone. The real GEMMs differ: torchao runs the forward
  (``output``) GEMM with ``use_fast_accum=True`` (``Float8LinearConfig.gemm_config_output``; both recipes lmtrain
  uses), whose Hopper tensor cores accumulate in a narrower format and promote to fp32 only now and then, and
  every GEMM rounds its output to bf16; so the replay's error can understate the real one slightly (the GPU test
  ``test_the_replay_matches_the_real_float8_gemm`` bounds the gap). ``grad_input`` and ``grad_weight`` run
  without fast accumulation.

Pure functions of tensors, no hooks: the capture lives in ``lmtrain.callbacks.precision``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

#: torchao's floor on amax before the scale is taken (``torchao.float8.float8_utils.EPS``).
AMAX_EPS = 1e-12
#: The three GEMMs of a linear layer, and the operands (A, B) of each, as ``A @ B``:
#: output = input (M, K) @ weight^T (K, N); grad_input = grad_output (M, N) @ weight (N, K);
#: grad_weight = grad_output^T (N, M) @ input (M, K).
GEMMS: dict[str, tuple[str, str]] = {
    "output": ("input", "weight"),
    "grad_input": ("grad_output", "weight"),
    "grad_weight": ("grad_output", "input"),
}


@dataclass(frozen=True)
class CastSpec:
    """How one operand of a GEMM is cast to float8.

    Args:
        dtype: the float8 dtype (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``).
        rowwise: one scale per slice along the contraction dimension (torchao's axiswise granularity) instead of
            one per tensor.
        pow2: scales rounded down to a power of two (torchao's ``round_scales_to_power_of_2``).
    """

    dtype: torch.dtype
    rowwise: bool = False
    pow2: bool = False


@dataclass
class CastStats:
    """One operand's float8 cast: its amax, scale (min and max over the scaled blocks) and lost fractions."""

    dtype: str
    amax: float
    scale_min: float
    scale_max: float
    saturated: float
    underflow: float


@dataclass
class GemmStats:
    """One GEMM of one layer: the cast of each operand and the relative error of the float8 result."""

    a: CastStats
    b: CastStats
    rel_err: float


@dataclass
class Float8LayerStats:
    """The three GEMMs of one float8 layer at one step (a GEMM that did not run, e.g. without a backward pass,
    is absent)."""

    layer: str
    step: int
    gemms: dict[str, GemmStats] = field(default_factory=dict)

    def worst(self) -> tuple[float, float]:
        """The largest saturated and underflow fractions over every operand of every GEMM."""
        casts = [c for g in self.gemms.values() for c in (g.a, g.b)]
        return max((c.saturated for c in casts), default=0.0), max((c.underflow for c in casts), default=0.0)

    def finite(self) -> bool:
        """Every operand of every GEMM had a finite amax (no inf or NaN in it)."""
        return all(math.isfinite(c.amax) for g in self.gemms.values() for c in (g.a, g.b))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def step_below(dtype: torch.dtype) -> float:
    """The spacing of a float8 dtype's values just below its largest finite value (32 for e4m3fn)."""
    info = torch.finfo(dtype)
    return 2.0 ** math.floor(math.log2(info.max)) * info.eps


def scales(x: torch.Tensor, spec: CastSpec, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """amax and fp32 scale of ``x`` as torchao computes them (keepdim along ``dim`` when ``spec.rowwise``)."""
    magnitude = x.detach().abs().float()
    amax = magnitude.amax(dim=dim, keepdim=True) if spec.rowwise else magnitude.amax()
    scale = (torch.finfo(spec.dtype).max / amax.clamp(min=AMAX_EPS)).float()
    if spec.pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return amax, scale


def cast(x: torch.Tensor, spec: CastSpec, dim: int, factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor, dict[str, Any]]:
    """Cast ``x`` to float8 as a scaled GEMM operand whose contraction dimension is ``dim``.

    Args:
        x: the high-precision operand (2-D).
        spec: the cast.
        dim: the contraction dimension (-1 for A, 0 for B of ``A @ B``): rowwise scales reduce along it.
        factor: multiplies the scale (1: the cast torchao makes; a test of the warning breaks it with 2**10).

    Returns:
        The float8 values, the scale used, the amax, and the statistics as 0-dim tensors (no host sync).
    """
    amax, scale = scales(x, spec, dim)
    scale = scale * factor
    scaled = x.detach().float() * scale
    limit = torch.finfo(spec.dtype).max
    q = scaled.clamp(-limit, limit).to(spec.dtype)
    n = max(x.numel(), 1)
    stats = {
        "amax": amax.amax(), "scale_min": scale.amin(), "scale_max": scale.amax(),
        "saturated": _past_the_max(scaled.abs(), spec.dtype, limit).sum() / n,
        "underflow": ((x != 0) & (q.float() == 0)).sum() / n,
    }
    return q, scale, amax, stats


def _past_the_max(magnitude: torch.Tensor, dtype: torch.dtype, limit: float) -> torch.Tensor:
    """Which scaled magnitudes the clamp changes: more than half a step past the float8 maximum, or exactly half a
    step for e5m2, whose round-to-nearest takes that tie to inf (e4m3fn has no inf: its tie rounds to the max)."""
    edge = limit + step_below(dtype) / 2
    return magnitude >= edge if dtype == torch.float8_e5m2 else magnitude > edge


def gemm(a: torch.Tensor, b: torch.Tensor, a_spec: CastSpec, b_spec: CastSpec,
         factor: float = 1.0) -> dict[str, Any]:
    """Statistics of the float8 GEMM ``a @ b`` (``a``: (M, K), ``b``: (K, N)) as 0-dim tensors: ``a``, ``b`` (each
    :func:`cast`'s statistics) and ``rel_err``. :func:`to_gemm_stats` turns them into numbers."""
    qa, sa, _, a_stats = cast(a, a_spec, -1, factor)
    qb, sb, _, b_stats = cast(b, b_spec, 0, factor)
    float8 = (qa.float() / sa) @ (qb.float() / sb)  # (M, N), dequantised operands, fp32 accumulation (no fast accum)
    bf16 = a.detach().bfloat16().float() @ b.detach().bfloat16().float()  # (M, N)
    rel = torch.linalg.vector_norm(float8 - bf16) / torch.linalg.vector_norm(bf16).clamp(min=torch.finfo().tiny)
    return {"a": a_stats, "b": b_stats, "a_dtype": a_spec.dtype, "b_dtype": b_spec.dtype, "rel_err": rel}


def to_gemm_stats(raw: dict[str, Any]) -> GemmStats:
    """:func:`gemm`'s tensors as numbers (one host read per value)."""
    from lmtrain.analysis.dtypes import dtype_name

    def numbers(stats: dict[str, torch.Tensor], dtype: torch.dtype) -> CastStats:
        return CastStats(dtype=dtype_name(dtype), **{k: float(v) for k, v in stats.items()})

    return GemmStats(a=numbers(raw["a"], raw["a_dtype"]), b=numbers(raw["b"], raw["b_dtype"]),
                     rel_err=float(raw["rel_err"]))


def flagged(layers: list[Float8LayerStats], threshold: float) -> list[str]:
    """Paths of the layers whose saturated or underflow fraction exceeds ``threshold`` in some operand, or with an
    operand holding inf or NaN (its amax is not finite: the float8 GEMM's output is not either)."""
    return [s.layer for s in layers if max(s.worst()) > threshold or not s.finite()]


def nan_max(values: Iterable[float], default: float = 0.0) -> float:
    """The largest of ``values``, NaN if any is NaN (Python's ``max`` keeps or drops a NaN by its position)."""
    values = list(values)
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values, default=default)


def markdown_table(layers: list[Float8LayerStats], history: dict[str, list[tuple[int, float]]],
                   threshold: float) -> str:
    """One row per layer and GEMM: the operands' dtypes, amax, scales, saturated and underflow fractions, the
    relative error, and the amax history of each operand over the inspected steps (``history``:
    ``<layer>/<gemm>/<operand>`` -> [(step, amax)]); ⚑ marks a layer over ``threshold``."""
    rows = ["| layer | GEMM | A / B dtype | amax A / B | scale A / B | saturated A / B | underflow A / B | "
            "rel. err | amax history A / B |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def scale(c: CastStats) -> str:
        return f"{c.scale_min:.3g}" if c.scale_min == c.scale_max else f"{c.scale_min:.3g}..{c.scale_max:.3g}"

    for s in layers:
        mark = " ⚑" if max(s.worst()) > threshold else ""
        for name, g in s.gemms.items():
            past = " / ".join(", ".join(f"{v:.3g}" for _, v in history.get(f"{s.layer}/{name}/{operand}", []))
                              for operand in GEMMS[name])
            rows.append(f"| `{s.layer}`{mark} | {name} | {g.a.dtype} / {g.b.dtype} | {g.a.amax:.3g} / "
                        f"{g.b.amax:.3g} | {scale(g.a)} / {scale(g.b)} | {g.a.saturated:.3g} / {g.b.saturated:.3g} "
                        f"| {g.a.underflow:.3g} / {g.b.underflow:.3g} | {g.rel_err:.3g} | {past} |")
    return "\n".join(rows)
