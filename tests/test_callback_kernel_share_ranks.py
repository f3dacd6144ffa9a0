"""KernelShare on two ranks (a CPU fit over gloo, DDP) when the analysis fails on the profiling rank: every rank still
reaches the gather of the results, so the run ends instead of hanging.

The fit runs in its own Python process (this file is also the script: ``python tests/test_callback_kernel_share_ranks.py
OUT_DIR``), as in ``tests/test_callbacks_ranks.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fitting import run_rank_script

STEPS = 4


def run_fit(out: Path) -> None:
    """Fit the tiny model for STEPS steps on 2 CPU processes; KernelShare profiles rank 1, whose analysis raises."""
    from fitting import two_rank_cpu_fit, write_rank_result

    from lmtrain.callbacks import KernelShare

    class FailingOnRankOne(KernelShare):
        def __init__(self, **kwargs: object) -> None:
            super().__init__(**kwargs)
            self.reported: list[object] = []

        def _analyze(self, trainer, pl_module, path):  # noqa: ANN001, ANN202
            raise RuntimeError(f"broken trace on rank {trainer.global_rank}")

        def _report(self, trainer, found):  # noqa: ANN001, ANN202
            self.reported.append(found)
            super()._report(trainer, found)

    cb = FailingOnRankOne(wait=1, warmup=0, active=1, ranks=[1], chart=False)
    trainer = two_rank_cpu_fit([cb], STEPS)
    write_rank_result(out, trainer, {"steps": trainer.global_step, "reported": cb.reported,
                                     "summary": cb.summary is not None})


@pytest.mark.slow  # two processes start and join: about 15 s on a 2-core machine
def test_a_failed_analysis_on_the_profiling_rank_leaves_no_rank_waiting(tmp_path: Path) -> None:
    proc, ranks = run_rank_script(__file__, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # both ranks ran every step and reached _report once (rank 0, not profiling, with nothing of its own)
    assert ranks == {r: {"steps": STEPS, "reported": [None], "summary": False} for r in (0, 1)}
    assert proc.stderr.count("KernelShare: rank 1: the profiled window could not be analysed (RuntimeError: "
                             "broken trace on rank 1); this rank reports nothing.") == 1


if __name__ == "__main__":
    from lmtrain.distributed import end_process_group

    run_fit(Path(sys.argv[1]))
    end_process_group()
