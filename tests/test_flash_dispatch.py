"""The FlashAttention dispatcher, settings and kernel names, on CPU: selection on faked devices and Triton versions,
settings validation, explain/describe, and every kernel of ``lmtrain.kernels`` named once."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import warnings

import pytest
import torch

from lmtrain.errors import LmtrainError
from lmtrain.kernels.flash import (
    FlashSettings,
    describe,
    dispatch,
    explain,
    select,
    set_settings,
    settings,
    tuning,
    use_settings,
)
from lmtrain.kernels.flash.dispatch import FUSED, GLUON, POINTER, TMA, Call

HAS_TRITON = importlib.util.find_spec("triton") is not None
TESTED = dispatch.TESTED_TRITON[1]
BF16 = torch.bfloat16


def call(arch=(9, 0), dtype=BF16, d=64, n=1024, **kw) -> Call:
    return Call(arch, dtype, d, n, n, **kw)


def test_off_cuda_and_untested_triton_take_the_pointer_kernels_with_one_warning() -> None:
    assert select(call(arch=None), version=TESTED) == dispatch.Plan(POINTER, POINTER, POINTER, select(
        call(arch=None), version=TESTED).why)
    dispatch._WARNED.clear()
    with pytest.warns(UserWarning, match="untested"):
        plan = select(call(), version=(9, 9))
    assert (plan.fwd, plan.dq, plan.dkdv) == (POINTER, POINTER, POINTER)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call of that version warns no more
        select(call(d=128), version=(9, 9))
    assert select(call(), version=TESTED).fwd != POINTER


@pytest.mark.parametrize("n", [512, 1024, 4096, 16384])
@pytest.mark.parametrize("d", tuning.HEAD_DIMS)
def test_gluon_serves_where_its_table_says_and_tma_elsewhere(d: int, n: int) -> None:
    plan = select(call(d=d, n=n, deterministic=True), FlashSettings(), TESTED)
    for job, got in ((tuning.FWD, plan.fwd), (tuning.DQ, plan.dq), (tuning.DKDV, plan.dkdv)):
        assert got == (GLUON if tuning.step(job, d, n)[2] else TMA), (job, plan)


def test_fused_backward_by_default_only_from_its_threshold_and_never_deterministic() -> None:
    for d, start in tuning.FUSED_FROM.items():
        assert select(call(d=d, n=start), FlashSettings(), TESTED).fused
        assert not select(call(d=d, n=start // 2), FlashSettings(), TESTED).fused
        assert not select(call(d=d, n=start, deterministic=True), FlashSettings(), TESTED).fused
        assert not select(call(d=d, n=start), FlashSettings(fused_backward="off"), TESTED).fused
    assert select(call(d=64, n=1024), FlashSettings(fused_backward="on"), TESTED).fused
    assert select(call(d=64, n=4096), FlashSettings(), TESTED).kernel_names()[-1] == "_flash_bwd_dq_convert"


@pytest.mark.parametrize(("facts", "settings_", "expected"), [
    (dict(arch=(8, 0)), {}, POINTER),  # TMA needs sm_90+
    (dict(arch=(10, 0)), {}, TMA),  # Gluon needs sm_90 itself
    (dict(d=80), {}, TMA),  # not a Gluon head dim
    (dict(d=256), {}, POINTER),  # above TMA's head dims
    (dict(dtype=torch.float32), {}, POINTER),
    (dict(aligned=False), {}, POINTER),
    ({}, dict(gluon="off"), TMA),
    ({}, dict(gluon="off", tma=False), POINTER),
])
def test_each_rule_sends_a_call_to_the_next_implementation(facts: dict, settings_: dict, expected: str) -> None:
    plan = select(call(**facts), FlashSettings(**settings_), TESTED)
    assert {plan.fwd, plan.dq, plan.dkdv} == {expected}, plan


def test_gluon_list_and_all_take_the_kernels_named() -> None:
    plan = select(call(n=512), FlashSettings(gluon="dq"), TESTED)
    assert (plan.fwd, plan.dq, plan.dkdv) == (TMA, GLUON, TMA)
    plan = select(call(n=512), FlashSettings(gluon="all", fused_backward="off"), TESTED)
    assert (plan.fwd, plan.dq, plan.dkdv) == (GLUON, GLUON, GLUON)


def test_settings_are_validated_once_with_one_line_naming_the_field() -> None:
    for field, value in (("gluon", "sometimes"), ("gluon", "fwd,bwd"), ("fused_backward", "1"),
                         ("launch_plans", "yes"), ("tma", "forward"), ("gluon_fwd_config", "3,64"),
                         ("gluon_dq_config", "2,64,3,1,1")):  # reg_a in the dQ kernel gives wrong dQ
        with pytest.raises(LmtrainError, match=f"flash.{field}") as err:
            FlashSettings(**{field: value})
        assert "\n" not in str(err.value)
    assert FlashSettings(gluon="dkdv, fwd") == FlashSettings(gluon="fwd,dkdv")
    assert hash(FlashSettings(gluon="dkdv,fwd")) == hash(FlashSettings(gluon="fwd,dkdv"))
    assert FlashSettings(gluon_dkdv_config="2,64,3,1,1,2").gluon_config("dkdv") == tuning.Config(2, 64, 3, 1, 1, 2)
    with pytest.raises(LmtrainError, match="flash.ablate"):
        set_settings(ablate=1)


def test_use_settings_changes_selection_and_restores() -> None:
    before = settings.current()
    with use_settings(gluon="off", autotune=False) as inside:
        assert settings.current() is inside and not inside.autotune
        assert select(call(), version=TESTED).fwd == TMA
    assert settings.current() == before


def test_a_given_configuration_replaces_the_tuned_one() -> None:
    cfg = FlashSettings(gluon_dkdv_config="2,32,2")
    assert tuning.config(tuning.DKDV, 64, 8192, override=cfg.gluon_config("dkdv")) == tuning.Config(2, 32, 2)
    # the fused backward needs 64-query blocks: a 32-query configuration rules it out
    assert not select(call(d=64, n=8192), cfg, TESTED).fused


def test_explain_names_kernels_for_a_named_device_and_says_what_cpu_runs() -> None:
    text = explain([(512, 80), (4096, 64)], device="sm_90", version=TESTED)
    assert "sm_90" in text and "_flash_tma_fwd" in text and "_flash_fused_bwd_atomic" in text
    assert "interpreter" in explain([(512, 80)], device="cpu", version=TESTED)
    assert "untested" in explain([(512, 80)], device="sm_90", version=(9, 9))


def test_describe_records_settings_and_the_plan_of_each_shape() -> None:
    record = describe([(512, 80)], device="sm_90", settings=FlashSettings(gluon="off"), version=TESTED)
    assert record["settings"] == dataclasses.asdict(FlashSettings(gluon="off"))
    assert record["plans"]["N=512,d=80"]["kernels"] == ["_flash_tma_fwd", "_flash_tma_bwd_dq", "_flash_tma_bwd_dkdv"]
    assert record["triton"] == f"{TESTED[0]}.{TESTED[1]}"


def test_describe_plans_for_deterministic_mode_as_the_calls_see_it() -> None:
    """The record follows torch.use_deterministic_algorithms, as call_of does for the kernels that run: under it
    no fused backward at 8192 keys, d 128, and the why says so; at 1024 keys, where the fused backward would not
    serve anyway, the why does not blame deterministic mode."""
    start = tuning.FUSED_FROM[128]
    key = f"N={start},d=128"
    free = describe([(start, 128)], device="sm_90", version=TESTED, deterministic=False)["plans"][key]
    assert free["dq"] == free["dkdv"] == FUSED
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        record = describe([(start, 128), (1024, 64)], device="sm_90", version=TESTED)
        text = explain([(start, 128)], device="sm_90", version=TESTED)
    finally:
        torch.use_deterministic_algorithms(before)
    assert record["deterministic"] is True
    plan = record["plans"][key]
    assert FUSED not in (plan["dq"], plan["dkdv"]) and "deterministic algorithms: no fused backward" in plan["why"]
    assert "deterministic algorithms: no fused backward" not in record["plans"]["N=1024,d=64"]["why"]
    assert "deterministic algorithms" in text.splitlines()[0] and "no fused backward" in text


def test_plan_kernels_are_the_implementations_exported_names() -> None:
    from lmtrain.kernels.flash import KERNEL_NAMES

    named = {n for names in dispatch.KERNELS.values() for n in names}
    assert named == set(KERNEL_NAMES)
    assert FUSED in {impl for impl, _ in dispatch.KERNELS}


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_every_kernel_has_one_unique_name_in_one_backend() -> None:
    """Every jit function under lmtrain/kernels is a kernel listed in exactly one backend's names (the attention
    registry's, or the optimizer's), or a device function another jit function uses (calls, or runs as a warp
    partition)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    from lmtrain.attention import kernel_names
    from lmtrain.kernels.master_adamw import KERNEL_NAMES as ADAMW

    owners = {**kernel_names(), "master_adamw": frozenset(ADAMW)}
    listed = [n for names in owners.values() for n in names]
    assert len(listed) == len(set(listed)), "a kernel name is listed twice"
    modules = ["master_adamw"] + [f"flash.{m}" for m in ("common", "pointer", "tma", "gluon_common", "gluon_fwd",
                                                          "gluon_bwd", "fused_bwd")]
    functions = {}
    for name in modules:
        module = importlib.import_module(f"lmtrain.kernels.{name}")
        for attr, obj in vars(module).items():
            fn = obj.fn if isinstance(obj, Autotuner) else obj
            if isinstance(fn, JITFunction) and fn.fn.__module__ == module.__name__:
                functions[(name, attr)] = fn
    sources = {key: fn.src for key, fn in functions.items()}
    for module, attr in functions:
        called = any(re.search(rf"\b{attr}\(|\({attr}, \(", src) for key, src in sources.items()
                     if key != (module, attr) and key[0].split(".")[0] == module.split(".")[0])
        assert attr in listed or called, f"{module}.{attr}: neither listed as a kernel nor called"
        assert not (attr in listed and called), f"{module}.{attr}: listed as a kernel but called as a function"
    kernels = [attr for (_, attr) in functions if attr in listed]
    assert sorted(kernels) == sorted(listed), "a listed name is no jit function"
    assert all(re.search(r"^_flash_", n) for n in owners["flash_triton"])


def test_estimate_says_which_kernels_would_serve_the_model_on_sm90() -> None:
    from lmtrain.estimate import flash_kernel_lines

    text = flash_kernel_lines(512, 80, "bf16-mixed")
    assert "N    512, d  80" in text and "sm_90" in text
