"""KernelShare's window on two ranks (a CPU fit over gloo, DDP) when another callback perturbs a step on rank 1 only:
both ranks move the window to the same steps, so the gather at its end finds every rank, and both report.

The fit runs in its own Python process (this file is also the script: ``python
tests/test_callback_kernel_share_window_ranks.py OUT_DIR``), as in ``tests/test_callback_kernel_share_ranks.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fitting import run_rank_script

STEPS = 5


def run_fit(out: Path) -> None:
    """Fit the tiny model for STEPS steps on 2 CPU processes; a callback perturbs step 2 on rank 1 only."""
    import lightning.pytorch as pl
    from fitting import two_rank_cpu_fit, write_rank_result

    from lmtrain.callbacks import KernelShare

    class PerturbsOnRankOne(pl.Callback):
        def __init__(self) -> None:
            self.rank = -1

        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            self.rank = trainer.global_rank

        def perturbs_timing(self, step: int) -> bool:
            return self.rank == 1 and step == 2

    cb = KernelShare(wait=1, warmup=1, active=1, ranks=[0, 1], chart=False)
    trainer = two_rank_cpu_fit([PerturbsOnRankOne(), cb], STEPS)
    active = cb._active_steps
    write_rank_result(out, trainer, {"steps": trainer.global_step, "window": [cb._window.start_step,
                                                                             cb._window.num_steps],
                                     "active": None if active is None else [active.start, active.stop],
                                     "summary": cb.summary is not None})


@pytest.mark.slow  # two processes start and join: about 15 s on a 2-core machine
def test_the_ranks_agree_on_a_window_moved_on_one_of_them(tmp_path: Path) -> None:
    proc, ranks = run_rank_script(__file__, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # window 1-2 would report step 2, which rank 1's callback perturbs: both ranks profile 2-3 and report step 3
    assert ranks == {r: {"steps": STEPS, "window": [2, 2], "active": [3, 4], "summary": True} for r in (0, 1)}
    assert "KernelShare: profiling steps 2-3 instead of steps 1-2 (wait=2, not 1): another rank's callbacks " \
           "perturb the timing of a step it would report." in proc.stderr + proc.stdout


if __name__ == "__main__":
    from lmtrain.distributed import end_process_group

    run_fit(Path(sys.argv[1]))
    end_process_group()
