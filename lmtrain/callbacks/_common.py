"""Helpers shared by the callbacks: logging text, images and scalars through the trainer's loggers."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn

from lmtrain.analysis.tables import markdown_table  # noqa: F401 (re-exported for the callbacks)
from lmtrain.errors import LmtrainError


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


def check_int(owner: str, name: str, value: Any, minimum: int, allow_none: bool = False,
              fix: str | None = None) -> None:
    """Raise :class:`LmtrainError` for field ``callbacks.<owner>.<name>`` unless ``value`` is an int >= ``minimum``.

    Callbacks call this from ``setup`` (``__init__`` only stores arguments), so a bad option stops the run
    before the first step with a message that names the option.

    Args:
        owner: the callback's class name, e.g. ``MemorySnapshot``.
        name: the argument, e.g. ``num_steps``.
        value: its value.
        minimum: the smallest allowed value.
        allow_none: None is allowed too (and then means what the callback's docstring says).
        fix: the fix to print; by default, the allowed range.
    """
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        default_fix = f"set {name} to a whole number >= {minimum}" + (" (or leave it unset)." if allow_none else ".")
        raise LmtrainError(f"callbacks.{owner}.{name}", f"must be an integer >= {minimum}, got {value!r}.",
                           fix or default_fix)


class StepWindow:
    """A window of training batches, and the count of batches that places each one relative to it.

    Batches are counted from 0 at the start of each fit by the callback itself (``next_batch`` in
    ``on_train_batch_start``), not read from ``trainer.global_step``, which counts optimizer steps (fewer
    under gradient accumulation, none while a manual-optimization step mode never steps) and continues
    from a checkpoint. Create a fresh window in ``setup``, after validating the arguments.

    Args:
        start_step: index of the first batch in the window; None: the window never opens.
        num_steps: batches in the window; None: it never closes.
    """

    def __init__(self, start_step: int | None, num_steps: int | None = 1) -> None:
        self.start_step = start_step
        self.num_steps = num_steps
        self.batches_seen = 0  # training batches started since the fit started

    def next_batch(self) -> int:
        """Count a training batch that starts now; returns its index (0 for the fit's first batch)."""
        index = self.batches_seen
        self.batches_seen += 1
        return index

    def contains(self, index: int) -> bool:
        """Batch ``index`` lies in the window."""
        if self.start_step is None or index < self.start_step:
            return False
        return self.num_steps is None or index < self.start_step + self.num_steps

    def is_first(self, index: int) -> bool:
        """Batch ``index`` opens the window."""
        return self.start_step is not None and index == self.start_step and self.contains(index)

    def is_last(self, index: int) -> bool:
        """Batch ``index`` closes the window (never true for a window without end)."""
        return self.contains(index) and not self.contains(index + 1)
