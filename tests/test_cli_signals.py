"""Exit status of ``fit``/``validate``/``test`` stopped by a signal: 128 + its number, also without checkpointing.

The run sends itself the signal from a callback at a fixed batch (a deterministic preemption). The fast tests run
the command line in this process and read the status ``main`` returns; the slow ones start ``python -m lmtrain`` in
a process of its own and read its exit status.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
from subprocs import own_job_env

from lmtrain.cli import main

ROOT = Path(__file__).resolve().parents[1]

def synthetic_config(max_steps: int, val_check_interval: int, checkpointing: bool) -> str:
    """A fit config of a model of a few thousand parameters on synthetic ids: seconds on a CPU. Without
    checkpointing as the medium-and-larger and fast configs have it; with it, last.ckpt at the end of training."""
    return f"""\
seed_everything: 0
model: {{size: tiny, vocab_size: 64, context_length: 16, d_model: 32, num_layers: 1, num_heads: 2, d_ff: 64}}
data: {{source: synthetic, batch_size: 2, train_batches: 40, val_batches: 20}}
trainer:
  accelerator: cpu
  max_steps: {max_steps}
  val_check_interval: {val_check_interval}
  enable_checkpointing: {str(checkpointing).lower()}
  num_sanity_val_steps: 0
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
"""


class SignalAtBatch(pl.Callback):
    """Sends this process ``signum`` at the end of batch ``batch`` of training, validation or test (``stage``),
    ``times`` times (2: a second Ctrl+C before the step ends)."""

    def __init__(self, stage: str = "train", batch: int = 3, signum: int = int(signal.SIGTERM), times: int = 1) -> None:
        self.stage, self.batch, self.signum, self.times = stage, batch, signum, times

    def _maybe(self, batch_idx: int) -> None:
        if batch_idx == self.batch:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if self.stage == "train":
            self._maybe(batch_idx)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:  # noqa: ANN001
        if self.stage == "validate":
            self._maybe(batch_idx)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:  # noqa: ANN001
        if self.stage == "test":
            self._maybe(batch_idx)


def _args(tmp_path: Path, command: str, stage: str, signum: int, times: int = 1) -> list[str]:
    config = tmp_path / "no_checkpoints.yaml"
    config.write_text(synthetic_config(40, 40, checkpointing=False))
    return [command, "--config", str(config), "--trainer.callbacks+=test_cli_signals.SignalAtBatch",
            "--trainer.callbacks.stage", stage, "--trainer.callbacks.signum", str(int(signum)),
            "--trainer.callbacks.times", str(times)]


def stopped_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                       command: str, stage: str, signum: int, times: int = 1) -> tuple[int, str]:
    """``main``'s exit status and the log lines of a run stopped by ``signum``; the handlers are back afterwards."""
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    status = main(_args(tmp_path, command, stage, signum, times))
    assert {s: signal.getsignal(s) for s in before} == before
    return status, "\n".join(r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_fit_without_checkpointing_stopped_by_a_signal(signum: int, status: int, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    code, log = stopped_in_process(tmp_path, monkeypatch, caplog, "fit", "train", signum)
    assert code == status
    assert f"{signal.Signals(signum).name} received: stopping after the current step" in log
    assert not list(tmp_path.rglob("*.ckpt"))  # checkpointing is off: nothing saved


def test_second_ctrl_c_stops_at_once_with_130(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    code, log = stopped_in_process(tmp_path, monkeypatch, caplog, "fit", "train", signal.SIGINT, times=2)
    assert code == 130
    assert "Detected KeyboardInterrupt" in log  # the second one: Lightning's stop at once, SystemExit(1)


@pytest.mark.parametrize("command", ["validate", "test"])
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_evaluation_stopped_by_a_signal(command: str, signum: int, status: int, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    code, log = stopped_in_process(tmp_path, monkeypatch, caplog, command, command, signum)
    assert code == status
    assert f"{signal.Signals(signum).name} received: stopping the evaluation now" in log


@pytest.mark.slow
@pytest.mark.parametrize(("command", "signum", "status"), [("fit", signal.SIGTERM, 143),
                                                           ("validate", signal.SIGINT, 130)])
def test_exit_status_of_the_process(command: str, signum: int, status: int, tmp_path: Path) -> None:
    stage = "train" if command == "fit" else command
    env = {**own_job_env(ROOT / "tests"), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-m", "lmtrain", *_args(tmp_path, command, stage, signum)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == status, result.stderr
