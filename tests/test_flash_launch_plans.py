"""Launch plans of the flash kernels (``lmtrain.kernels.flash.launch_plans``).

On CPU, with a stand-in JIT function: what a recorded call keeps, how a replay fills in the new call's tensors and
descriptors, which calls are never kept, and what the plan key tells apart. On a GPU (``-m gpu``): flash_triton's
outputs and gradients with plans are bit-identical to those without, over calls whose layouts change from call to
call, and the plans were used.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

from lmtrain.errors import LmtrainError
from lmtrain.kernels.flash.settings import FlashSettings, use_settings

HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")


class FakeCompiled:
    """What the JIT function returns: a launcher (``run``), the CUDA function and the packed metadata."""

    function = "cu-function"
    packed_metadata = "packed"

    def __init__(self) -> None:
        self.launches: list[tuple] = []

    def run(self, *args) -> None:
        self.launches.append(args)


class FakeJit:
    """A ``@triton.jit`` stand-in with parameters (X, D, n, scale, BLOCK, FLAG=True); records each launch."""

    def __init__(self) -> None:
        def kernel(X, D, n, scale, BLOCK, FLAG=True):
            pass

        self.signature = inspect.signature(kernel)
        self.arg_names = list(self.signature.parameters)
        self.pre_run_hooks: list = []
        self.jit_launches: list[tuple] = []
        self.compiled = FakeCompiled()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit_launches.append((grid, args, kwargs))
            return self.compiled
        return launch


@pytest.fixture
def plans(monkeypatch):
    from lmtrain.kernels.flash import launch_plans as _launch_plans

    monkeypatch.setattr(_launch_plans, "_PLANNED", True)  # as on a GPU with a tested Triton
    monkeypatch.setattr(_launch_plans, "_PLANS", {})
    monkeypatch.setattr(_launch_plans, "device_and_stream", lambda: (0, 1234))
    with use_settings(FlashSettings()):
        yield _launch_plans


def _desc(plans, t, block=(2, 16)):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return plans.unchecked(TensorDescriptor, base=t, shape=[4, 16], strides=[16, 1], block_shape=list(block))


def _record(plans, fn, roles, plan_key=("k",)):
    """One recorded call: fn launched on a descriptor of roles[0] and on roles[1] itself, then stored."""
    x, y = roles
    with plans.recording(plan_key) as launches:
        plans.launch_compiled(fn, (8,), (_desc(plans, x), y, 64, 0.5), {"BLOCK": 32, "num_warps": 4})
    plans.store(plan_key, launches, roles, note="kept")
    return launches


def test_replay_launches_the_compiled_kernel_on_the_new_tensors(plans):
    fn = FakeJit()
    _record(plans, fn, (torch.randn(64), torch.randn(8)))
    assert len(fn.jit_launches) == 1
    plan = plans.get(("k",))
    assert plan is not None and plan.extra == {"note": "kept"}
    x, y = torch.randn(64), torch.randn(8)
    plan.run((x, y))
    assert len(fn.jit_launches) == 1  # not through the JIT function
    (args,) = fn.compiled.launches
    # grid padded to three, the stream, function and metadata, no launch metadata or hooks, then the arguments with
    # the new tensors, then the remaining parameters in order: BLOCK from the keywords, FLAG from its default
    assert args[:9] == (8, 1, 1, 1234, "cu-function", "packed", None, None, None)
    desc = args[9]
    assert desc.base is x and (desc.shape, desc.strides, desc.block_shape) == ([4, 16], [16, 1], [2, 16])
    assert args[10] is y and args[11:] == (64, 0.5, 32, True)
    assert plans.STATS["replayed"] >= 1


def test_descriptor_box_is_the_one_at_launch_time(plans):
    fn = FakeJit()
    x, y = torch.randn(64), torch.randn(8)
    d = _desc(plans, x, block=(2, 16))
    with plans.recording(("k",)) as launches:
        plans.launch_compiled(fn, (1,), (d, y, 1, 1.0), {"BLOCK": 16})
        d.block_shape = [4, 16]  # a later pre-launch hook sets another box on the shared descriptor
    plans.store(("k",), launches, (x, y))
    plans.get(("k",)).run((torch.randn(64), torch.randn(8)))
    assert fn.compiled.launches[0][9].block_shape == [2, 16]


def test_launches_outside_a_recording_are_not_kept(plans):
    fn = FakeJit()
    plans.launch_compiled(fn, (1,), (torch.randn(4), torch.randn(4), 1, 1.0), {"BLOCK": 16})
    with plans.recording(None) as launches:
        plans.launch_compiled(fn, (1,), (torch.randn(4), torch.randn(4), 1, 1.0), {"BLOCK": 16})
    assert launches is None and len(fn.jit_launches) == 2 and not plans._PLANS


@pytest.mark.parametrize("why", ["unrecordable", "stranger_tensor", "aliased_roles", "no_launch", "pre_run_hook",
                                 "other_argument"])
def test_calls_that_cannot_be_replayed_are_not_kept(plans, why):
    fn = FakeJit()
    x, y = torch.randn(64), torch.randn(8)
    roles = (x, y)
    args = (_desc(plans, x), y, 64, 0.5)
    if why == "stranger_tensor":
        args = (_desc(plans, x), torch.randn(8), 64, 0.5)
    elif why == "aliased_roles":
        roles = (x, x)
        args = (_desc(plans, x), x, 64, 0.5)
    elif why == "pre_run_hook":
        fn.pre_run_hooks.append(lambda *a, **k: None)
    elif why == "other_argument":
        args = (_desc(plans, x), y, object(), 0.5)
    with plans.recording(("k",)) as launches:
        if why == "unrecordable":
            plans.unrecordable()  # e.g. the autotuner's first launch
        if why != "no_launch":
            plans.launch_compiled(fn, (1,), args, {"BLOCK": 16})
    plans.store(("k",), launches, roles)
    assert plans.get(("k",)) is None


def test_key_tells_apart_what_changes_the_launches(plans, monkeypatch):
    def key(*tensors, causal=True):
        return plans.key("fwd", tensors, causal, False)

    base = torch.randn(2, 3, 16, 8, dtype=torch.float16)
    same_kind = torch.randn(2, 3, 16, 8, dtype=torch.float16)
    assert key(base) == key(same_kind)
    others = [
        key(base, causal=False),
        key(torch.randn(2, 3, 17, 8, dtype=torch.float16)),  # shape
        key(torch.randn(2, 16, 3, 8, dtype=torch.float16).transpose(1, 2)),  # strides
        key(torch.randn(2, 3, 16, 8, dtype=torch.bfloat16)),  # dtype
        key(torch.randn(2 * 3 * 16 * 8 + 1, dtype=torch.float16)[1:].view(2, 3, 16, 8)),  # 2 bytes off 16
    ]
    assert all(k is not None and k != key(base) for k in others)
    assert len(set(others)) == len(others)
    with use_settings(tma=False):  # the settings are part of every key
        changed = key(base)
    assert changed != key(base)


def test_no_key_when_plans_are_off_or_inputs_are_not_tensors(plans, monkeypatch):
    import triton

    t = torch.randn(4, 8)
    assert plans.key("fwd", (t,)) is not None
    assert plans.key("fwd", ("not a tensor",)) is None  # the full path then raises its own error
    with use_settings(launch_plans="off"):
        assert plans.key("fwd", (t,)) is None
    hooks = triton.knobs.runtime.launch_enter_hook
    hook = lambda metadata: None  # noqa: E731
    hooks.add(hook)
    try:
        assert plans.key("fwd", (t,)) is None  # a profiler's hook sees every launch through the JIT function
    finally:
        hooks.remove(hook)
    monkeypatch.setattr(plans, "_PLANNED", False)  # the interpreter, or an untested Triton
    assert plans.key("fwd", (t,)) is None


def test_store_starts_afresh_when_full(plans, monkeypatch):
    monkeypatch.setattr(plans, "_MAX_PLANS", 3)
    fn = FakeJit()
    for i in range(4):
        _record(plans, fn, (torch.randn(64), torch.randn(8)), plan_key=(i,))
    assert list(plans._PLANS) == [(3,)]  # cleared at the fourth, which was then kept


def test_unchecked_descriptor_has_the_fields_given_and_the_defaults():
    from triton.tools.tensor_descriptor import TensorDescriptor

    from lmtrain.kernels.flash.launch_plans import unchecked

    t = torch.randn(4, 16)
    d = unchecked(TensorDescriptor, base=t, shape=[4, 16], strides=[16, 1], block_shape=[2, 16])
    checked = TensorDescriptor(t, [4, 16], [16, 1], [2, 16])
    assert isinstance(d, TensorDescriptor)
    assert (d.base, d.shape, d.strides, d.block_shape, d.padding) == \
        (checked.base, checked.shape, checked.strides, checked.block_shape, checked.padding)


class _CFunction:
    """Stands for the compiled C launch function (a builtin: no closure); records its arguments."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def __call__(self, *args) -> None:
        self.calls.append(args)


class FakeCudaLauncher:
    """The shape of Triton 3.4-3.6's ``CudaLauncher``: ``launch`` is the C function itself, or, for a kernel with
    descriptor parameters, a closure over it (``launcher``), the descriptors' parameter indices and their
    metadata, which expands each descriptor into the encoded map, its shape and strides, as Triton does."""

    launch_cooperative_grid = False
    launch_pdl = True
    global_scratch_size = 0
    profile_scratch_size = 0

    def __init__(self, indices, metas, fill) -> None:
        self.c_launches: list[tuple] = []
        c_function = _CFunction(self.c_launches)

        def expand(desc, meta):
            if meta is None:
                return [desc.base, *desc.shape, *desc.strides, desc.padding == "nan", *desc.shape, *desc.strides]
            encoded = fill(desc.base.data_ptr(), meta["swizzle"], meta["elem_size"], 10 + meta["elem_type"],
                           meta["block_size"], list(desc.shape), list(desc.strides), int(desc.padding == "nan"))
            return [encoded, *desc.shape, *desc.strides]

        def make(launcher, tensordesc_indices, tensordesc_meta):
            def inner(*args):
                out, metas = list(args[:13]), iter(tensordesc_meta)
                for i, a in enumerate(args[13:]):
                    out.extend(expand(a, next(metas)) if i in tensordesc_indices else [a])
                return launcher(*out)
            return inner

        self.launch = make(c_function, set(indices), metas) if indices else c_function

    def __call__(self, gx, gy, gz, stream, function, *args) -> None:
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None, *args)


@pytest.fixture
def nvidia_driver(monkeypatch):
    """A stand-in for Triton 3.6's NVIDIA driver module and its descriptor encoder, which counts encodings."""
    import sys
    import types

    module = types.SimpleNamespace(_BASE_ARGS_FORMAT="iiiKKppOOOOOO",
                                   TMA_DTYPE_DEVICE_TO_HOST={i: 10 + i for i in range(16)})
    monkeypatch.setitem(sys.modules, "triton.backends.nvidia.driver", module)
    encoded: list[int] = []

    def fill(ptr, *rest):
        encoded.append(ptr)
        return ("map", ptr, rest)

    from lmtrain.kernels.flash import launch_plans as _launch_plans

    utils = types.SimpleNamespace(fill_tma_descriptor=fill)
    monkeypatch.setattr(_launch_plans.triton.runtime, "driver", types.SimpleNamespace(
        active=types.SimpleNamespace(utils=utils)))
    return fill, encoded


_META = {"swizzle": 3, "elem_size": 2, "elem_type": 1, "block_size": [2, 16], "fp4_padded": False}


@pytest.mark.parametrize("meta", [_META, None], ids=["host-encoded", "decomposed"])
def test_replay_calls_the_c_launch_function_with_what_the_launcher_would_pass(plans, nvidia_driver, meta):
    """Where the launcher has Triton 3.6's shape, a replay calls its C function with the arguments the launcher
    itself would give it (each descriptor expanded, the encoder called the same way), and encodes a descriptor
    once per base address."""
    fill, encoded = nvidia_driver
    fn = FakeJit()
    fn.compiled.run = FakeCudaLauncher([0], [meta], fill)
    _record(plans, fn, (torch.randn(64), torch.randn(8)))
    plan = plans.get(("k",))
    assert plan.launches[0].head == (False, True)  # the C function, with the launcher's cooperative/PDL flags
    x, y, x2, y2 = torch.randn(64), torch.randn(8), torch.randn(64), torch.randn(8)
    calls = ((x, y), (x, y), (x2, y), (x2, y2), (x, y))
    fn.compiled.run.c_launches.clear()
    encoded.clear()
    for roles in calls:
        plan.run(roles)
    replayed = fn.compiled.run.c_launches
    expected_launcher = FakeCudaLauncher([0], [meta], fill)
    for roles in calls:
        expected_launcher(8, 1, 1, 1234, "cu-function", "packed", None, None, None,
                          _desc(plans, roles[0]), roles[1], 64, 0.5, 32, True)
    assert len(replayed) == len(calls)
    for got, want in zip(replayed, expected_launcher.c_launches, strict=True):
        # a tensor's address where the launcher passes the tensor (the C function reads its data_ptr)
        want = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in want)
        assert len(got) == len(want) and all(a is b or a == b for a, b in zip(got, want, strict=True))
    if meta is not None:  # the full path encodes on every launch; the replays once per address
        assert encoded[:2] == [x.data_ptr(), x2.data_ptr()] and len(encoded) == 2 + len(calls)


def test_replay_keeps_the_python_launcher_where_it_has_another_shape(plans, nvidia_driver):
    """Scratch memory, or a recorded launcher unlike Triton 3.6's: the plan calls the launcher as the JIT
    function would."""
    fill, _ = nvidia_driver
    fn = FakeJit()
    fn.compiled.run = FakeCudaLauncher([0], [_META], fill)
    fn.compiled.run.global_scratch_size = 128
    _record(plans, fn, (torch.randn(64), torch.randn(8)))
    assert plans.get(("k",)).launches[0].head is None


def test_python_setting_keeps_the_python_launcher(plans, nvidia_driver, monkeypatch):
    fill, encoded = nvidia_driver
    fn = FakeJit()
    fn.compiled.run = FakeCudaLauncher([0], [_META], fill)
    with use_settings(launch_plans="python"):
        _record(plans, fn, (torch.randn(64), torch.randn(8)))
    plan = plans.get(("k",))
    assert plan.launches[0].head is None
    x, y = torch.randn(64), torch.randn(8)
    encoded.clear()
    plan.run((x, y))
    plan.run((x, y))
    assert encoded == [x.data_ptr()] * 2  # the launcher's expansion: encoded on every launch


def test_bad_plan_setting_is_an_error_naming_it():
    with pytest.raises(LmtrainError, match="flash.launch_plans"):
        FlashSettings(launch_plans="yes")


def test_kept_arguments_and_descriptors_are_bounded(plans, nvidia_driver, monkeypatch):
    fill, encoded = nvidia_driver
    monkeypatch.setattr(plans, "_ARGUMENT_CACHE", 2)
    fn = FakeJit()
    fn.compiled.run = FakeCudaLauncher([0], [_META], fill)
    _record(plans, fn, (torch.randn(64), torch.randn(8)))
    plan, y = plans.get(("k",)), torch.randn(8)
    xs = [torch.randn(64) for _ in range(3)]
    encoded.clear()
    for x in xs + xs[-1:]:
        plan.run((x, y))
    cache = next(item[3] for item in plan.launches[0].template if item[0] == plans._ENCODED)
    assert len(cache) <= 2 and len(plan.launches[0].cache) <= 2 and encoded == [x.data_ptr() for x in xs]
    assert fn.compiled.run.c_launches[-1][13] == ("map", xs[-1].data_ptr(), cache[xs[-1].data_ptr()][2])


HAS_CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [80, 64, 128])
def test_gpu_replayed_calls_are_bit_identical_to_full_calls(d, monkeypatch):
    """A run of flash_triton calls whose layouts change from call to call (contiguous, a fused-qkv view, a
    misaligned view that takes the pointer kernels, another N, fp16 after bf16, a gradient that needs a copy), twice:
    outputs and gradients with plans equal those without bit for bit, and plans were replayed."""
    from lmtrain.kernels.flash import launch_plans as _launch_plans
    from lmtrain.kernels.flash.api import flash_attention

    def inputs(kind: str, seed: int):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        dtype = torch.float16 if kind == "fp16" else torch.bfloat16
        n = 1025 if kind == "n1025" else 97
        b, h = 2, 3

        def rand(*shape):
            return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

        if kind == "fused":
            q, k, v = rand(b, n, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
        elif kind == "misaligned":
            q, k, v = rand(3 * b * h * n * d + 1)[1:].view(3, b, h, n, d).unbind(0)  # 2 bytes off: no TMA
        else:
            q, k, v = rand(b, h, n, d), rand(b, h, n, d), rand(b, h, n, d)
        do = rand(b, h, 1, d).expand(b, h, n, d) if kind == "expanded_grad" else rand(b, h, n, d)
        return [t.detach().requires_grad_() for t in (q, k, v)], do

    kinds = ("contiguous", "fused", "misaligned", "n1025", "fp16", "expanded_grad", "contiguous")

    def run(setting: str) -> list[torch.Tensor]:
        results = []
        with use_settings(launch_plans=setting):
            for _ in range(3):
                for seed, kind in enumerate(kinds):
                    (q, k, v), do = inputs(kind, seed)
                    o = flash_attention(q, k, v, causal=True)
                    o.backward(do)
                    results += [o.detach(), q.grad, k.grad, v.grad]
        return results

    full = run("off")
    _launch_plans.clear()
    replayed_before = _launch_plans.STATS["replayed"]
    planned = run("c")
    assert _launch_plans.STATS["replayed"] - replayed_before >= 2 * len(kinds), "plans were not replayed"
    import triton.backends.nvidia.driver as nvidia

    if getattr(nvidia, "_BASE_ARGS_FORMAT", None) == "iiiKKppOOOOOO":  # Triton 3.4-3.6: replays call C directly
        assert any(step.head is not None for plan in _launch_plans._PLANS.values() for step in plan.launches)
    assert len(planned) == len(full)
    for i, (a, b) in enumerate(zip(planned, full, strict=True)):
        assert not a.isnan().any(), f"result {i} has NaN"
        assert torch.equal(a, b), f"result {i} differs when replayed from a plan"
