"""One short CPU fit of an ``LMModule`` on random ids, for tests: no logger, checkpoints, bar or validation."""

from __future__ import annotations

import tempfile
from typing import Any

import lightning.pytorch as pl

from lmtrain.data import LMDataModule


def cpu_fit(module: pl.LightningModule, steps: int, *, batch: int, context: int, vocab: int,
            callbacks: list[pl.Callback] | None = None, ckpt_path: str | None = None,
            **trainer_kwargs: Any) -> pl.Trainer:
    """Fit ``module`` for ``steps`` optimizer steps on synthetic windows (resuming from ``ckpt_path`` if given);
    returns the trainer. Files the callbacks write go to ``default_root_dir`` if given, else to a temporary folder
    removed after the fit (never the working directory)."""
    data = LMDataModule(batch_size=batch, context_length=context, vocab_size=vocab, train_batches=50, val_batches=1)
    with tempfile.TemporaryDirectory(prefix="lmtrain-fit-") as root:
        trainer = pl.Trainer(**{
            "accelerator": "cpu", "devices": 1, "max_steps": steps, "logger": False, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False, "limit_val_batches": 0,
            "default_root_dir": root, "callbacks": callbacks or [], **trainer_kwargs,
        })
        trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer
