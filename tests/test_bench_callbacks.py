"""`python -m lmtrain bench callbacks --allow-cpu`: tiny smoke runs, in one process and one process per setting."""

from __future__ import annotations

import json
import os

import bench_faults
import pytest
from bench_faults import FAIL_ENV
from tb import scalars

from lmtrain.bench import callbacks
from lmtrain.bench.callbacks import CALLBACKS, last_window_step, window_plan
from lmtrain.cli import main

TINY = ["--allow-cpu", "--config", "", "--size", "tiny", "--batch-size", "2", "--context-length", "16",
        "--precision", "32-true", "--steps", "4", "--window-start", "1", "--measure-from", "3", "--no-stagger"]


def test_bench_callbacks_smoke_in_process(tmp_path):
    out, logdir = tmp_path / "bench.json", tmp_path / "logs"
    rc = main(["bench", "callbacks", *TINY, "--no-isolate", "--settings", "none", "CudaSyncTimer", "all",
               "--out", str(out), "--logdir", str(logdir)])
    assert rc == 0
    result = json.loads(out.read_text())
    rows = {r["setting"]: r for r in result["rows"]}
    assert list(rows) == ["none", "CudaSyncTimer", "all five", "none (again)"]
    for row in rows.values():
        assert row["steps"] == 4 and row["median_step_ms"] > 0 and row["hooks_left"] == 0
        assert row["pid"] == os.getpid()
    first, last = rows["none"]["median_step_ms"], rows["none (again)"]["median_step_ms"]
    base = (first + last) / 2  # overheads are against the mean of the two baselines
    meta = result["meta"]
    assert meta["isolated"] is False and meta["baseline_step_ms"] == pytest.approx(base)
    assert meta["baseline_drift_pct"] == pytest.approx(100 * (last / first - 1))
    for row in rows.values():
        assert row["overhead_pct"] == pytest.approx(100 * (row["median_step_ms"] / base - 1))
    assert "timer_vs_probe_pct" in rows["CudaSyncTimer"] and "timer_vs_probe_pct" in rows["all five"]
    assert meta["steps"] == 4 and meta["device"] == "cpu"
    assert "time/step_ms" in scalars(logdir)  # the all-five run's TensorBoard logs


@pytest.mark.slow
def test_bench_callbacks_one_process_per_setting(tmp_path, monkeypatch, capsys):
    """Each setting runs in its own child process; a child that fails is recorded and the others go on."""
    bench_faults.use(monkeypatch, callbacks, "SETTING_TARGET", "callbacks_setting", "NVTXRanges")
    out = tmp_path / "bench.json"
    rc = main(["bench", "callbacks", *TINY, "--settings", "none", "NVTXRanges", "--out", str(out),
               "--logdir", str(tmp_path / "logs")])
    assert rc == 0
    result = json.loads(out.read_text())
    rows = {r["setting"]: r for r in result["rows"]}
    assert list(rows) == ["none", "NVTXRanges", "none (again)"]
    failed = rows["NVTXRanges"]
    assert failed["status"] == "error" and FAIL_ENV in failed["note"] and "median_step_ms" not in failed
    pids = [rows["none"]["pid"], rows["none (again)"]["pid"]]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for name in ("none", "none (again)"):
        assert rows[name]["steps"] == 4 and rows[name]["median_step_ms"] > 0
    assert result["meta"]["isolated"] is True
    assert result["meta"]["baseline_drift_pct"] == pytest.approx(
        100 * (rows["none (again)"]["median_step_ms"] / rows["none"]["median_step_ms"] - 1))
    assert "baseline drift (none (again) vs none)" in capsys.readouterr().out


def test_bench_callbacks_needs_gpu_without_allow_cpu(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "callbacks"]) == 2
    assert "--allow-cpu" in capsys.readouterr().err


def test_window_plan_staggers_only_when_several_run_together():
    plan = window_plan(list(CALLBACKS), 5)
    assert plan == {"CudaSyncTimer": 5, "NVTXRanges": 10, "MemorySnapshot": 9, "KernelShare": 5,
                    "PrecisionInspector": 8}
    # KernelShare profiles 5..7; the others open after it, one after another, and never overlap
    assert last_window_step(list(CALLBACKS), 5) == 12
    assert window_plan(["KernelShare"], 5) == {"KernelShare": 5}
    assert set(window_plan(list(CALLBACKS), 5, stagger=False).values()) == {5}
    assert last_window_step(list(CALLBACKS), 5, stagger=False) == 7


def test_bench_callbacks_warns_when_measuring_inside_a_window(tmp_path, capsys):
    rc = main(["bench", "callbacks", *[a for a in TINY if a != "--no-stagger"], "--no-isolate", "--settings",
               "none", "--out", str(tmp_path / "b.json"), "--logdir", str(tmp_path / "logs")])
    assert rc == 0
    assert "--measure-from 3 is inside a window (the last window step is 8)" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_callbacks_on_two_ranks(tmp_path, capsys):
    """--devices 2: each setting trains on 2 gloo processes (Lightning starts rank 1 by re-running the setting's
    process); the row's step time is the slowest rank's median, with every rank's median and the straggler
    ratio beside it, and KernelShare's communication time of the profiled steps."""
    out = tmp_path / "bench.json"
    args = [a if a != "4" else "6" for a in TINY]  # 6 steps: the statistics use steps 3..5
    rc = main(["bench", "callbacks", *args, "--devices", "2", "--settings", "KernelShare",
               "--out", str(out), "--logdir", str(tmp_path / "logs")])
    assert rc == 0
    result = json.loads(out.read_text())
    rows = {r["setting"]: r for r in result["rows"]}
    assert list(rows) == ["KernelShare"]  # one setting: two processes start per setting, which takes a while
    assert result["meta"]["devices"] == 2 and result["meta"]["strategy"] == "ddp"
    for row in rows.values():
        medians = row["rank_median_step_ms"]
        assert row["steps"] == 6 and len(medians) == 2 and all(m > 0 for m in medians)
        assert row["median_step_ms"] == max(medians) and row["slowest_rank"] == medians.index(max(medians))
        assert 1.0 <= row["straggler_ratio_median"] <= row["straggler_ratio_max"]
    assert rows["KernelShare"]["communication_ms"] > 0  # gloo's all-reduces of the gradients
    assert 0 < rows["KernelShare"]["communication_share"] < 1
    table = capsys.readouterr().out
    assert "2 ranks, ddp" in table and "straggler ratio" in table


def test_rank_statistics_takes_the_slowest_rank_and_per_step_ratios():
    per_rank = [[50.0, 10.0, 12.0, 11.0], [9.0, 20.0, 10.0, 11.0]]
    row = callbacks.rank_statistics(per_rank, measure_from=1)
    assert row["rank_median_step_ms"] == [11.0, 11.0]
    assert row["median_step_ms"] == 11.0 and row["slowest_rank"] == 0
    assert row["straggler_ratio_max"] == pytest.approx(2.0)  # step 1: 20 / 10
    assert row["straggler_ratio_median"] == pytest.approx(1.2)  # ratios 2.0, 1.2, 1.0
    assert callbacks.rank_statistics([[1.0], [2.0]], measure_from=3) == {}


def test_bench_callbacks_refuses_several_devices_in_one_process(capsys):
    assert main(["bench", "callbacks", *TINY, "--devices", "2", "--no-isolate"]) == 2
    assert "--isolate" in capsys.readouterr().err


def test_hooks_left_leaves_out_the_strategys_own_hooks():
    """FSDP2 keeps a forward pre- and post-hook on every sharded module: those are not a callback's leftovers."""
    import functools

    import torch

    def strategy_hook(module, args):  # stands for FSDP2's (its function's module is torch.distributed...)
        return None

    def leftover(module, args, output):
        return None

    strategy_hook.__module__ = "torch.distributed.fsdp._fully_shard._fsdp_state"
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    for layer in model:
        layer.register_forward_pre_hook(functools.partial(strategy_hook))
    assert callbacks._hooks_left(model) == 0
    model[1].register_forward_hook(leftover)
    assert callbacks._hooks_left(model) == 1


@pytest.mark.parametrize(("args", "said"), [(["--settings", "bogus"], "--settings bogus: no such setting"),
                                            (["--size", "bogus"], "--size 'bogus' is no model size"),
                                            (["--batch-size", "0"], "--batch-size must be at least 1")])
def test_bad_settings_size_and_batch_are_refused_before_any_fit(args: list[str], said: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """They ran nothing and printed an empty table, failed in every child process, or silently took the default,
    each with exit status 0."""
    from lmtrain.cli import main

    assert main(["bench", "callbacks", "--allow-cpu", *args]) == 2
    assert said in capsys.readouterr().err
