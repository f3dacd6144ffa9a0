"""``validate``/``test`` of a checkpoint: their scalars land on the fit's curves at the checkpoint's step, and
without ``--config`` they evaluate the checkpoint's own model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from tb import scalars
from test_cli_signals import synthetic_config

from lmtrain.cli import main


@pytest.fixture
def fitted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A 6-step fit in ``tmp_path`` (logs/lmtrain/version_0, last.ckpt at step 6); returns the run folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fit.yaml").write_text(synthetic_config(6, 6, checkpointing=True))
    assert main(["fit", "--config", "fit.yaml"]) == 0
    run = tmp_path / "logs" / "lmtrain" / "version_0"
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6
    return run


def test_validate_logs_on_the_fits_curve(fitted: Path) -> None:
    """The fit validated the same weights after its 6th step; validate of last.ckpt puts its point on that one (the
    step at which Lightning logged everything of the 6th step, 5), not at step 0."""
    (fit_step, fit_loss), = scalars(fitted)["val/loss"]
    assert fit_step == 5 == scalars(fitted)["train/loss"][-1][0]
    assert main(["validate", "--config", "fit.yaml", "--ckpt_path", "last"]) == 0
    (step, loss), = scalars(fitted)["val/loss"][1:]
    assert step == fit_step and loss == pytest.approx(fit_loss, rel=1e-5)
    assert sorted(p.name for p in fitted.parent.iterdir()) == ["version_0"]


def test_test_logs_at_the_checkpoints_step(fitted: Path) -> None:
    assert main(["test", "--config", "fit.yaml", "--ckpt_path", "last"]) == 0
    assert [step for step, _ in scalars(fitted)["test/loss"]] == [5]


def test_validate_without_config_runs_the_checkpoints_model(fitted: Path) -> None:
    """No --config: the model (1 layer of width 32) and the data come from the checkpoint, not the defaults (the
    small model): the loss is the fit's own of the same weights."""
    (_, fit_loss), = scalars(fitted)["val/loss"]
    assert main(["validate", "--ckpt_path", "last", "--trainer.accelerator", "cpu",
                 "--trainer.enable_progress_bar", "false"]) == 0
    (step, loss), = scalars(fitted)["val/loss"][1:]
    assert step == 5 and loss == pytest.approx(fit_loss, rel=1e-5)
    saved = yaml.safe_load((fitted / "validate_config.yaml").read_text())
    assert (saved["model"]["d_model"], saved["model"]["num_layers"], saved["model"]["vocab_size"]) == (32, 1, 64)
    assert (saved["data"]["source"], saved["data"]["val_batches"]) == ("synthetic", 20)
