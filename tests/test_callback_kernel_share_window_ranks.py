"""KernelShare's window on two ranks (a CPU fit over gloo, DDP) when another callback perturbs a step on rank 1 only:
both ranks move the window to the same steps, so the gather at its end finds every rank, and both report.

The fit runs in its own Python process (this file is also the script: ``python
tests/test_callback_kernel_share_window_ranks.py OUT_DIR``), as in ``tests/test_callback_kernel_share_ranks.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from subprocs import own_job_env

STEPS = 5


def run_fit(out: Path) -> None:
    """Fit the tiny model for STEPS steps on 2 CPU processes; a callback perturbs step 2 on rank 1 only."""
    from datetime import timedelta

    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from lmtrain.callbacks import KernelShare
    from lmtrain.module import LMModule

    class PerturbsOnRankOne(pl.Callback):
        def __init__(self) -> None:
            self.rank = -1

        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            self.rank = trainer.global_rank

        def perturbs_timing(self, step: int) -> bool:
            return self.rank == 1 and step == 2

    data = torch.randint(0, 64, (STEPS * 2 * 2, 17), generator=torch.Generator().manual_seed(0))

    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(data[self.trainer.global_rank::2], batch_size=2, shuffle=False)

    module = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64,
                      warmup_steps=0, fused_adamw=False)
    cb = KernelShare(wait=1, warmup=1, active=1, ranks=[0, 1], chart=False)
    # A short collective timeout: ranks at different gathers fail the run in seconds, not half an hour.
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=20)),
                         precision="32-true", max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         use_distributed_sampler=False, callbacks=[PerturbsOnRankOne(), cb])
    trainer.fit(module, datamodule=Data())
    active = cb._active_steps
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(
        {"steps": trainer.global_step, "window": [cb._window.start_step, cb._window.num_steps],
         "active": None if active is None else [active.start, active.stop], "summary": cb.summary is not None}))


@pytest.mark.slow  # two processes start and join: about 15 s on a 2-core machine
def test_the_ranks_agree_on_a_window_moved_on_one_of_them(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], cwd=tmp_path, env=own_job_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    # window 1-2 would report step 2, which rank 1's callback perturbs: both ranks profile 2-3 and report step 3
    assert ranks == {r: {"steps": STEPS, "window": [2, 2], "active": [3, 4], "summary": True} for r in (0, 1)}
    assert "KernelShare: profiling steps 2-3 instead of steps 1-2 (wait=2, not 1): another rank's callbacks " \
           "perturb the timing of a step it would report." in proc.stderr + proc.stdout


if __name__ == "__main__":
    from lmtrain.distributed import end_process_group

    run_fit(Path(sys.argv[1]))
    end_process_group()
