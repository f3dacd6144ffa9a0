"""``python -m lmtrain bench overhead``: refuses without a GPU, runs on the CPU with --allow-cpu."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import bench_faults
import pytest
import torch
from bench_faults import FAIL_ENV

from lmtrain.bench import overhead
from lmtrain.bench.comparison import baseline
from lmtrain.bench.runner import args_payload
from lmtrain.cli import main

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
SMALL_RUN = ["--config", TINY, "--steps", "4", "--warmup", "1", "--batch-size", "2", "--context-length", "32",
             "--allow-cpu"]


def test_refuses_without_gpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "overhead", "--config", TINY]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: device: ") and "--allow-cpu" in err


def test_bad_config_path(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    assert main(["bench", "overhead", "--config", str(tmp_path / "nope.yaml"), "--allow-cpu"]) == 2
    assert capsys.readouterr().err.startswith("error: --config: ")


@pytest.mark.slow
def test_runs_on_cpu_in_process(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "overhead.json"
    status = main(["bench", "overhead", *SMALL_RUN, "--no-isolate", "--out", str(out)])
    assert status == 0
    table = capsys.readouterr().out
    assert "| run " in table and "Lightning overhead:" in table and "baseline drift" in table
    result = json.loads(out.read_text())
    assert [r["name"] for r in result["runs"]] == ["plain", "lightning", "lightning_no_progress_bar", "plain"]
    assert (result["batch_size"], result["context_length"], result["precision"]) == (2, 32, "32-true")
    assert result["isolated"] is False
    for run in result["runs"]:
        assert run["status"] == "ok" and run["pid"] == os.getpid()
        assert len(run["step_ms"]) == len(run["in_step_ms"]) == 3  # 4 steps, 1 warm-up
        assert all(t > 0 for t in run["step_ms"])
        assert run["memory_released"] is True  # nothing of a run outlives it: the next one gets the memory
        assert run["tokens_per_s"] == pytest.approx(2 * 32 / run["median_step_ms"] * 1e3)
    plain = sorted(t for r in result["runs"] if r["name"] == "plain" for t in r["step_ms"])
    assert result["plain_median_step_ms"] == pytest.approx((plain[2] + plain[3]) / 2)  # pooled, for reference
    first, last = result["runs"][0]["median_step_ms"], result["runs"][3]["median_step_ms"]
    assert result["baseline_step_ms"] == pytest.approx((first + last) / 2)
    assert result["baseline_drift_pct"] == pytest.approx(100 * (last / first - 1))
    lightning = result["runs"][1]["median_step_ms"]
    assert result["overhead_pct"]["lightning"] == pytest.approx((lightning / result["baseline_step_ms"] - 1) * 100)


@pytest.mark.slow
def test_one_process_per_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Each run is its own child process; a failing child is recorded as an error and the other runs go on."""
    bench_faults.use(monkeypatch, overhead, "SETTING_TARGET", "overhead_setting", "lightning")
    out = tmp_path / "overhead.json"
    status = main(["bench", "overhead", *SMALL_RUN, "--no-diagnostic", "--out", str(out)])
    assert status == 1  # not every run succeeded
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert [r["name"] for r in runs] == ["plain", "lightning", "plain"] and result["isolated"] is True
    assert runs[1]["status"] == "error" and FAIL_ENV in runs[1]["error"] and runs[1]["step_ms"] == []
    assert result["overhead_pct"] == {"lightning": None}
    pids = [runs[0]["pid"], runs[2]["pid"]]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for run in (runs[0], runs[2]):
        assert run["status"] == "ok" and len(run["step_ms"]) == 3 and run["memory_released"] is True
    assert result["baseline_drift_pct"] == pytest.approx(100 * (runs[2]["median_step_ms"] / runs[0]["median_step_ms"]
                                                                 - 1))
    assert "lightning (error): process exited with status 1:" in capsys.readouterr().out


def test_child_over_timeout_is_recorded(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    assert main(["bench", "overhead", *SMALL_RUN, "--no-diagnostic", "--timeout", "0.2", "--out", str(out)]) == 1
    runs = json.loads(out.read_text())["runs"]
    assert [(r["name"], r["status"]) for r in runs] == [("plain", "timeout"), ("lightning", "timeout"),
                                                          ("plain", "timeout")]
    assert all("--timeout 0.2" in r["error"] for r in runs)


def test_children_get_the_parents_arguments() -> None:
    """A run's process rebuilds this process's arguments from the payload it is given."""
    parser = argparse.ArgumentParser()
    overhead.add_arguments(parser)
    args = parser.parse_args(["--config", "x.yaml", "--steps", "7", "--no-diagnostic", "--allow-cpu",
                              "--out", "o.json", "--no-isolate", "--timeout", "5"])
    payload = json.loads(json.dumps(args_payload(args)))  # what travels to the child
    assert argparse.Namespace(**payload) == args


def test_baseline() -> None:
    assert baseline(100.0, 110.0) == (pytest.approx(105.0), pytest.approx(10.0))
    assert baseline(None, 110.0) == (110.0, None)
    assert baseline(None, None) == (None, None)
