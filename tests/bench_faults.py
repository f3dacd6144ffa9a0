"""Failure injection for the benchmark tests: child targets that fail on purpose, then run the real target.

Production code has no failure hooks. A test points a command's child target (``lmtrain.bench.model.CELL_TARGET``,
``lmtrain.bench.callbacks.SETTING_TARGET``, ``lmtrain.bench.overhead.SETTING_TARGET``) at a function here and sets
``LMTRAIN_TEST_FAIL``, which only this module reads:

    sweep cells   ``"key=value,key=value:kind;..."``: a cell whose parameters match fails with ``kind``: ``oom``
                  raises ``torch.OutOfMemoryError``, ``crash`` raises ``RuntimeError``, ``exit`` ends the process
                  with status 3, ``hang`` sleeps past any timeout
    settings      the name of the setting whose process exits with status 1 at once
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

FAIL_ENV = "LMTRAIN_TEST_FAIL"
TESTS = str(Path(__file__).resolve().parent)


def use(monkeypatch: pytest.MonkeyPatch, module: Any, attribute: str, target: str, spec: str | None) -> None:
    """Point ``module.attribute`` at ``bench_faults:target`` and set the failure spec (spawned children included)."""
    monkeypatch.setattr(module, attribute, f"bench_faults:{target}")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH", "")) if p))
    if spec is None:
        monkeypatch.delenv(FAIL_ENV, raising=False)
    else:
        monkeypatch.setenv(FAIL_ENV, spec)


def sweep_cell(payload: dict[str, Any]) -> dict[str, Any]:
    from lmtrain.bench.model import run_cell_in_child

    values = {k: str(v) for k, v in payload["cell"].items()}
    for item in filter(None, os.environ.get(FAIL_ENV, "").split(";")):
        match, _, kind = item.rpartition(":")
        pairs = [p.split("=", 1) for p in match.split(",") if p]
        if all(values.get(k) == v for k, v in pairs):
            import torch

            if kind == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            if kind == "crash":
                raise RuntimeError("injected crash\nsecond line")
            if kind == "exit":
                os._exit(3)
            if kind == "hang":
                time.sleep(3600)
    return run_cell_in_child(payload)


def _fail_setting(payload: dict[str, Any]) -> None:
    if os.environ.get(FAIL_ENV) == payload["setting"]:
        # SystemExit passes through the runner's child: the process ends at once, status 1, message on stderr.
        sys.exit(f"{FAIL_ENV}={payload['setting']!r}: failing this setting's process on purpose")


def callbacks_setting(payload: dict[str, Any]) -> dict[str, Any]:
    from lmtrain.bench.callbacks import run_setting_in_child

    _fail_setting(payload)
    return run_setting_in_child(payload)


def overhead_setting(payload: dict[str, Any]) -> dict[str, Any]:
    from lmtrain.bench.overhead import run_setting_in_child

    _fail_setting(payload)
    return run_setting_in_child(payload)
