"""A test-only callback: the rank-averaged training loss of every step, written to a JSON file by rank 0."""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl


class RecordLoss(pl.Callback):
    """Appends mean-over-ranks of each step's loss; rank 0 writes the list to ``path`` when training ends."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Equal per-rank batches: the mean of the ranks' mean losses is the global batch's mean loss.
        loss = trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")
        self.losses.append(float(loss))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            with open(self.path, "w") as f:
                json.dump(self.losses, f)
