"""StepEvents: a ``bench model`` cell's own clock around every measured step, and every step's loss.

A Lightning cell is timed by ``lmtrain.callbacks.CudaSyncTimer``. This callback checks that timer with code that
shares nothing with ``lmtrain.callbacks``: it records a CUDA event (``torch.cuda.Event(enable_timing=True)`` on
the current stream, through ``lmtrain.bench.clock``; ``time.perf_counter`` without CUDA) at
``on_train_batch_start`` and ``on_train_batch_end`` of each step after the warm-up, never waits for the GPU
during training, and reads all events after one synchronisation at the end. It gives:

    events_step_ms_mean   mean of the steps' start-to-end times
    pipeline_step_ms      first measured step's start to last measured step's end, over the measured steps: the
                          rate steps come out at, gaps between steps (data, logging, host waits) included
    timer_vs_events_pct   100 * (timer's mean step - events_step_ms_mean) / events_step_ms_mean

It also keeps a copy of the loss each step returns to Lightning (``outputs["loss"]``), on the device (reading it
every step would make the host wait for the GPU), and converts them all once at the end: ``losses``, one float
per step, warm-up included; None when the steps return no loss (step mode ``forward``).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lmtrain.bench.clock import Clock


class StepEvents(pl.Callback):
    """Time marks around the measured steps and the loss of every step (see the module docstring).

    Args:
        warmup: first steps left untimed (their losses are kept).
        clock: CUDA events or the host clock.
    """

    def __init__(self, warmup: int, clock: Clock) -> None:
        self.warmup = warmup
        self.clock = clock
        self.starts: list[Any] = []
        self.ends: list[Any] = []
        self.losses: list[torch.Tensor] = []
        self._batches = 0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._batches >= self.warmup:
            self.starts.append(self.clock.mark())

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._batches >= self.warmup:
            self.ends.append(self.clock.mark())
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
        if isinstance(loss, torch.Tensor):
            # A copy, after the end mark: a step replayed from a CUDA graph may return the same tensor every step.
            self.losses.append(loss.detach().clone())
        self._batches += 1

    def columns(self, timer_step_ms: float | None) -> dict[str, Any]:
        """The row columns of the module docstring, after one synchronisation; ``timer_step_ms``: the timer's mean."""
        row: dict[str, Any] = {"losses": torch.stack(self.losses).float().tolist() if self.losses else None}
        steps = self.clock.intervals_ms(self.starts, self.ends)
        if not steps:
            return row
        mean = statistics.fmean(steps)
        row["events_step_ms_mean"] = mean
        row["pipeline_step_ms"] = self.clock.ms(self.starts[0], self.ends[len(steps) - 1]) / len(steps)
        if timer_step_ms and mean > 0:
            row["timer_vs_events_pct"] = 100.0 * (timer_step_ms - mean) / mean
        return row
