"""Launch plans: a flash_triton call replayed without the Python that decided what to launch.

Each forward or backward call of ``flash_triton`` decides its kernels (Gluon, TMA or pointer), checks its tensors,
builds up to 24 host descriptors and launches through Triton's JIT functions. That host time (hundreds of
microseconds per call on an H100 machine) is longer than the GPU work of a call at short sequences, and a model whose
step is close to launch-bound (the 2.7B model at context 512) waits for it.

A call whose inputs look like an earlier call's, the same shapes, strides, dtypes, devices and 16-byte alignments,
the same flags and the same settings (``lmtrain.kernels.flash.settings``), makes the same decisions and the same
launches with the same compiled kernels; only the tensors differ. So the first such call is recorded: every launch
that goes through ``launch_compiled`` appends the compiled kernel and its arguments, and the call turns them into a
``Plan``, whose arguments name the call's tensors by role (q, k, v, the outputs, ...) instead of holding them. Later
calls with the same key allocate their outputs and run the plan. Where the compiled kernel's launcher has the shape
Triton 3.4-3.6 builds for NVIDIA GPUs, a launch is a direct call of its C launch function with the arguments that
launcher would pass: pointers as integers, each host descriptor encoded (``cuTensorMapEncodeTiled``) once per base
address. Those arguments depend on nothing but the addresses of the call's tensors, so each launch keeps them per
address tuple, and a training loop, whose allocator hands each layer the same addresses every step, finds them
ready. Triton's Python launcher expands descriptors anew on every launch: the C launch function roughly halves a
replayed call's host time. Elsewhere a launch builds descriptors over the new tensors (``unchecked``) and calls that
launcher, as Triton's JIT function does after its own lookup.

Nothing is kept when a launch could not be recorded (the autotuner's first launches, a profiler's launch hooks, an
argument that is none of the call's tensors), so such calls simply take the full path again. The setting
``launch_plans`` says ``c`` (default) plans on, ``off`` none, ``python`` plans that always replay through Triton's
Python launcher. Triton's interpreter never uses them, nor does a Triton version the dispatcher has not been tested
with (``lmtrain.kernels.flash.dispatch.TESTED_TRITON``): the plans read that version's launcher internals.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
import triton

from lmtrain.kernels import triton_interpreted
from lmtrain.kernels.flash.dispatch import triton_tested
from lmtrain.kernels.flash.settings import current

_INTERPRET = triton_interpreted()
_PLANNED = not _INTERPRET and triton_tested()  # plans read launcher internals of the tested Triton versions
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
    and 16-byte alignment; None where plans are off (the setting, the interpreter, an untested Triton, a launch
    hook)."""
    settings = current()
    if not _PLANNED or settings.launch_plans == "off" or launch_hooks_set():
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


class _Step(NamedTuple):
    """One recorded launch of a plan."""

    run: object  # the compiled kernel's launcher, or the C launch function behind it (``head`` set)
    function: int  # the CUDA function
    packed: tuple  # the packed kernel metadata
    tail: tuple  # the values of the parameters after the positional arguments
    grid: tuple  # three grid dimensions
    template: list  # the positional arguments, tensors by role (see ``Plan``)
    head: tuple | None  # (cooperative grid, PDL) for the C launch function; None: through the launcher
    used: tuple  # the roles whose addresses the arguments depend on (C launch function only)
    cache: dict | None  # argument tuples by those addresses (C launch function only)


_TENSOR, _DESCRIPTOR, _VALUE, _ENCODED = 0, 1, 2, 3
_ARGUMENT_CACHE = 256  # argument tuples kept per launch of a plan, and encoded descriptors per descriptor argument


def _raw_launch(run, args: tuple, tail: tuple):
    """Triton's C launch function behind the launcher ``run`` and the metadata of each tensor-descriptor parameter,
    as ``(launch, {parameter index: metadata or None})``, or None when ``run`` is not a launcher of the shape Triton
    3.4-3.6 builds for NVIDIA GPUs (a ``CudaLauncher`` without scratch memory, its descriptor handling the closure
    ``wrap_handle_tensordesc`` makes) or a descriptor parameter holds no recorded descriptor."""
    launch = getattr(run, "launch", None)
    driver = sys.modules.get("triton.backends.nvidia.driver")
    if launch is None or getattr(driver, "_BASE_ARGS_FORMAT", None) != "iiiKKppOOOOOO" \
            or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1) \
            or not hasattr(run, "launch_cooperative_grid") or not hasattr(run, "launch_pdl"):
        return None
    closure = getattr(launch, "__closure__", None)
    if closure is None:  # no descriptor parameters: the C function itself
        return (launch, {}) if not any(_is_descriptor(a) for a in args) else None
    cells = dict(zip(launch.__code__.co_freevars, (c.cell_contents for c in closure), strict=True))
    try:
        c_launch, indices, metas = cells["launcher"], sorted(cells["tensordesc_indices"]), cells["tensordesc_meta"]
    except KeyError:
        return None
    if getattr(c_launch, "__closure__", None) is not None or len(metas) != len(indices):
        return None
    if any(i >= len(args) or not _is_descriptor(args[i]) for i in indices) or \
            sum(map(_is_descriptor, args)) != len(indices) or any(_is_descriptor(a) for a in tail):
        return None
    return c_launch, dict(zip(indices, metas, strict=True))


def _encoded_item(role: int, cls: type, fields: dict, meta: dict | None):
    """The template entry of a descriptor argument for the C launch function: what Triton's
    ``make_tensordesc_arg`` makes of it, with the encoded descriptor (``cuTensorMapEncodeTiled``) kept per base
    address. A descriptor's bytes depend on its address, shape, strides, box, element type, swizzle and padding
    only; everything but the address is fixed by the plan key, so a cached one is the one a fresh encoding would
    give."""
    shape, strides = list(fields["shape"]), list(fields["strides"])
    nan_padded = fields.get("padding", getattr(cls, "padding", "zero")) == "nan"  # a field left at its default
    if meta is None:  # descriptors decomposed by the kernel itself
        return (_ENCODED, role, None, None, [*shape, *strides, nan_padded, *shape, *strides])
    if meta["fp4_padded"]:
        shape[-1] *= 2
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    encode = (meta["swizzle"], meta["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["block_size"],
              shape, strides, int(nan_padded))
    return (_ENCODED, role, encode, {}, [*shape, *strides])


class Plan:
    """The launches of one recorded call, their tensor arguments named by role (an index into the roles tuple that
    ``run`` gets): a tensor as ``(_TENSOR, role)``, a descriptor as ``(_DESCRIPTOR, role, class, fields)`` for the
    launcher or as ``(_ENCODED, role, encoding arguments, encoded by address, shape and strides)`` for the C launch
    function (``_encoded_item``), anything else (ints, floats, flags) as ``(_VALUE, value)``."""

    def __init__(self, launches: list[_Step], extra: dict) -> None:
        self.launches = launches
        self.extra = extra  # what the caller needs besides the launches (e.g. whether dO was copied)

    def run(self, roles: Sequence[torch.Tensor]) -> None:
        _, stream = device_and_stream()
        ptrs = None
        for run, function, packed, tail, grid, template, head, used, cache in self.launches:
            if head is None:  # through the launcher, as the JIT function calls it when no launch hook is set
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
                run(grid[0], grid[1], grid[2], stream, function, packed, None, None, None, *args, *tail)
                continue
            # The C launch function, as the launcher calls it without scratch memory. Its arguments depend on the
            # addresses of the tensors it uses and nothing else of this call, so they are kept per address tuple.
            if ptrs is None:
                ptrs = [t.data_ptr() for t in roles]
            at = tuple([ptrs[role] for role in used])
            args = cache.get(at)
            if args is None:
                args = _c_arguments(template, ptrs) + tail
                if len(cache) >= _ARGUMENT_CACHE:
                    cache.clear()
                cache[at] = args
            run(grid[0], grid[1], grid[2], stream, function, head[0], head[1], None, None, packed, None, None, None,
                *args)
        STATS["replayed"] += 1


def _c_arguments(template: list, ptrs: list[int]) -> tuple:
    """The kernel arguments of one launch for the C launch function, the tensors at addresses ``ptrs`` (by role):
    pointers as integers (what the function reads from a tensor's ``data_ptr``), each descriptor as Triton's
    ``make_tensordesc_arg`` expands it, encoded once per base address (see ``_encoded_item``)."""
    args = []
    for item in template:
        kind = item[0]
        if kind == _TENSOR:
            args.append(ptrs[item[1]])
        elif kind == _ENCODED:
            ptr = ptrs[item[1]]
            if item[2] is None:  # decomposed by the kernel: the base pointer, then shape and strides
                args.append(ptr)
            else:
                encoded = item[3].get(ptr)
                if encoded is None:
                    if len(item[3]) >= _ARGUMENT_CACHE:
                        item[3].clear()
                    encoded = item[3][ptr] = triton.runtime.driver.active.utils.fill_tma_descriptor(ptr, *item[2])
                args.append(encoded)
            args.extend(item[4])
        else:
            args.append(item[1])
    return tuple(args)


def _template(args: tuple, snapshot: list, roles: Sequence[torch.Tensor], metas: dict | None = None) -> list | None:
    """``args`` with the call's tensors replaced by their roles; None when a tensor argument has no role. With
    ``metas`` (the descriptor parameters' metadata, see ``_raw_launch``), descriptors as the C launch function
    takes them."""
    index = {id(t): i for i, t in enumerate(roles)}
    out = []
    for i, (a, fields) in enumerate(zip(args, snapshot, strict=True)):
        if fields is not None:
            role = index.get(id(fields["base"]))
            if role is None:
                return None
            if metas is not None:
                out.append(_encoded_item(role, type(a), fields, metas[i]))
            else:
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
    steps, python_launcher = [], current().launch_plans == "python"
    for run, function, packed, tail, grid, args, snapshot in launches:
        raw = None if python_launcher else _raw_launch(run, args, tail)
        template = _template(args, snapshot, roles, None if raw is None else raw[1])
        if template is None:
            return
        if raw is None:
            steps.append(_Step(run, function, packed, tail, grid, template, None, (), None))
        else:
            used = tuple(sorted({item[1] for item in template if item[0] in (_TENSOR, _ENCODED)}))
            steps.append(_Step(raw[0], function, packed, tuple(tail), grid, template,
                               (run.launch_cooperative_grid, run.launch_pdl), used, {}))
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[plan_key] = Plan(steps, extra)
    STATS["stored"] += 1


def clear() -> None:
    """Forget every plan (tests; after changing a setting that plan keys do not include)."""
    _PLANS.clear()
