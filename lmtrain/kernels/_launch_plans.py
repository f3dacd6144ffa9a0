"""Launch plans: a flash_triton call replayed without the Python that decided what to launch.

Each forward or backward call of ``flash_triton`` decides its kernels (Gluon, TMA or pointer), checks its tensors,
builds up to 24 host descriptors and launches through Triton's JIT functions. On an H100 machine that took 178-271 us
of host time per forward and 339-665 us per backward (4 x 32 heads x 512 x d 80), against 192-344 us for SDPA's
whole forward+backward: at short sequences the GPU work of a call is shorter than that, and a model whose step is
close to launch-bound (the 2.7B model at context 512) waits for it.

A call whose inputs look like an earlier call's, the same shapes, strides, dtypes, devices and 16-byte alignments,
the same flags and the same ``LMTRAIN_FLASH_*`` settings, makes the same decisions and the same launches with the
same compiled kernels; only the tensors differ. So the first such call is recorded: every launch that goes through
``launch_compiled`` appends the compiled kernel and its arguments, and the call turns them into a ``Plan``, whose
arguments name the call's tensors by role (q, k, v, the outputs, ...) instead of holding them. Later calls with the
same key allocate their outputs and run the plan: per launch, descriptors over the new tensors (``unchecked``) and a
direct call of the compiled kernel's launcher, as Triton's JIT function makes after its own lookup.

Nothing is kept when a launch could not be recorded (the autotuner's first launches, a profiler's launch hooks, an
argument that is none of the call's tensors), so such calls simply take the full path again.
``LMTRAIN_FLASH_LAUNCH_PLANS=0`` turns plans off; Triton's interpreter never uses them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence

import torch
import triton

from lmtrain.kernels import triton_interpreted

_INTERPRET = triton_interpreted()

#: Settings whose values are part of every plan key (they change which kernels a call takes).
SETTINGS = ("LMTRAIN_FLASH_TMA", "LMTRAIN_FLASH_TMA_SPLIT", "LMTRAIN_FLASH_GLUON", "LMTRAIN_FLASH_GLUON_FWD",
            "LMTRAIN_FLASH_GLUON_DQ", "LMTRAIN_FLASH_GLUON_DKDV", "LMTRAIN_FLASH_AUTOTUNE",
            "LMTRAIN_FLASH_LAUNCH_PLANS")
_MAX_PLANS = 512  # the store starts afresh when full (a training run has a handful of shapes)
_PLANS: dict[tuple, Plan] = {}
_LOCAL = threading.local()  # .recording: the launch list of the call being recorded in this thread, or None
#: Counters for tests and probes: plans stored, calls replayed.
STATS = {"stored": 0, "replayed": 0}


def _hook_set(hook) -> bool:
    """Whether a launch hook is set: Triton 3.4+ keeps a chain of hooks (``HookChain``, empty when none is set),
    older versions one callable or None."""
    return hook is not None and (not hasattr(hook, "calls") or bool(hook.calls))


def launch_hooks_set() -> bool:
    """Whether a launch hook (a profiler's, say) wants to see every launch with its metadata."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime is None or _hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook)


def key(kind: str, tensors: Sequence[torch.Tensor], *flags) -> tuple | None:
    """The plan key of a call: ``kind``, the flags, the settings, and each tensor's shape, strides, dtype, device
    and 16-byte alignment; None where plans are off (the setting, the interpreter, a launch hook)."""
    settings = tuple(map(os.environ.get, SETTINGS))
    if settings[-1] == "0" or _INTERPRET or launch_hooks_set():
        return None
    try:
        return (kind, flags, settings,
                *[(t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16 == 0) for t in tensors])
    except (AttributeError, TypeError, RuntimeError):  # not tensors, or without storage: the full path says what
        return None


def get(plan_key: tuple | None) -> Plan | None:
    return None if plan_key is None else _PLANS.get(plan_key)


def unchecked(cls, **fields):
    """An instance of the dataclass ``cls`` (a host tensor descriptor) with ``fields`` set, fields left out taking
    their defaults, and the constructor's checks skipped (about 4 us of host time per descriptor on an H100
    machine). Only for callers that have made the same checks already (``usable``: base and strides 16-byte aligned,
    last stride 1, every dimension at least 1, a valid box)."""
    obj = cls.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def device_and_stream() -> tuple[int, int]:
    """The current device and its current stream, as Triton's JIT function looks them up for a launch."""
    driver = triton.runtime.driver.active
    device = driver.get_current_device()
    return device, driver.get_current_stream(device)


@contextlib.contextmanager
def recording(plan_key: tuple | None) -> Iterator[list | None]:
    """Record the launches made inside (through ``launch_compiled``, in this thread) when ``plan_key`` is not None.
    Yields the list they go to (None when not recording); ``store`` turns it into a plan."""
    launches = None if plan_key is None else []
    previous = getattr(_LOCAL, "recording", None)
    _LOCAL.recording = launches
    try:
        yield launches
    finally:
        _LOCAL.recording = previous


def unrecordable() -> None:
    """Mark the call being recorded (if any) as one that cannot be replayed: a launch went around
    ``launch_compiled`` (the autotuner's)."""
    launches = getattr(_LOCAL, "recording", None)
    if launches is not None:
        launches.append(None)


def launch_compiled(fn, grid: tuple, args: tuple, kwargs: dict) -> None:
    """``fn[grid](*args, **kwargs)`` for a ``@triton.jit`` (or Gluon) function, recorded for a plan when a call is
    being recorded in this thread (``recording``): the compiled kernel's launcher, CUDA function and packed metadata,
    the grid, the positional arguments (descriptors as they are now: a pre-launch hook may change a shared
    descriptor's box later) and the values of the parameters after them, keyword or default."""
    compiled = fn[grid](*args, **kwargs)
    launches = getattr(_LOCAL, "recording", None)
    if launches is None:
        return
    if getattr(fn, "pre_run_hooks", None):  # they want to see every launch: no replay
        launches.append(None)
        return
    try:
        run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
        params = fn.signature.parameters
        tail = tuple(kwargs[name] if name in kwargs else params[name].default for name in fn.arg_names[len(args):])
    except (AttributeError, KeyError):  # not a compiled kernel of the kind a plan can launch
        launches.append(None)
        return
    grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    snapshot = [dict(vars(a)) if _is_descriptor(a) else None for a in args]
    launches.append((run, function, packed, tail, grid3, args, snapshot))


def _is_descriptor(a) -> bool:
    return not isinstance(a, torch.Tensor) and isinstance(getattr(a, "base", None), torch.Tensor) and \
        hasattr(a, "block_shape")


_TENSOR, _DESCRIPTOR, _VALUE = 0, 1, 2


class Plan:
    """The launches of one recorded call, their tensor arguments named by role (an index into the roles tuple that
    ``run`` gets): a tensor as ``(_TENSOR, role)``, a descriptor as ``(_DESCRIPTOR, role, class, fields)``, anything
    else (ints, floats, flags) as ``(_VALUE, value)``."""

    def __init__(self, launches: list[tuple], extra: dict) -> None:
        self.launches = launches
        self.extra = extra  # what the caller needs besides the launches (e.g. whether dO was copied)

    def run(self, roles: Sequence[torch.Tensor]) -> None:
        _, stream = device_and_stream()
        for run, function, packed, tail, grid, template in self.launches:
            args = []
            for item in template:
                kind = item[0]
                if kind == _TENSOR:
                    args.append(roles[item[1]])
                elif kind == _DESCRIPTOR:  # ``unchecked``, inlined: this loop is the replay's hot path
                    desc = item[2].__new__(item[2])
                    desc.__dict__.update(item[3])
                    desc.base = roles[item[1]]
                    args.append(desc)
                else:
                    args.append(item[1])
            # What the JIT function passes after its lookup when no launch hook is set: no launch metadata or hooks.
            run(grid[0], grid[1], grid[2], stream, function, packed, None, None, None, *args, *tail)
        STATS["replayed"] += 1


def _template(args: tuple, snapshot: list, roles: Sequence[torch.Tensor]) -> list | None:
    """``args`` with the call's tensors replaced by their roles; None when a tensor argument has no role."""
    index = {id(t): i for i, t in enumerate(roles)}
    out = []
    for a, fields in zip(args, snapshot, strict=True):
        if fields is not None:
            role = index.get(id(fields["base"]))
            if role is None:
                return None
            out.append((_DESCRIPTOR, role, type(a), {k: v for k, v in fields.items() if k != "base"}))
        elif isinstance(a, torch.Tensor):
            role = index.get(id(a))
            if role is None:
                return None
            out.append((_TENSOR, role))
        elif a is None or isinstance(a, (bool, int, float, str)):
            out.append((_VALUE, a))
        else:
            return None
    return out


def store(plan_key: tuple | None, launches: list | None, roles: Sequence[torch.Tensor], **extra) -> None:
    """Keep the launches recorded under ``plan_key`` as a plan over ``roles`` (the call's tensors, in the order its
    replays will pass them), unless one could not be recorded or named by role, or there were none."""
    if plan_key is None or not launches or any(launch is None for launch in launches):
        return
    if len({id(t) for t in roles}) != len(roles):
        return  # one tensor in two roles (k is v, say): a replay with two tensors there could not tell which is which
    steps = []
    for run, function, packed, tail, grid, args, snapshot in launches:
        template = _template(args, snapshot, roles)
        if template is None:
            return
        steps.append((run, function, packed, tail, grid, template))
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[plan_key] = Plan(steps, extra)
    STATS["stored"] += 1


def clear() -> None:
    """Forget every plan (tests; after changing a setting that plan keys do not include)."""
    _PLANS.clear()
