"""``python -m lmtrain fit --config configs/tiny.yaml`` on 2 CPU processes (DDP over gloo) with all five callbacks.

The run's rank-averaged losses equal those of one process reading the same global batches (the data module
gives rank r its slice of each global batch), rank 0's TensorBoard folder holds the cross-rank tags, and no
other rank writes events.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from subprocs import ROOT, own_job_env
from tb import scalars as read_scalars

STEPS = 5
OVERLAY = """
trainer:
  enable_checkpointing: false
  num_sanity_val_steps: 0
  log_every_n_steps: 1
  callbacks:
    - class_path: lmtrain.callbacks.CudaSyncTimer
      init_args: {warmup_steps: 1}
    - class_path: lmtrain.callbacks.NVTXRanges
      init_args: {nvtx: false}
    - class_path: lmtrain.callbacks.MemorySnapshot
      init_args: {start_step: 2}
    - class_path: lmtrain.callbacks.KernelShare
      init_args: {wait: 1, warmup: 1, active: 2, chart: false}
    - class_path: lmtrain.callbacks.PrecisionInspector
      init_args: {step: 1}
    - class_path: loss_recorder.RecordLoss
      init_args: {path: PATH}
"""


def _fit(cwd: Path, devices: int, batch_size: int) -> list[float]:
    cwd.mkdir()
    losses = cwd / "losses.json"
    (cwd / "overlay.yaml").write_text(OVERLAY.replace("PATH", str(losses)))
    env = {**own_job_env(ROOT / "tests"), "CUDA_VISIBLE_DEVICES": ""}
    args = [sys.executable, "-m", "lmtrain", "fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--config",
            "overlay.yaml", "--trainer.accelerator", "cpu", "--trainer.devices", str(devices),
            "--trainer.strategy", "ddp" if devices > 1 else "auto", "--trainer.max_steps", str(STEPS),
            "--data.batch_size", str(batch_size), "--data.max_bytes", "400000", "--model.warmup_steps", "2"]
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(losses.read_text())


@pytest.mark.slow
def test_tiny_config_on_two_ddp_processes_matches_one_process(tmp_path: Path) -> None:
    two = _fit(tmp_path / "ddp", devices=2, batch_size=4)
    one = _fit(tmp_path / "single", devices=1, batch_size=8)
    assert len(two) == len(one) == STEPS
    assert two == pytest.approx(one, rel=0, abs=1e-5), (two, one)
    assert one[-1] < one[0]  # the runs trained
    runs = [p.parent for p in (tmp_path / "ddp").rglob("events.out.tfevents.*")]
    assert len(set(runs)) == 1  # rank 0 alone writes TensorBoard
    scalars = read_scalars(runs[0])
    for tag in ("train/loss", "time/step_ms_slowest", "time/straggler_ratio", "time/slowest_rank",
                "throughput/tokens_per_s", "kernels/communication_ms_step"):
        assert tag in scalars, sorted(scalars)
    assert all(value >= 1.0 for _, value in scalars["time/straggler_ratio"])
    assert {value for _, value in scalars["time/slowest_rank"]} <= {0.0, 1.0}
