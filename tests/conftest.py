"""Shared test setup: GPU marker skipping and small helpers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/tb.py and friends importable as plain modules

from gputurn import gpu_turn  # noqa: E402

SCRIPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "scripts"


def load_script(name: str) -> ModuleType:
    """``benchmarks/scripts/<name>.py`` as a module, without running its ``main`` (the scripts are not a package).

    It is registered in ``sys.modules`` under ``name`` (dataclasses and pickling look their module up there), with
    the scripts folder on the path while it loads, so a script can import its neighbours.
    """
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def gpu_share(request: pytest.FixtureRequest) -> Any:
    """GPU tests share the GPU with each other (``pytest -n 8``), except those marked ``gpu_alone``: they compare
    one process's kernel times with its own step times, which other processes' kernels on the same GPU lengthen.
    Such a test waits until it has the GPU to itself; the others wait while it runs (:func:`gputurn.gpu_turn`)."""
    if "gpu" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    with gpu_turn(alone="gpu_alone" in request.keywords):
        yield


@pytest.fixture(autouse=True)
def blas_workspace_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Each test leaves cuBLAS's workspace variables as it found them: building an ``LMModule`` with
    ``cuda_graphs`` sets them for the rest of the process (``lmtrain.blas``), which would make the next tests' cuBLAS
    setting depend on their order."""
    import os

    from lmtrain import blas

    for name in blas.NO_WORKSPACE:
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])  # registers the value to restore
        else:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(blas, "_set_here", blas._set_here)  # restored after the test
    yield


@pytest.fixture
def one_thread() -> Any:
    """One OpenMP thread for the test (bench cells inherit it): two on a busy 2-core machine make tiny steps up to
    50x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
