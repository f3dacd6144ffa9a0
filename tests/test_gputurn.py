"""GPU turns: a test that must be alone waits for the sharers, and sharers wait for it."""

from __future__ import annotations

import threading
from pathlib import Path

from gputurn import gpu_turn


def _enter(alone: bool, tmp: Path, log: list[str], name: str, leave: threading.Event) -> threading.Thread:
    def body() -> None:
        with gpu_turn(alone, tmp / "lock", tmp / "gate"):
            log.append(f"{name} in")
            leave.wait(10)
            log.append(f"{name} out")

    thread = threading.Thread(target=body)
    thread.start()
    return thread


def _wait_for(log: list[str], entry: str) -> None:
    for _ in range(1000):
        if entry in log:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"{entry!r} never logged: {log}")


def test_sharers_overlap_and_the_alone_one_waits_for_them(tmp_path: Path) -> None:
    log: list[str] = []
    leave_a, leave_b, leave_x, leave_c = (threading.Event() for _ in range(4))
    a = _enter(False, tmp_path, log, "a", leave_a)
    b = _enter(False, tmp_path, log, "b", leave_b)
    _wait_for(log, "a in")
    _wait_for(log, "b in")  # two sharers at once
    x = _enter(True, tmp_path, log, "x", leave_x)
    threading.Event().wait(0.2)
    c = _enter(False, tmp_path, log, "c", leave_c)  # arrives while x waits: must not pass x
    threading.Event().wait(0.2)
    assert "x in" not in log and "c in" not in log, log
    leave_a.set()
    leave_b.set()
    _wait_for(log, "x in")
    threading.Event().wait(0.2)
    assert "c in" not in log, log  # x is alone
    leave_x.set()
    _wait_for(log, "c in")
    leave_c.set()
    for t in (a, b, x, c):
        t.join(10)
    assert log.index("x in") > max(log.index("a out"), log.index("b out"))
    assert log.index("c in") > log.index("x out")
