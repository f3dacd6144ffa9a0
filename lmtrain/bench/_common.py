"""Pieces shared by the benchmark commands.

``bench callbacks`` and ``bench overhead`` compare a few settings (a callback on or off, Lightning or a
plain loop). Run one after another in one process, later settings ran measurably slower than earlier ones
(the same no-callback setting, run first and last, differed by more than the overheads being measured), so
by default each setting runs in a fresh Python process: the command re-invokes itself once per setting
with the hidden flags ``--_one-setting NAME --_child-out FILE``, and the child writes its result as JSON
to ``FILE`` (:func:`run_isolated`, :func:`write_child_result`). ``--no-isolate`` runs every setting in the command's
own process instead (faster to start, for quick checks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: Read only in a child process: when it equals the child's setting, the child fails at once (a test hook for
#: the parent's handling of crashed children).
FAIL_ENV = "LMTRAIN_BENCH_FAIL_SETTING"
#: Lines of a failed child's output echoed to stderr.
_TAIL_LINES = 20


def keep_on_device_strategy() -> Any:
    """A single-GPU strategy whose teardown frees the optimizer state and leaves the model on the GPU.

    Lightning's default teardown copies the model and the optimizer state to the host (about 40 GB for the
    2.7B model with AdamW: tens of seconds per run), which a benchmark running several fits in one process
    does not need. Nothing is measured during teardown, so timings are unaffected.
    """
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class _KeepOnDevice(SingleDeviceStrategy):
        def teardown(self) -> None:
            for optimizer in self.optimizers:
                optimizer.state.clear()
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()

    return _KeepOnDevice(device=torch.device("cuda", torch.cuda.current_device()))


# -- one fresh process per setting ----------------------------------------------------------------------------


def add_isolation_arguments(parser: argparse.ArgumentParser, default_timeout: float = 1200.0) -> None:
    """``--isolate/--no-isolate``, ``--timeout`` and the hidden flags a child process is started with."""
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                        help="run each setting in a fresh Python process (default); --no-isolate runs them all in "
                             "this process, one after another (quicker to start; later settings may run slower)")
    parser.add_argument("--timeout", type=float, default=default_timeout,
                        help=f"seconds a setting's process may take before it is stopped and recorded as timeout "
                             f"(default {default_timeout:g}; with --isolate)")
    parser.add_argument("--_one-setting", dest="_one_setting", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_child-out", dest="_child_out", default=None, help=argparse.SUPPRESS)


#: Flags that a child is not given again (the parent's own output and process handling).
_PARENT_ONLY = frozenset({"isolate", "timeout", "_one_setting", "_child_out", "out", "help"})


def child_argv(add_arguments: Callable[[argparse.ArgumentParser], None], args: argparse.Namespace,
               drop: Iterable[str] = ()) -> list[str]:
    """The command-line flags that reproduce ``args`` (those that differ from their defaults).

    Args:
        add_arguments: the command's ``add_arguments``; its parser is rebuilt to learn the flags.
        args: the parsed arguments of this process.
        drop: further destinations not to pass on (besides ``--out``, ``--isolate``, ``--timeout``).
    """
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    skip = _PARENT_ONLY | set(drop)
    argv: list[str] = []
    # argparse has no public list of a parser's actions; ``_actions`` is stable since Python 3.2.
    for action in parser._actions:
        if not action.option_strings or action.dest in skip or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else next(s for s in action.option_strings if s.startswith("--no-")))
        elif action.nargs == 0:  # store_true / store_false / store_const
            if value == action.const:
                argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


@dataclass
class ChildResult:
    """What one child process left behind."""

    setting: str
    status: str  # ok | OOM | error | timeout
    result: dict[str, Any] | None  # the payload the child wrote (None unless ok)
    pid: int | None  # the child's os.getpid(), as it reported it (None unless ok)
    returncode: int | None  # None after a timeout
    error: str  # one line: why there is no result ("" when ok)
    seconds: float  # wall time of the child, start-up included


def _child_env() -> dict[str, str]:
    # The child must import the same lmtrain as this process, wherever it was started from.
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _why(returncode: int, output: str) -> str:
    """One line on why a child failed: its signal, or the last line of its output (a traceback's error)."""
    if returncode < 0:
        return f"killed by signal {-returncode}"
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return f"exit status {returncode}: {lines[-1][:300] if lines else 'no output'}"


def run_isolated(command: str, add_arguments: Callable[[argparse.ArgumentParser], None], args: argparse.Namespace,
                 settings: Sequence[str], drop: Iterable[str] = (), tag: str | None = None) -> list[ChildResult]:
    """Run ``python -m lmtrain bench COMMAND ... --_one-setting S`` for each setting S, one after another.

    Each child gets this process's flags (:func:`child_argv`) and writes its result with
    :func:`write_child_result`. A child that exits without a result (a crash, an uncaught error, killed by the
    system) is recorded as ``error`` (``OOM`` for an uncaught out-of-memory error) with the last line of its
    output, one over ``args.timeout`` seconds
    as ``timeout``; the next setting runs either way. A child's output is kept in a temporary file and echoed
    to stderr (the last lines) only when it failed.

    Args:
        command: the bench subcommand (``callbacks``, ``overhead``).
        add_arguments: that command's ``add_arguments``.
        args: this process's arguments.
        settings: setting names, in the order to run them (a name may repeat).
        drop: argument destinations not to pass to the children (e.g. ``settings``).
        tag: prefix of the progress lines on stderr (default ``[bench COMMAND]``).
    """
    tag = tag or f"[bench {command}]"
    base = [sys.executable, "-m", "lmtrain", "bench", command, *child_argv(add_arguments, args, drop)]
    timeout = args.timeout if args.timeout and args.timeout > 0 else None
    results: list[ChildResult] = []
    with tempfile.TemporaryDirectory(prefix=f"lmtrain-bench-{command}-") as work:
        for i, setting in enumerate(settings):
            out, log = Path(work) / f"{i}.json", Path(work) / f"{i}.log"
            cmd = [*base, "--_one-setting", setting, "--_child-out", str(out)]
            print(f"{tag} {setting}: fresh process ({i + 1}/{len(settings)})", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            returncode: int | None = None
            with log.open("wb") as log_file:
                try:
                    returncode = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=log_file,
                                                stderr=subprocess.STDOUT, env=_child_env(), timeout=timeout).returncode
                except subprocess.TimeoutExpired:
                    pass  # subprocess.run has killed the child
            seconds = time.perf_counter() - t0
            text = log.read_text(errors="replace")
            payload = json.loads(out.read_text()) if out.is_file() else None
            if payload is not None and returncode == 0:
                result = ChildResult(setting, "ok", payload.get("result"), payload.get("pid"), 0, "", seconds)
            elif returncode is None:
                result = ChildResult(setting, "timeout", None, None, None,
                                     f"no result within --timeout {timeout:g} s", seconds)
            else:
                why = _why(returncode, text)
                status = "OOM" if "OutOfMemoryError" in why else "error"
                result = ChildResult(setting, status, None, None, returncode, why, seconds)
            if result.status != "ok":
                tail = "\n".join(text.splitlines()[-_TAIL_LINES:])
                print(f"{tag} {setting}: {result.status} ({result.error}); last lines of its output:\n{tail}",
                      file=sys.stderr, flush=True)
            results.append(result)
    return results


def child_setting_start(setting: str) -> None:
    """Called first thing in a child: fails on purpose when ``LMTRAIN_BENCH_FAIL_SETTING`` names ``setting``."""
    if os.environ.get(FAIL_ENV) == setting:
        # SystemExit, not an exception the command line would handle: the process ends at once, status 1.
        raise SystemExit(f"{FAIL_ENV}={setting!r}: failing this setting's process on purpose")


def write_child_result(path: str, setting: str, result: dict[str, Any]) -> None:
    """Write a child's result for :func:`run_isolated`, with the child's process id."""
    payload = {"setting": setting, "pid": os.getpid(), "result": result}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def baseline(first: float | None, last: float | None) -> tuple[float | None, float | None]:
    """(mean of the two baseline runs, drift of the last from the first in %) from their median step times.

    With one of the two missing (failed, not run), the other is the baseline and the drift is None.
    """
    values = [v for v in (first, last) if v]
    mean = sum(values) / len(values) if values else None
    drift = 100.0 * (last / first - 1.0) if first and last else None
    return mean, drift
