"""The tiny model learns real text: validation loss on held-out standard-library source falls well below its start."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch

from lmtrain.data import LMDataModule
from lmtrain.module import LMModule


def test_tiny_model_learns_python_source() -> None:
    pl.seed_everything(0, verbose=False)
    module = LMModule(size="tiny", vocab_size=256, context_length=64, lr=3e-3, warmup_steps=10)
    data = LMDataModule(source="text", path="python-stdlib", max_bytes=300_000, batch_size=16,
                        context_length=64, vocab_size=256, train_batches=60, val_batches=8)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=60, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         inference_mode=False)  # validate before fit: metric states must stay normal tensors
    (start,) = trainer.validate(module, data, verbose=False)
    # Untrained logits are near zero: the loss starts at about ln(256) = 5.55 nats per byte.
    assert abs(start["val/loss"] - math.log(256)) < 0.2
    trainer.fit(module, data)
    (end,) = trainer.validate(module, data, verbose=False)
    assert end["val/loss"] < 3.5
    assert end["val/perplexity"] == torch.exp(torch.tensor(end["val/loss"])).item()
