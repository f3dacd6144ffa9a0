"""The one exception type lmtrain raises for bad configuration, bad data or impossible requests.

The command line catches it and prints its message alone (no traceback), so every message names the
field at fault and says how to fix it.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path


class LmtrainError(ValueError):
    """A user-facing error: bad configuration, bad data, or a request this machine cannot serve.

    Args:
        field: the configuration field at fault, e.g. ``"model.num_heads"`` or ``"data.path"``.
        problem: what is wrong, in one sentence.
        fix: what to do about it, in one sentence.
    """

    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem} Fix: {fix}")


def check_writable_folder(field: str, folder: str | os.PathLike) -> None:
    """Stop, before anything is written, when ``folder`` could not be created or written to.

    The first part of the path that exists decides: it must be a folder that this user may write into.

    Args:
        field: the option that names the folder, e.g. ``"trainer.logger.init_args.save_dir"``.
        folder: the folder, which may not exist yet.

    Raises:
        LmtrainError: a part of the path is a file, or the nearest existing folder is not writable.
    """
    path = Path(folder)
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise LmtrainError(field, f"{existing} is a file, so the folder {path} cannot be created.",
                           "give a folder path whose parts are folders (or do not exist yet).")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise LmtrainError(field, f"the folder {existing} is not writable, so {path} cannot be written.",
                           "give a folder you can write to, or change its permissions.")


def positive_number(text: str) -> float:
    """An argparse type: a finite number above 0 (NaN, infinity and what is no number are usage errors)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value
