"""Train a small LM from Python: LMModule, LMDataModule and a Lightning Trainer with lmtrain callbacks.

The data module takes ``vocab_size`` and ``context_length`` from the model (leave them out), checkpoints
go to ``logs/lmtrain/version_N/checkpoints/last.ckpt`` (Ctrl+C or SIGTERM saves one after the current
step), and everything is logged to TensorBoard (``tensorboard --logdir logs``). On a 2-core CPU the
default 60 steps take well under a minute.

    python examples/train_with_callbacks.py              # 60 steps
    python examples/train_with_callbacks.py --steps 5    # a quick check
    python examples/train_with_callbacks.py --resume     # continue the newest run to --steps
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from lmtrain import LMDataModule, LMModule
from lmtrain.callbacks import CudaSyncTimer, MemorySnapshot
from lmtrain.checkpoints import CheckpointOnSignal, find_last_checkpoint, run_version


def main(argv: list[str] | None = None) -> pl.Trainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps in total")
    parser.add_argument("--resume", action="store_true", help="continue the newest run's last.ckpt")
    args = parser.parse_args(argv)

    pl.seed_everything(0)
    model = LMModule(size="tiny", vocab_size=256, context_length=64, lr=3e-3, warmup_steps=10)
    data = LMDataModule(source="text", path="python-stdlib", max_bytes=500_000, batch_size=8,
                        train_batches=200, val_batches=4, test_fraction=0.05)

    ckpt_path = find_last_checkpoint("logs", "lmtrain") if args.resume else None
    # A resumed run goes on writing its own run folder rather than opening a new version_N.
    version = run_version(ckpt_path, "logs", "lmtrain") if ckpt_path else None
    trainer = pl.Trainer(
        max_steps=args.steps,
        precision="32-true",
        logger=TensorBoardLogger("logs", name="lmtrain", version=version, default_hp_metric=False),
        callbacks=[
            CudaSyncTimer(warmup_steps=2, print_summary=False),  # time/*_ms, throughput/* (CUDA events on a GPU)
            MemorySnapshot(start_step=None),  # per-phase memory peaks; no allocation history window
            ModelCheckpoint(save_last=True, save_top_k=0, every_n_train_steps=50),
            CheckpointOnSignal(),
        ],
        log_every_n_steps=5,
        val_check_interval=min(50, args.steps),
        enable_progress_bar=False,
    )
    trainer.fit(model, data, ckpt_path=ckpt_path)
    trainer.test(model, data)
    return trainer


if __name__ == "__main__":
    main()
