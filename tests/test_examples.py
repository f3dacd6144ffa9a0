"""The examples run as shipped: a Python script with LMModule, LMDataModule, a Trainer and lmtrain callbacks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tb import scalars

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_with_callbacks.py"


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(EXAMPLE), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_train_with_callbacks_runs_and_resumes(tmp_path: Path) -> None:
    first = _run(["--steps", "6"], tmp_path)
    assert first.returncode == 0, first.stderr
    run_dir = tmp_path / "logs" / "lmtrain" / "version_0"
    logged = scalars(run_dir)
    assert [step for step, _ in logged["train/loss"]] == [4]  # log_every_n_steps=5: step index 4
    assert "train/lr" in logged and "test/loss" in logged
    assert "hp_metric" not in logged
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6

    second = _run(["--steps", "10", "--resume"], tmp_path)
    assert second.returncode == 0, second.stderr
    assert [p.name for p in (tmp_path / "logs" / "lmtrain").iterdir()] == ["version_0"]
    assert [step for step, _ in scalars(run_dir)["train/loss"]] == [4, 9]
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 10
