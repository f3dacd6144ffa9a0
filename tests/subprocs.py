"""Environment for tests that start lmtrain in a process of its own (multi-process fits, the CLI)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def own_job_env(*extra_paths: Path) -> dict[str, str]:
    """This process's environment with the repository (and ``extra_paths``) first on ``PYTHONPATH`` and no
    distributed variables: the child starts a run of its own, not a rank of some outer job."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *map(str, extra_paths),
                                                       os.environ.get("PYTHONPATH", "")]))
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        env.pop(name, None)
    return env
