"""The benchmark runner: one isolated child process per sweep cell or compared setting.

Every benchmark that runs several cells or settings runs each in its own process, so that an out-of-memory
error, a crash or a hang stays in that process, and no cell's allocator state, compiled graphs or clock
drift reaches the next (run one after another in one process, later settings ran measurably slower than
earlier ones). :func:`run_child` calls ``target(payload)`` (``"module:function"``, returning a JSON-able dict)
in a child and returns a :class:`ChildResult`:

    ok        the target returned (or called :func:`exit_with_result`)
    OOM       it raised an out-of-memory error (or died printing one)
    error     it raised anything else, or the process ended without a result (signal, ``os._exit``)
    timeout   it ran past ``timeout`` seconds and was killed

Launchers: ``fork`` forks this process (which must not have touched CUDA; it then falls back to ``spawn``)
and starts in well under a second; ``spawn`` starts ``python -m lmtrain.bench.runner`` (a fresh interpreter:
seconds of imports). A child's stdout and stderr go to a log file. Ctrl-C while a child runs kills the child
and propagates ``KeyboardInterrupt`` to the command, which keeps what it has written.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LAUNCHERS = ("fork", "spawn")
#: Lines of a failed child's log echoed to stderr.
_TAIL_LINES = 20
#: Where the running child writes its result (set in the child only).
_RESULT_PATH: str | None = None


@dataclass
class ChildResult:
    """What one child process left behind."""

    name: str  # the cell or setting
    status: str  # ok | OOM | error | timeout
    result: dict[str, Any] | None  # what the target returned (None unless ok)
    pid: int | None  # the child's process id as it reported it (None unless ok)
    returncode: int | None  # None after a timeout
    error: str  # one line: why there is no result ("" when ok)
    seconds: float  # wall time of the child, start-up included
    log_path: Path | None = None


def is_oom(exc: BaseException) -> bool:
    """Whether an exception is an out-of-memory error (PyTorch's, or a library's message saying so)."""
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def cuda_initialised() -> bool:
    """Whether CUDA was initialised in this process (a forked child must never inherit a CUDA context)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


# -- the child ------------------------------------------------------------------------------------------------


def _write(path: str, payload: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, default=str)
    os.replace(tmp, path)


def exit_with_result(result: dict[str, Any]) -> None:
    """In a child: write ``result`` and end the process at once (status 0), skipping any teardown.

    A sweep cell calls this at the end of its last step: Lightning's teardown would copy a 2.7B model and its
    AdamW state back to the host (tens of seconds) that the table does not need; the GPU memory goes with
    the process.
    """
    if _RESULT_PATH is None:
        raise RuntimeError("exit_with_result is for child processes of lmtrain.bench.runner")
    _write(_RESULT_PATH, {"status": "ok", "result": result, "pid": os.getpid()})
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _resolve(target: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def rank_result_path(result_path: str | Path, local_rank: int) -> str:
    """Where the process of local rank ``local_rank`` > 0 of a multi-GPU child writes its result."""
    return f"{result_path}.rank{local_rank}"


def child_main(target: str, payload: dict[str, Any], result_path: str) -> None:
    """Run ``target(payload)`` and write its result, or its failure, to ``result_path`` as JSON.

    A target that trains on several devices of this node starts their processes through Lightning, which
    re-runs this command once per further device with ``LOCAL_RANK`` set: those processes write to
    ``rank_result_path`` instead, so the result file is rank 0's and the parent can wait for the others.
    """
    global _RESULT_PATH
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if local_rank > 0:
        result_path = rank_result_path(result_path, local_rank)
    _RESULT_PATH = result_path
    try:
        result = _resolve(target)(payload)
        record = {"status": "ok", "result": result, "pid": os.getpid()}
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row; SystemExit ends the process as asked
        first = (str(exc).strip().splitlines() or [""])[0]
        traceback.print_exc()
        if is_oom(exc):
            record = {"status": "OOM", "error": first[:300]}
        else:
            record = {"status": "error", "error": f"{type(exc).__name__}: {first}"[:300]}
    _write(result_path, record)


def _forked_main(target: str, payload: dict[str, Any], result_path: str, log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    child_main(target, payload, result_path)
    sys.stdout.flush()
    sys.stderr.flush()


# -- the parent -----------------------------------------------------------------------------------------------


def _child_env() -> dict[str, str]:
    # A spawned child must import the same lmtrain as this process, wherever it was started from.
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _why(returncode: int, log_text: str) -> tuple[str, str]:
    """(status, one line) for a child that ended without a result: its signal, or its output's last line."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    last = lines[-1][:300] if lines else "no output"
    if returncode < 0:
        return "error", f"killed by signal {-returncode}: {last}"
    status = "OOM" if "OutOfMemoryError" in log_text or "out of memory" in last.lower() else "error"
    return status, f"process exited with status {returncode}: {last}"


def _wait_for_ranks(result_path: Path, ranks: int, proc: subprocess.Popen, wait_s: float) -> None:
    """After rank 0's process has ended: wait up to ``wait_s`` for the other local ranks' result files (they
    write them as they finish), then stop whatever is left of the child's process group, so that the next
    child starts on free devices."""
    deadline = time.perf_counter() + wait_s
    pending = [Path(rank_result_path(result_path, r)) for r in range(1, ranks)]
    while pending and time.perf_counter() < deadline:
        pending = [p for p in pending if not p.is_file()]
        if pending:
            time.sleep(0.2)
    time.sleep(0.5 if not pending else 0.0)  # a rank that wrote its file is leaving: let it go on its own
    _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the child's process group (the child and the processes it started for further devices)."""
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass


def run_child(name: str, target: str, payload: dict[str, Any], work_dir: Path, *, timeout: float | None = None,
              launcher: str = "fork", ranks: int = 1, rank_wait_s: float = 120.0) -> ChildResult:
    """Run ``target(payload)`` in a child process and return what became of it.

    Args:
        name: the cell or setting (file names and messages).
        target: ``"module:function"``; the function takes the payload and returns a JSON-able dict.
        payload: JSON-able arguments of the target.
        work_dir: folder for the child's result and log files (``<name>.json``, ``<name>.log``).
        timeout: seconds before the child is killed and recorded as ``timeout`` (None or <= 0: no limit).
        launcher: ``fork`` (falls back to ``spawn`` once CUDA is initialised here) or ``spawn``.
        ranks: processes the target trains on (Lightning starts ranks 1.. by re-running the child's command, so
            more than one needs ``spawn``). The child gets its own process group; once rank 0 has ended, the
            others have ``rank_wait_s`` seconds to write their results before the group is killed, and a timeout
            kills the whole group.
    """
    if launcher == "fork" and (cuda_initialised() or ranks > 1):
        launcher = "spawn"
    work_dir.mkdir(parents=True, exist_ok=True)
    slug = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in name)
    result_path, log_path = work_dir / f"{slug}.json", work_dir / f"{slug}.log"
    result_path.unlink(missing_ok=True)
    for r in range(1, ranks):
        Path(rank_result_path(result_path, r)).unlink(missing_ok=True)
    limit = timeout if timeout and timeout > 0 else None
    start = time.perf_counter()
    returncode: int | None
    if launcher == "fork":
        import multiprocessing

        proc = multiprocessing.get_context("fork").Process(
            target=_forked_main, args=(target, payload, str(result_path), str(log_path)), daemon=False)
        proc.start()
        try:
            proc.join(limit)
        except KeyboardInterrupt:
            proc.kill()
            proc.join()
            raise
        if proc.is_alive():
            proc.kill()
            proc.join()
            returncode = None
        else:
            returncode = proc.exitcode
    elif launcher == "spawn":
        payload_path = work_dir / f"{slug}.payload.json"
        payload_path.write_text(json.dumps(payload, default=str))
        cmd = [sys.executable, "-m", "lmtrain.bench.runner", target, str(payload_path), str(result_path)]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=_child_env(), start_new_session=ranks > 1)

            def stop() -> None:
                if ranks > 1:
                    _kill_group(proc)  # with the further ranks the child started
                proc.kill()
                proc.wait()

            try:
                returncode = proc.wait(limit)
            except subprocess.TimeoutExpired:
                stop()
                returncode = None
            except KeyboardInterrupt:
                stop()
                raise
            if ranks > 1 and returncode is not None:
                _wait_for_ranks(result_path, ranks, proc, rank_wait_s if returncode == 0 else 0.0)
    else:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
    seconds = time.perf_counter() - start
    record = json.loads(result_path.read_text()) if result_path.is_file() else None
    if returncode is None:
        return ChildResult(name, "timeout", None, None, None, f"no result within --timeout {timeout:g} s", seconds,
                           log_path)
    if record is not None:
        status = record.get("status", "error")
        return ChildResult(name, status, record.get("result") if status == "ok" else None, record.get("pid"),
                           returncode, record.get("error", ""), seconds, log_path)
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    status, why = _why(returncode, text)
    return ChildResult(name, status, None, None, returncode, why, seconds, log_path)


def log_tail(result: ChildResult, lines: int = _TAIL_LINES) -> str:
    """The last lines of a child's output."""
    if result.log_path is None or not result.log_path.is_file():
        return ""
    return "\n".join(result.log_path.read_text(errors="replace").splitlines()[-lines:])


# -- compared settings (bench callbacks, bench overhead) ------------------------------------------------------


def add_isolation_arguments(parser: argparse.ArgumentParser, default_timeout: float = 1200.0) -> None:
    """``--isolate/--no-isolate`` and ``--timeout`` of a command that compares settings."""
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                        help="run each setting in a fresh Python process (default); --no-isolate runs them all in "
                             "this process, one after another (quicker to start; later settings may run slower)")
    parser.add_argument("--timeout", type=float, default=default_timeout,
                        help=f"seconds a setting's process may take before it is stopped and recorded as timeout "
                             f"(default {default_timeout:g}; with --isolate)")


def args_payload(args: argparse.Namespace) -> dict[str, Any]:
    """A command's arguments as JSON-able values (paths as strings), for a child to rebuild with ``Namespace``."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def run_settings(command: str, target: str, settings: Sequence[str], payload: dict[str, Any],
                 timeout: float | None, ranks: int = 1) -> Iterator[ChildResult]:
    """Run ``target({**payload, "setting": S})`` for each setting S in a fresh interpreter, one after another
    (``ranks``: see :func:`run_child`).

    Yields each setting's result as soon as it is known (a caller keeps them as they come, so Ctrl-C loses
    nothing already measured). A failed child's last lines of output are echoed to stderr.
    """
    tag = f"[bench {command}]"
    with tempfile.TemporaryDirectory(prefix=f"lmtrain-bench-{command}-") as work:
        for i, setting in enumerate(settings):
            print(f"{tag} {setting}: fresh process ({i + 1}/{len(settings)})", file=sys.stderr, flush=True)
            result = run_child(f"{i}_{setting}", target, {**payload, "setting": setting}, Path(work),
                               timeout=timeout, launcher="spawn", ranks=ranks)
            result.name = setting
            if result.status != "ok":
                print(f"{tag} {setting}: {result.status} ({result.error}); last lines of its output:\n"
                      f"{log_tail(result)}", file=sys.stderr, flush=True)
            yield result


def main(argv: list[str] | None = None) -> int:
    """``python -m lmtrain.bench.runner TARGET PAYLOAD_JSON RESULT_JSON``: the ``spawn`` launcher's child."""
    target, payload_path, result_path = (sys.argv[1:4] if argv is None else argv)
    child_main(target, json.loads(Path(payload_path).read_text()), result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
