"""`python -m lmtrain bench callbacks --allow-cpu`: a tiny smoke run of the overhead benchmark."""

from __future__ import annotations

import json

from tb import scalars

from lmtrain.cli import main


def test_bench_callbacks_smoke(tmp_path):
    out, logdir = tmp_path / "bench.json", tmp_path / "logs"
    rc = main(["bench", "callbacks", "--allow-cpu", "--config", "", "--size", "tiny", "--batch-size", "2",
               "--context-length", "16", "--precision", "32-true", "--steps", "4", "--window-start", "1",
               "--measure-from", "3", "--settings", "none", "CudaSyncTimer", "all", "--out", str(out),
               "--logdir", str(logdir)])
    assert rc == 0
    result = json.loads(out.read_text())
    rows = {r["setting"]: r for r in result["rows"]}
    assert list(rows) == ["none", "CudaSyncTimer", "all five", "none (again)"]
    for row in rows.values():
        assert row["steps"] == 4 and row["median_step_ms"] > 0 and row["hooks_left"] == 0
    assert rows["none"]["overhead_pct"] == 0.0
    assert "timer_vs_probe_pct" in rows["CudaSyncTimer"] and "timer_vs_probe_pct" in rows["all five"]
    assert result["meta"]["steps"] == 4 and result["meta"]["device"] == "cpu"
    assert "time/step_ms" in scalars(logdir)  # the all-five run's TensorBoard logs


def test_bench_callbacks_needs_gpu_without_allow_cpu(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "callbacks"]) == 2
    assert "--allow-cpu" in capsys.readouterr().err
