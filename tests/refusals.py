"""Bad input stops ``python -m lmtrain`` with one line: exit 2, one ``error: FIELD: ... Fix: ...`` line and nothing else
on stderr, nothing written (shared by the tests)."""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from lmtrain.cli import main


def refused(args: list[str], field: str, capsys: pytest.CaptureFixture, where: Path) -> str:
    """Run ``python -m lmtrain ARGS`` in-process: exit 2, one ``error: FIELD: ... Fix: ...`` line and nothing else on
    stderr (no log line, no warning), nothing written."""
    before = sorted(where.rglob("*"))
    line = one_line_error(lambda: main(args), capsys)
    assert re.fullmatch(rf"error: {re.escape(field)}: .+ Fix: .+", line), line
    assert sorted(where.rglob("*")) == before  # no logs/, no version_N
    return line


def one_line_error(run: Callable[[], int], capsys: pytest.CaptureFixture) -> str:
    """``run()`` returns 2 and its whole stderr is one ``error:`` line: also no log record at INFO or above (which
    pytest's log capture takes from stderr) and no warning, which a real run would print there too."""
    capsys.readouterr()
    handler = _Records()
    root = logging.getLogger()
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.filterwarnings("ignore", category=category)  # as Python's default filters outside __main__
            status = run()
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    err = capsys.readouterr().err
    assert status == 2, err
    assert [r.getMessage() for r in handler.records] == [], "log lines before the error"
    assert [str(w.message) for w in caught] == [], "warnings before the error"
    assert len(err.splitlines()) == 1 and err.startswith("error:"), err
    return err.rstrip("\n")


class _Records(logging.Handler):
    """Keeps every record it is given."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
