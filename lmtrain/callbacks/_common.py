"""Helpers shared by the callbacks: logging text, images and scalars through the trainer's loggers."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn


def tensorboard_writers(trainer: pl.Trainer) -> list[Any]:
    """The ``SummaryWriter`` of every TensorBoard logger attached to the trainer."""
    return [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]


def log_scalars(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    """Log scalars to every logger at ``step`` (rank 0 only; outside Lightning's ``self.log`` buffering).

    Used from hooks where ``LightningModule.log`` is not allowed (``on_train_batch_start``, teardown) or
    where the value belongs to an earlier step than the current one (CUDA events read one step late).
    """
    if trainer.global_rank != 0 or not metrics:
        return
    for lg in trainer.loggers:
        lg.log_metrics(metrics, step=step)


def log_text(trainer: pl.Trainer, tag: str, text: str, step: int = 0) -> None:
    """Log Markdown text (TensorBoard's Text tab); other loggers get nothing."""
    if trainer.global_rank != 0:
        return
    for writer in tensorboard_writers(trainer):
        writer.add_text(tag, text, global_step=step)


def log_image(trainer: pl.Trainer, tag: str, image: Any, step: int = 0) -> None:
    """Log an image (a matplotlib figure, or an HxWx3 / HxWx4 uint8 array) to TensorBoard's Images tab."""
    if trainer.global_rank != 0:
        return
    for writer in tensorboard_writers(trainer):
        if isinstance(image, np.ndarray):
            writer.add_image(tag, image, global_step=step, dataformats="HWC")
        else:
            writer.add_figure(tag, image, global_step=step, close=False)


def log_dir(trainer: pl.Trainer) -> str | None:
    """Folder where the first logger writes (where callbacks put their files), or the trainer's root."""
    return trainer.log_dir or trainer.default_root_dir


class WarnOnce:
    """Emit each distinct message once per instance (callbacks must not warn every step)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __call__(self, message: str) -> None:
        if message not in self._seen:
            self._seen.add(message)
            rank_zero_warn(message)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table (TensorBoard renders it in the Text tab; terminals print it readably)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)
