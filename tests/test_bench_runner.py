"""lmtrain.bench.runner with several ranks per child: where the further ranks write, and what is left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lmtrain.bench import runner


def test_further_local_ranks_write_beside_rank_zeros_result(tmp_path, monkeypatch):
    result = tmp_path / "cell.json"
    monkeypatch.setenv("LOCAL_RANK", "1")
    runner.child_main("os:getcwd", {}, str(result))  # any target: here one that takes the payload and fails
    assert not result.exists()
    written = json.loads(Path(runner.rank_result_path(result, 1)).read_text())
    assert written["status"] == "error" and "getcwd" in written["error"]
    monkeypatch.setenv("LOCAL_RANK", "0")
    runner.child_main("json:dumps", {"a": 1}, str(result))
    assert json.loads(result.read_text()) == {"status": "ok", "result": '{"a": 1}', "pid": os.getpid()}


def test_group_of_a_several_rank_child_is_stopped_once_rank_zero_has_ended(tmp_path):
    """A process that rank 0 started (as Lightning starts rank 1) and that never writes its result is killed
    after the wait, so that the next child starts on free devices."""
    marker = tmp_path / "orphan.pid"
    script = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
              f"open({str(marker)!r}, 'w').write(str(p.pid))")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    proc.wait(30)
    orphan = int(marker.read_text())
    os.kill(orphan, 0)  # still running
    start = time.perf_counter()
    runner._wait_for_ranks(tmp_path / "cell.json", 2, proc, wait_s=0.5)
    assert time.perf_counter() - start < 10
    for _ in range(50):
        if not _alive(orphan):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the rank that never wrote its result is still running")


def _alive(pid: int) -> bool:
    """Running, and not a zombie left for an init process that does not reap (as in some containers)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.is_file() and stat.read_text().rsplit(")", 1)[-1].split()[0] == "Z")
