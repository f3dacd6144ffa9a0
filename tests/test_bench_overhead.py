"""``python -m lmtrain bench overhead``: refuses without a GPU, runs on the CPU with --allow-cpu."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmtrain.cli import main

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


def test_refuses_without_gpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "overhead", "--config", TINY]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: device: ") and "--allow-cpu" in err


def test_bad_config_path(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    assert main(["bench", "overhead", "--config", str(tmp_path / "nope.yaml"), "--allow-cpu"]) == 2
    assert capsys.readouterr().err.startswith("error: --config: ")


def test_runs_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "overhead.json"
    status = main(["bench", "overhead", "--config", TINY, "--steps", "4", "--warmup", "1", "--batch-size", "2",
                   "--context-length", "32", "--allow-cpu", "--out", str(out)])
    assert status == 0
    table = capsys.readouterr().out
    assert "| run " in table and "Lightning overhead:" in table
    result = json.loads(out.read_text())
    assert [r["name"] for r in result["runs"]] == ["plain", "lightning", "lightning_no_progress_bar", "plain"]
    assert (result["batch_size"], result["context_length"], result["precision"]) == (2, 32, "32-true")
    for run in result["runs"]:
        assert run["status"] == "ok"
        assert len(run["step_ms"]) == len(run["in_step_ms"]) == 3  # 4 steps, 1 warm-up
        assert all(t > 0 for t in run["step_ms"])
        assert run["memory_released"] is True  # nothing of a run outlives it: the next one gets the memory
        assert run["tokens_per_s"] == pytest.approx(2 * 32 / run["median_step_ms"] * 1e3)
    plain = sorted(t for r in result["runs"] if r["name"] == "plain" for t in r["step_ms"])
    assert result["plain_median_step_ms"] == pytest.approx((plain[2] + plain[3]) / 2)
    lightning = result["runs"][1]["median_step_ms"]
    assert result["overhead_pct"]["lightning"] == pytest.approx((lightning / result["plain_median_step_ms"] - 1) * 100)
