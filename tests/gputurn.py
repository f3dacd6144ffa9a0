"""Turns on the GPU for test processes: many share it, one that must be alone waits for it and keeps it."""

from __future__ import annotations

import fcntl
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: Lock files shared by the test processes of one machine (pytest-xdist's workers): GPU tests hold ``LOCK`` shared, a
#: test that must be alone holds it exclusively; ``TURNSTILE`` keeps new sharers out while an exclusive one waits
#: (without it a steady stream of sharers could keep the exclusive one waiting until the end of the run).
LOCK = Path(tempfile.gettempdir()) / "lmtrain-tests-gpu.lock"
TURNSTILE = Path(tempfile.gettempdir()) / "lmtrain-tests-gpu-turnstile.lock"


@contextmanager
def gpu_turn(alone: bool, lock: Path = LOCK, turnstile: Path = TURNSTILE) -> Iterator[None]:
    """Hold the GPU shared, or alone when ``alone``, for the ``with`` block."""
    with open(turnstile, "a") as gate, open(lock, "a") as held:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(held, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
