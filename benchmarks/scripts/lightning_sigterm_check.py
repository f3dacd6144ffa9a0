"""A callback that puts back Lightning's per-step SIGTERM broadcast, for measuring what skipping it buys.

``lmtrain.checkpoints.CheckpointOnSignal`` skips Lightning's ``_broadcast_sigterm_tensor`` on several ranks (one
NCCL broadcast and a host wait for the GPU at the start of every training step). Adding this callback to a fit
restores Lightning's check from the second step on, so that one benchmark can time both in the same run:

    PYTHONPATH=benchmarks/scripts python -m lmtrain fit ... \\
        --trainer.callbacks+=lightning_sigterm_check.LightningSigtermCheck

Not part of the library: lmtrain has no option to bring the per-step host wait back.
"""

from __future__ import annotations

import lightning.pytorch as pl


class LightningSigtermCheck(pl.Callback):
    """At each training batch's start, removes the training loop's stand-in for the SIGTERM broadcast, so that
    the next steps run Lightning's own check (the class's method) again."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object,
                             batch_idx: int) -> None:
        trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)
