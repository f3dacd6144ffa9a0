"""benchmarks/scripts/instruments_check.py and hta_compare.py without a GPU: what is written when, and the exit
status when HTA compared nothing (the fits and HTA are stood in for)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import temporal_traces as traces
from conftest import load_script


@pytest.fixture
def scripts() -> Iterator[tuple[ModuleType, ModuleType]]:
    check = load_script("instruments_check")
    yield check, sys.modules["hta_compare"]
    for name in ("instruments_check", "hta_compare", "tb_figures"):
        sys.modules.pop(name, None)


def test_each_fit_is_recorded_when_it_ends_and_each_model_gets_its_table(
        tmp_path: Path, scripts: tuple[ModuleType, ModuleType], monkeypatch: pytest.MonkeyPatch) -> None:
    check, _ = scripts
    seen: list[tuple[str, list[str], bool]] = []  # at each fit's start: the fits recorded so far, summary written

    def fit(out: Path, name: str, *args: object, timeout: int, extra: list[str] | None = None) -> dict:
        recorded = [json.loads(line)["fit"] for line in (out / "results.jsonl").read_text().splitlines()] \
            if (out / "results.jsonl").exists() else []
        seen.append((name, recorded, (out / "summary.md").exists()))
        assert timeout == 240
        return {"name": name, "rc": 1, "seconds": 1.0, "log_dir": None, "command": name}

    monkeypatch.setattr(check, "fit", fit)
    assert check.main(["run", str(tmp_path), "--models", "small", "2.7B", "--only", "sdpa512", "--fit-timeout",
                       "240"]) == 1
    assert seen == [("small_sdpa512", [], False), ("small_sdpa512_timer", ["small_sdpa512"], False),
                    ("2.7B_sdpa512", ["small_sdpa512", "small_sdpa512_timer"], True),
                    ("2.7B_sdpa512_timer", ["small_sdpa512", "small_sdpa512_timer", "2.7B_sdpa512"], True)]
    tables = (tmp_path / "summary.md").read_text().split("\n\n")
    assert "small_sdpa512" in tables[0] and "2.7B_sdpa512" in tables[1]


def test_skip_hta_leaves_the_traces_alone(tmp_path: Path, scripts: tuple[ModuleType, ModuleType],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    check, _ = scripts
    (tmp_path / "kernel_trace.json.gz").write_bytes(b"")
    monkeypatch.setattr(check, "read", lambda log_dir: ({}, {}))
    calls: list[Path] = []
    monkeypatch.setattr(check, "hta_differences", lambda trace, rank=0: calls.append(trace) or {})
    assert "hta" not in check.figures({"log_dir": tmp_path}, hta=False) and calls == []
    assert "hta" in check.figures({"log_dir": tmp_path}) and len(calls) == 1


def test_hta_compare_fails_when_hta_compared_nothing(tmp_path: Path, scripts: tuple[ModuleType, ModuleType],
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    _, hta_compare = scripts

    def no_hta(*args: object, **kwargs: object) -> dict:
        raise ModuleNotFoundError("No module named 'hta'")

    monkeypatch.setattr(hta_compare, "hta_figures", no_hta)
    path = tmp_path / "rank0_trace.json"
    path.write_text(json.dumps(traces.eager()))
    assert hta_compare.main([str(path)]) == 1
    assert "HTA did not run on any trace" in capsys.readouterr().out


def test_the_span_over_the_timer_on_the_profiled_steps_has_its_column(
        tmp_path: Path, scripts: tuple[ModuleType, ModuleType]) -> None:
    """A host-bound fit's figures read from its TensorBoard scalars: span / profiled (the GPU span over the timer's
    mean on the profiled steps) gets its own column; the busy criterion still judges busy / step alone."""
    from torch.utils.tensorboard import SummaryWriter

    check, _ = scripts
    logged = {"kernels/timer_step_ms": 61.5, "kernels/busy_to_timer_step": 0.195, "kernels/span_to_timer_step": 1.928,
              "kernels/wall_to_timer_step": 1.951, "kernels/timer_profiled_step_ms": 119.8,
              "kernels/span_to_timer_profiled": 0.99, "kernels/busy_to_timer_profiled": 0.1,
              "kernels/other_share_step": 0.0}
    writer = SummaryWriter(str(tmp_path))
    for tag, value in logged.items():
        writer.add_scalar(tag, value, 39)
    writer.close()
    f = check.figures({"log_dir": tmp_path}, hta=False)
    assert f["span_to_profiled"] == pytest.approx(0.99) and f["timer_profiled_ms"] == pytest.approx(119.8)
    cells, ok = check.row("small_sdpa512", f, None)
    assert dict(zip(check.HEADER, cells, strict=True)) == {
        "fit": "small_sdpa512", "timer step ms": "61.500", "busy / step": "0.195", "span / step": "1.928",
        "wall / step": "1.951", "span / profiled": "0.990", "busy / profiled": "0.100", "other": "0.00%",
        "HTA breakdown (pts)": "-",
        "HTA idle split (pts)": "-", "phases / step": "-", "overhead": "-", "hooks / step": "-", "pass": "NO: busy"}
    assert not ok


def test_hooks_per_step_count_only_the_callbacks_the_reference_lacks(
        tmp_path: Path, scripts: tuple[ModuleType, ModuleType], monkeypatch: pytest.MonkeyPatch) -> None:
    check, _ = scripts
    log_dir = tmp_path / "run" / "lmtrain" / "version_0"
    log_dir.mkdir(parents=True)
    (tmp_path / "run" / "hooks.json").write_text(json.dumps({
        "CudaSyncTimer": {"median_us": 900.0, "max_us": 2000.0, "steps": 40},  # the reference runs it too
        "NVTXRanges": {"median_us": 30.0, "max_us": 40.0, "steps": 40},
        "MemorySnapshot": {"median_us": 20.0, "max_us": 9e6, "steps": 40},
        "KernelShare{'wait': 5}": {"median_us": 40.0, "max_us": 5e6, "steps": 40},
        "PrecisionInspector": {"median_us": 10.0, "max_us": 3e6, "steps": 40},
        "TQDMProgressBar": {"median_us": 300.0, "max_us": 400.0, "steps": 40}}))
    monkeypatch.setattr(check, "read", lambda log_dir: ({"kernels/timer_step_ms": [(39, 20.0)]}, {}))
    f = check.figures({"log_dir": log_dir}, hta=False)
    assert f["added_hooks_ms"] == pytest.approx(0.1) and f["hooks_to_step"] == pytest.approx(0.005)
    cells, _ = check.row("fit", f, None)
    assert cells[check.HEADER.index("hooks / step")] == "0.50%"
    (tmp_path / "run" / "hooks.json").unlink()
    assert check.figures({"log_dir": log_dir}, hta=False)["added_hooks_ms"] is None


def test_default_fits_are_the_four_paths_and_the_others_run_when_named(
        tmp_path: Path, scripts: tuple[ModuleType, ModuleType], monkeypatch: pytest.MonkeyPatch) -> None:
    check, _ = scripts
    made: list[tuple[str, list[str]]] = []

    def fit(out: Path, name: str, config: str, args: list[str], *rest: object, timeout: int, **kw: object) -> dict:
        made.append((name, args))
        return {"name": name, "rc": 1, "seconds": 1.0, "log_dir": None, "command": name}

    monkeypatch.setattr(check, "fit", fit)
    check.main(["run", str(tmp_path / "a"), "--models", "small"])
    assert [n for n, _ in made if not n.endswith("_timer")] == [f"small_{k}" for k in check.DEFAULT_FITS]
    made.clear()
    check.main(["run", str(tmp_path / "b"), "--models", "small", "--only", "inbackward", "checkpointing"])
    assert [(n, a) for n, a in made if not n.endswith("_timer")] == [
        ("small_inbackward", ["--model.optimizer_in_backward", "true", "--trainer.devices", "1"]),
        ("small_checkpointing", ["--model.activation_checkpointing", "full", "--trainer.devices", "1"])]


def test_ddp_fit_uses_the_ddp_config_without_a_mesh_size(
        tmp_path: Path, scripts: tuple[ModuleType, ModuleType], monkeypatch: pytest.MonkeyPatch) -> None:
    check, _ = scripts
    calls: list[tuple[str, str, list[str]]] = []

    def fit(out: Path, name: str, config: str, args: list[str], callbacks: list[str], steps: int,
            extra: list[str] | None = None, timeout: int = 0) -> dict:
        calls.append((name, config, extra or []))
        return {"name": name, "rc": 1, "seconds": 1.0, "log_dir": None, "command": name}

    monkeypatch.setattr(check, "fit", fit)
    assert check.main(["fsdp", str(tmp_path), "--size", "xl", "--strategy", "ddp", "--devices", "4"]) == 1
    assert check.main(["fsdp", str(tmp_path), "--size", "small", "--devices", "2"]) == 1
    assert calls == [("xl_ddp4", "xl_bf16_ddp.yaml", ["--trainer.devices", "4"]),
                     ("small_fsdp2", "2.7B_bf16_fsdp.yaml",
                      ["--trainer.devices", "2", "--trainer.strategy.init_args.data_parallel_size", "2"])]
    calls.clear()  # --overhead: no timer-only reference for a fit that failed
    assert check.main(["fsdp", str(tmp_path), "--size", "small", "--devices", "2", "--overhead"]) == 1
    assert [name for name, _, _ in calls] == ["small_fsdp2"]


def test_fsdp_overhead_fits_the_timer_alone_after_a_fit_that_ran(
        tmp_path: Path, scripts: tuple[ModuleType, ModuleType], monkeypatch: pytest.MonkeyPatch) -> None:
    check, _ = scripts
    calls: list[str] = []
    codes = {"small_fsdp2": 0, "small_fsdp2_timer": 1}

    def fit(out: Path, name: str, config: str, args: list[str], callbacks: list[str], steps: int,
            extra: list[str] | None = None, timeout: int = 0) -> dict:
        calls.append(name)
        return {"name": name, "rc": codes[name], "seconds": 1.0, "log_dir": None, "command": name}

    monkeypatch.setattr(check, "fit", fit)
    # the timer-only fit failed: exit 1
    assert check.main(["fsdp", str(tmp_path), "--size", "small", "--devices", "2", "--overhead"]) == 1
    assert calls == ["small_fsdp2", "small_fsdp2_timer"]
    codes["small_fsdp2_timer"] = 0
    assert check.main(["fsdp", str(tmp_path), "--size", "small", "--devices", "2", "--overhead"]) == 0


def test_window_line_is_kernel_shares_setup_line_or_none(tmp_path: Path,
                                                          scripts: tuple[ModuleType, ModuleType]) -> None:
    check, _ = scripts
    log = tmp_path / "fit.log"
    assert check.window_line(log) is None
    log.write_text("Seed set to 0\nKernelShare: profiling steps 6-8 instead of steps 5-7 (wait=6, not 5): another "
                   "rank's callbacks perturb the timing of a step it would report.\nEpoch 0\n")
    assert check.window_line(log).startswith("KernelShare: profiling steps 6-8 instead of steps 5-7")
    log.write_text("Seed set to 0\nEpoch 0\n")
    assert check.window_line(log) is None


@pytest.mark.parametrize("fails", [False, True])
def test_hta_on_gpu_events_only_is_recorded_or_its_error(tmp_path: Path, scripts: tuple[ModuleType, ModuleType],
                                                         monkeypatch: pytest.MonkeyPatch, fails: bool) -> None:
    """A trace with inductor's launch operators gets HTA a second time without their stream arguments: its largest
    distance from lmtrain, or its error, next to the first comparison (which stands either way)."""
    check, hta_compare = scripts
    path = tmp_path / "rank0_trace.json"
    path.write_text(json.dumps(traces.triton_launch_operators()))
    mine = hta_compare.lmtrain_figures(path)

    def fake_hta(trace: Path, rank: int, rounding: bool = False, gpu_only: bool = False) -> dict:
        if gpu_only and fails:
            raise AssertionError("non_compute_time >= 0")
        return {k: v + (0.0 if gpu_only else 1.5) for k, v in mine.items() if "whole GPU" not in k}

    monkeypatch.setattr(hta_compare, "hta_figures", fake_hta)
    out = check.hta_differences(path)
    assert out["hta_breakdown_points"] == pytest.approx(1.5)
    if fails:
        assert out["hta_gpu_only_error"] == "AssertionError: non_compute_time >= 0" and "hta_gpu_only" not in out
    else:
        assert out["hta_gpu_only_points"] == 0.0 and "hta_gpu_only_error" not in out


def test_compare_fits_the_timer_alone_once_more_with_the_given_arguments(
        tmp_path: Path, scripts: tuple[ModuleType, ModuleType], monkeypatch: pytest.MonkeyPatch) -> None:
    check, _ = scripts
    made: list[tuple[str, list[str], list[str]]] = []
    medians = {"small_fast_timer": 10.0, "small_fast_compare": 10.5}

    def fit(out: Path, name: str, config: str, args: list[str], callbacks: list[str], *rest: object, timeout: int,
            **kw: object) -> dict:
        made.append((name, args, callbacks))
        return {"name": name, "rc": 0 if name in medians else 1, "seconds": 1.0,
                "log_dir": name if name in medians else None, "command": name}

    monkeypatch.setattr(check, "fit", fit)
    monkeypatch.setattr(check, "read", lambda log_dir: ({"time/step_ms": [(9, medians[log_dir])]}, {}))
    check.main(["run", str(tmp_path), "--models", "small", "--only", "fast", "--compare",
                "--model.blas_workspace default"])
    assert made[-1] == ("small_fast_compare", ["--trainer.devices", "1", "--model.blas_workspace", "default"],
                        check.TIMER_ONLY)
    # every fit of run is on one GPU, whatever the machine has
    assert all(args[args.index("--trainer.devices") + 1] == "1" for _, args, _ in made), made
    last = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[-1])
    assert last["fit"] == "small_fast_compare" and last["compare_to_timer_only"] == pytest.approx(1.05)


def test_kernel_share_options_and_steps_reach_the_instrumented_fits(
        tmp_path: Path, scripts: tuple[ModuleType, ModuleType], monkeypatch: pytest.MonkeyPatch) -> None:
    """--kernel-share adds KernelShare's options to each fit with all five (after KernelShare, before
    PrecisionInspector), not to the timer-only reference; --steps sets every fit's steps (run) as fsdp's does."""
    check, _ = scripts
    made: list[tuple[str, list[str], int]] = []

    def fit(out: Path, name: str, config: str, args: list[str], callbacks: list[str], steps: int,
            extra: list[str] | None = None, timeout: int = 0) -> dict:
        made.append((name, callbacks, steps))
        return {"name": name, "rc": 1, "seconds": 1.0, "log_dir": None, "command": name}

    monkeypatch.setattr(check, "fit", fit)
    check.main(["run", str(tmp_path / "a"), "--models", "small", "--only", "fast", "--steps", "120",
                "--kernel-share", "--trainer.callbacks.wait=80 --trainer.callbacks.active=2"])
    assert [(n, s) for n, _, s in made] == [("small_fast", 120), ("small_fast_timer", 120)]
    name, callbacks, steps = made[0]
    assert not any("wait=80" in c for c in made[1][1])  # the timer-only reference has no KernelShare
    at = callbacks.index("--trainer.callbacks+=lmtrain.callbacks.KernelShare")
    assert callbacks[at + 2:at + 4] == ["--trainer.callbacks.wait=80", "--trainer.callbacks.active=2"]
    assert callbacks[at + 4] == "--trainer.callbacks+=lmtrain.callbacks.PrecisionInspector"
    made.clear()
    check.main(["run", str(tmp_path / "b"), "--models", "small", "--only", "fast"])
    assert [(n, s) for n, _, s in made] == [("small_fast", 100), ("small_fast_timer", 100)]
    assert not any("wait=80" in c for _, cbs, _ in made for c in cbs)
    made.clear()
    check.main(["fsdp", str(tmp_path / "c"), "--size", "small", "--devices", "2", "--steps", "120",
                "--kernel-share=--trainer.callbacks.wait=80"])
    (name, callbacks, steps), = made
    at = callbacks.index("--trainer.callbacks.ranks=[0,1]")
    assert callbacks[at + 1] == "--trainer.callbacks.wait=80" and steps == 120
