"""The one exception type lmtrain raises for bad configuration, bad data or impossible requests.

The command line catches it and prints its message alone (no traceback), so every message names the
field at fault and says how to fix it.
"""

from __future__ import annotations


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
