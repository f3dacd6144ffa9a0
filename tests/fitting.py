"""One short CPU fit of an ``LMModule`` on random ids, for tests: no logger, checkpoints, bar or validation."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
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


def two_rank_cpu_fit(callbacks: list[pl.Callback], steps: int) -> pl.Trainer:
    """Fit a one-block tiny model for ``steps`` steps on 2 CPU processes over gloo (DDP), each rank on its own
    fixed windows of random ids, with ``callbacks``; call it from the script of a test that starts the processes.
    The collective timeout is 20 s: ranks left waiting at different collectives fail the run in seconds."""
    from datetime import timedelta

    import torch
    from lightning.pytorch.strategies import DDPStrategy

    from lmtrain.module import LMModule

    data = torch.randint(0, 64, (steps * 2 * 2, 17), generator=torch.Generator().manual_seed(0))

    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(data[self.trainer.global_rank::2], batch_size=2, shuffle=False)

    module = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64,
                      warmup_steps=0, fused_adamw=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=20)),
                         precision="32-true", max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         use_distributed_sampler=False, callbacks=callbacks)
    trainer.fit(module, datamodule=Data())
    return trainer


def write_rank_result(out: Path, trainer: pl.Trainer, result: dict[str, Any]) -> None:
    """Write one rank's ``result`` to ``out/rank<r>.json`` (read back by :func:`run_rank_script`)."""
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def run_rank_script(script: str, out: Path) -> tuple[subprocess.CompletedProcess, dict[int, dict[str, Any]]]:
    """Run ``python script out`` (a test file that is also the script of a two-rank fit) in a job of its own; return
    the process and each rank's ``rank<r>.json`` that exists."""
    from subprocs import own_job_env

    proc = subprocess.run([sys.executable, script, str(out)], cwd=out, env=own_job_env(), capture_output=True,
                          text=True, timeout=300)
    ranks = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1) if (out / f"rank{r}.json").exists()}
    return proc, ranks
