"""Which FlashAttention kernels serve a call: one table, read top to bottom.

Three implementations serve each job (forward, dQ, dK/dV): the Gluon kernels (warp-specialised, sm_90 only, head
dims 64 and 128), the TMA kernels (sm_90 and later, head dims a multiple of 8 up to 128) and the pointer kernels
(any GPU, dtype and head dim, and Triton's interpreter). ``select`` takes a call's facts (``Call``: architecture,
dtype, head dim, sequence lengths, alignment, determinism) with the settings (``settings.FlashSettings``) and the
Triton version, and returns a ``Plan`` naming the implementation of each job, with the reason for each. ``explain``
prints the plans for a list of shapes on this device or a named one (``device="sm_90"``), without a GPU;
``describe`` returns the same as a dict for records.

A Triton version the kernels have not been tested with (``TESTED_TRITON``) gets the pointer kernels only, and one
warning: the TMA and Gluon paths and the launch plans use Triton internals that change between versions.

This module imports torch but not Triton.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from lmtrain.kernels.flash import tuning
from lmtrain.kernels.flash.settings import FlashSettings, current
from lmtrain.kernels.flash.tuning import DKDV, DQ, FWD, HEAD_DIMS, triton_version

#: Triton versions (major, minor) the TMA and Gluon kernels and the launch plans were tested with, inclusive.
TESTED_TRITON = ((3, 4), (3, 6))
#: The first Triton with Gluon's Hopper module.
GLUON_TRITON = (3, 5)
GLUON, TMA, POINTER, FUSED = "gluon", "tma", "pointer", "fused"
_HALF = (torch.float16, torch.bfloat16)
_JOBS = {FWD: "fwd", DQ: "dq", DKDV: "dkdv"}
#: The kernels each implementation launches for each job, as a profiler names them.
KERNELS = {
    (POINTER, "fwd"): ("_flash_ptr_fwd",), (POINTER, "dq"): ("_flash_ptr_bwd_dq",),
    (POINTER, "dkdv"): ("_flash_ptr_bwd_dkdv",),
    (TMA, "fwd"): ("_flash_tma_fwd",), (TMA, "dq"): ("_flash_tma_bwd_dq",), (TMA, "dkdv"): ("_flash_tma_bwd_dkdv",),
    (GLUON, "fwd"): ("_flash_gluon_fwd",), (GLUON, "dq"): ("_flash_gluon_bwd_dq",),
    (GLUON, "dkdv"): ("_flash_gluon_bwd_dkdv",),
    (FUSED, "bwd"): ("_flash_bwd_delta", "_flash_fused_bwd_atomic", "_flash_bwd_dq_convert"),
}


@dataclasses.dataclass(frozen=True)
class Call:
    """The facts about one attention call that decide its kernels.

    Attributes:
        arch: the CUDA device's compute capability, e.g. (9, 0); None off CUDA (Triton's interpreter).
        dtype: q's dtype (k and v share it).
        head_dim: d.
        n_q: queries per head.
        n_k: keys per head.
        aligned: every tensor of the call meets TMA's rules (16-byte aligned base and strides, last stride 1).
        deterministic: ``torch.use_deterministic_algorithms(True)`` is on.
    """

    arch: tuple[int, int] | None
    dtype: torch.dtype
    head_dim: int
    n_q: int
    n_k: int
    aligned: bool = True
    deterministic: bool = False


@dataclasses.dataclass(frozen=True)
class Plan:
    """The implementation serving each job of a call (``gluon``, ``tma`` or ``pointer``; the backward ``fused``
    when one Gluon kernel computes dQ, dK and dV), and why."""

    fwd: str
    dq: str
    dkdv: str
    why: tuple[str, ...] = ()

    @property
    def fused(self) -> bool:
        return self.dq == FUSED

    def kernel_names(self) -> tuple[str, ...]:
        """The kernels the forward and backward launch, in order."""
        names = KERNELS[(self.fwd, "fwd")]
        if self.fused:
            return names + KERNELS[(FUSED, "bwd")]
        return names + KERNELS[(self.dq, "dq")] + KERNELS[(self.dkdv, "dkdv")]

    def summary(self) -> str:
        """One line: forward, dQ and dK/dV implementations."""
        backward = "fused (Gluon, TMA reductions)" if self.fused else f"dQ {self.dq}, dK/dV {self.dkdv}"
        return f"forward {self.fwd}; backward {backward}"


def triton_tested(version: tuple[int, int] | None = None) -> bool:
    """Whether ``version`` (default: the installed Triton) is one the TMA and Gluon paths were tested with."""
    version = triton_version() if version is None else version
    return TESTED_TRITON[0] <= version <= TESTED_TRITON[1]


_WARNED: set[tuple[int, int]] = set()


def _untested_triton(version: tuple[int, int]) -> None:
    if version not in _WARNED:
        _WARNED.add(version)
        warnings.warn(f"flash_triton: Triton {version[0]}.{version[1]} is untested (tested: "
                      f"{TESTED_TRITON[0][0]}.{TESTED_TRITON[0][1]}-{TESTED_TRITON[1][0]}.{TESTED_TRITON[1][1]}); "
                      "the pointer kernels serve every call, without launch plans.", stacklevel=3)


def _gluon_jobs(call: Call, settings: FlashSettings, version: tuple[int, int]) -> tuple[frozenset[int], str]:
    """The jobs the Gluon kernels serve, and why (or why none)."""
    if settings.gluon == "off":
        return frozenset(), "Gluon off in the settings"
    if version < GLUON_TRITON:
        return frozenset(), f"Gluon needs Triton {GLUON_TRITON[0]}.{GLUON_TRITON[1]}+"
    if call.arch != (9, 0):
        return frozenset(), "Gluon kernels need sm_90"
    if call.dtype not in _HALF:
        return frozenset(), "Gluon kernels take fp16/bf16"
    if call.head_dim not in HEAD_DIMS:
        return frozenset(), f"Gluon kernels take head dims {HEAD_DIMS}"
    if not call.aligned:
        return frozenset(), "tensors not TMA-aligned"
    if settings.gluon == "auto":
        jobs = frozenset(job for job in _JOBS if tuning.step(job, call.head_dim, call.n_k)[2])
        return jobs, f"Gluon where it measured faster at d {call.head_dim}, {call.n_k} keys"
    if settings.gluon == "all":
        return frozenset(_JOBS), "Gluon for every job (settings)"
    named = settings.gluon_kernels()
    return frozenset(job for job, name in _JOBS.items() if name in named), f"Gluon for {settings.gluon} (settings)"


def _tma_why_not(call: Call, settings: FlashSettings) -> str | None:
    """Why the TMA kernels do not serve ``call``, or None where they do."""
    if not settings.tma:
        return "TMA off in the settings"
    if call.arch is None or call.arch < (9, 0):
        return "TMA needs sm_90+"
    if call.dtype not in _HALF:
        return "TMA kernels take fp16/bf16"
    if call.head_dim % 8 or not 16 <= call.head_dim <= 128:
        return "TMA kernels take head dims 16..128, multiples of 8"
    if not call.aligned:
        return "tensors not TMA-aligned"
    return None


def _fused(call: Call, settings: FlashSettings, gluon: frozenset[int]) -> str | None:
    """Why the fused backward serves ``call``, or None where it does not."""
    if settings.fused_backward == "off" or DKDV not in gluon or call.deterministic:
        return None
    d = call.head_dim
    if settings.fused_backward == "auto":
        if d not in tuning.FUSED_FROM or call.n_k < tuning.FUSED_FROM[d] or settings.gluon != "auto":
            return None
        why = f"fused backward from {tuning.FUSED_FROM[d]} keys at d {d}"
    else:
        why = "fused backward on (settings)"
    # Its dQ product's M is the streamed block: 64 queries.
    if tuning.config(DKDV, d, call.n_k, loads=call.n_q % 4 != 0, override=settings.gluon_config("dkdv")).block != 64:
        return None
    return why


def select(call: Call, settings: FlashSettings | None = None, version: tuple[int, int] | None = None,
           warn: bool = True) -> Plan:
    """The plan for ``call`` under ``settings`` (default: those in force) with Triton ``version`` (default: the
    installed one). An untested version gets the pointer kernels and, with ``warn``, one warning per version."""
    settings = current() if settings is None else settings
    version = triton_version() if version is None else version
    if call.arch is None:
        return Plan(POINTER, POINTER, POINTER, ("not a CUDA device: pointer kernels (Triton's interpreter)",))
    if not triton_tested(version):
        if warn and call.arch >= (9, 0):
            _untested_triton(version)
        return Plan(POINTER, POINTER, POINTER, (f"Triton {version[0]}.{version[1]} untested: pointer kernels",))
    gluon, gluon_why = _gluon_jobs(call, settings, version)
    tma_why = _tma_why_not(call, settings)
    tma = TMA if tma_why is None else POINTER
    why = [gluon_why]
    if tma_why:
        why.append(tma_why)

    def job(kernel: int) -> str:
        return GLUON if kernel in gluon else tma

    fused_why = _fused(call, settings, gluon)
    if fused_why:
        return Plan(job(FWD), FUSED, FUSED, (*why, fused_why))
    if call.deterministic and _fused(dataclasses.replace(call, deterministic=False), settings, gluon):
        why.append("deterministic algorithms: no fused backward")  # it would have served this call otherwise
    return Plan(job(FWD), job(DQ), job(DKDV), tuple(w for w in why if w))


# ---------------------------------------------------------------------------------------------
# Calls from tensors (the autograd function) and from names (explain)
# ---------------------------------------------------------------------------------------------

_CAPABILITY: dict[int, tuple[int, int]] = {}


def capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA ``device`` (cached), None off CUDA."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


def tma_strides(t: torch.Tensor) -> list[int]:
    """The strides a descriptor of the (Z, H, N, d) tensor ``t`` gets: its own, except that a dimension of size 1
    (never stepped over) takes the dense stride of the dimensions inside it, so an odd stride there does not matter."""
    strides = list(t.stride())
    for i in (2, 1, 0):
        if t.shape[i] == 1:
            strides[i] = strides[i + 1] * t.shape[i + 1]
    return strides


def aligned(t: torch.Tensor) -> bool:
    """What a TMA descriptor needs: a 16-byte aligned base, positive 16-byte multiples as strides (but the last,
    which must be 1)."""
    elt = t.element_size()
    strides = tma_strides(t)
    return strides[-1] == 1 and t.data_ptr() % 16 == 0 and all(s > 0 and s * elt % 16 == 0 for s in strides[:-1])


def call_of(q4: torch.Tensor, k4: torch.Tensor, *others: torch.Tensor) -> Call:
    """The ``Call`` of (Z, H, N, d) views q4, k4 and the call's other tensors (v, O, gradients), on the device."""
    arch = capability(q4.device)
    return Call(arch, q4.dtype, q4.shape[-1], q4.shape[-2], k4.shape[-2],
                arch is not None and all(aligned(t) for t in (q4, k4, *others)),
                torch.are_deterministic_algorithms_enabled())


def parse_device(device: str | torch.device | None) -> tuple[tuple[int, int] | None, str]:
    """(compute capability or None, name) of ``device``: ``"sm_90"``-style names, ``"cpu"``, a CUDA device, or None
    for the current CUDA device (``"cpu"`` where none is visible)."""
    if isinstance(device, str) and device.startswith("sm_") and device[3:].isdigit():
        digits = device[3:]
        return (int(digits[:-1]), int(digits[-1])), device
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    arch = capability(device)
    if arch is None:
        return None, "cpu"
    return arch, f"sm_{arch[0]}{arch[1]} ({torch.cuda.get_device_name(device)})"


def describe(shapes: list[tuple[int, int]] | None = None, device: str | torch.device | None = None,
             dtype: torch.dtype = torch.bfloat16, settings: FlashSettings | None = None,
             version: tuple[int, int] | None = None, deterministic: bool | None = None) -> dict:
    """The settings and, per (sequence length, head dim) in ``shapes`` (self-attention, q and k alike, aligned),
    the plan on ``device`` (see ``parse_device``) and why: what a run records. ``deterministic``: plan for
    ``torch.use_deterministic_algorithms(True)`` (default: whether it is on now, as the calls will see it).

    Returns:
        ``{"settings": {...}, "triton": "3.6", "device": "sm_90 ...", "deterministic": False,
        "plans": {"N=512,d=80": {"fwd": ..., "dq": ..., "dkdv": ..., "kernels": [...], "why": [...]}}}``.
    """
    settings = current() if settings is None else settings
    version = triton_version() if version is None else version
    deterministic = torch.are_deterministic_algorithms_enabled() if deterministic is None else deterministic
    arch, name = parse_device(device)
    plans = {}
    for n, d in shapes or ():
        plan = select(Call(arch, dtype, d, n, n, deterministic=deterministic), settings, version, warn=False)
        plans[f"N={n},d={d}"] = {"fwd": plan.fwd, "dq": plan.dq, "dkdv": plan.dkdv,
                                 "kernels": list(plan.kernel_names()), "why": list(plan.why)}
    return {"settings": settings.as_dict(), "triton": f"{version[0]}.{version[1]}", "device": name,
            "deterministic": deterministic, "plans": plans}


def explain(shapes: list[tuple[int, int]], device: str | torch.device | None = None,
            dtype: torch.dtype = torch.bfloat16, settings: FlashSettings | None = None,
            version: tuple[int, int] | None = None, deterministic: bool | None = None) -> str:
    """Human-readable text: which kernels serve each (sequence length, head dim) of ``shapes`` on ``device``
    (``"sm_90"``, ``"cpu"``, a CUDA device; default: this machine's), and why; ``deterministic`` as in
    :func:`describe`.

    Example:
        >>> print(explain([(512, 80), (4096, 64)], device="sm_90"))  # doctest: +SKIP
    """
    settings = current() if settings is None else settings
    version = triton_version() if version is None else version
    deterministic = torch.are_deterministic_algorithms_enabled() if deterministic is None else deterministic
    arch, name = parse_device(device)
    lines = [f"flash_triton kernels on {name}, {str(dtype).removeprefix('torch.')}, Triton "
             f"{version[0]}.{version[1]}, causal or not{', deterministic algorithms' if deterministic else ''}:"]
    if arch is None:
        lines.append("  no CUDA device: flash_triton runs only under Triton's interpreter (TRITON_INTERPRET=1, tests), "
                     "with the pointer kernels; name a device (e.g. sm_90) to see what would serve there.")
        return "\n".join(lines)
    for n, d in shapes:
        plan = select(Call(arch, dtype, d, n, n, deterministic=deterministic), settings, version, warn=False)
        lines.append(f"  N {n:>6}, d {d:>3}: {plan.summary()}")
        lines.append(f"      kernels: {', '.join(plan.kernel_names())}")
        if plan.why:
            lines.append(f"      why: {'; '.join(plan.why)}")
    changed = {k: v for k, v in settings.as_dict().items() if v != getattr(FlashSettings(), k)}
    lines.append(f"  settings: {'defaults' if not changed else changed}")
    return "\n".join(lines)


__all__ = ["TESTED_TRITON", "Call", "Plan", "aligned", "call_of", "describe", "explain", "select",
           "triton_tested"]
