"""torch.compile's caches in a folder that outlives the process, so that the second run of a config starts fast.

A compiled fit spends its first step compiling: Dynamo traces the model, AOTAutograd derives the backward graph,
inductor generates and compiles Triton (GPU) or C++ (CPU) kernels, and Triton autotunes. PyTorch keeps the results
on disk (inductor's FX graph cache, the AOTAutograd cache, Triton's kernel cache and autotuning results), by
default in a per-user temporary folder (``/tmp/torchinductor_<user>``) that a fresh machine or container does
not have. :class:`CompileCache` points those caches at a folder of lmtrain's choosing for the length of a fit:
by default ``compile_cache`` under the logger's ``save_dir`` (``logs/compile_cache``), shared by every run that
logs there, so the second run of a config loads what the first compiled instead of compiling it again. Only
Dynamo's tracing, the loading and the CUDA graph capture remain.

``python -m lmtrain fit|validate|test`` adds it when the model compiles or runs lmtrain's Triton kernels
(``--compile_cache FOLDER`` names another folder, ``--compile_cache off`` leaves torch's own); in a script of your
own, add it to the trainer's callbacks. It prints two lines::

    compile cache: logs/compile_cache (N files from earlier runs)
    first step: X s (compile cache: hit, G of G compiled graphs loaded)

``hit``: every graph compiled in this fit so far came from the cache; ``miss``: none did (the first run of a
config, or after a change of torch, Triton, the model or the options); ``partial``: some did. A graph that the
caches cannot hold (``bypassed``) is compiled every time. Triton's compiled kernels, lmtrain's own included, are
cached in the same folder, and so is the autotuning of lmtrain's pointer flash kernels (``triton.autotune``'s
``cache_results``, Triton 3.4 and later); the TMA kernels' autotuning (configs with a ``pre_hook``, which Triton does
not cache) runs again in each process.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

#: The folder under the logger's ``save_dir`` that holds the caches unless another is named.
FOLDER_NAME = "compile_cache"
#: ``--compile_cache`` value that leaves torch's own cache folders.
OFF = "off"
#: The environment variables through which inductor and Triton take their cache folders, and the sub-folder of
#: the compile cache each gets.
_CACHE_VARIABLES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def cache_counts() -> dict[str, int]:
    """How many graphs (a forward, a backward, an inference graph) inductor has, in this process, loaded from its
    FX graph cache (``hit``), compiled and stored (``miss``) or compiled without the cache (``bypass``). An
    AOTAutograd cache hit loads its graphs through that cache too, so they count here."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {outcome: inductor[f"fxgraph_cache_{outcome}"] for outcome in ("hit", "miss", "bypass")}


def describe_outcome(before: dict[str, int], after: dict[str, int]) -> str | None:
    """``hit``, ``miss`` or ``partial`` with the counts, for the lookups between two :func:`cache_counts`; None
    when nothing was compiled in between."""
    hit, miss, bypass = (after[k] - before[k] for k in ("hit", "miss", "bypass"))
    total = hit + miss + bypass
    if total == 0:
        return None
    if hit == total:
        return f"hit, {hit} of {total} compiled graphs loaded"
    parts = [f"{n} {what}" for n, what in ((miss, "compiled and stored"), (bypass, "bypassed")) if n]
    if hit == 0:
        return f"miss, {total} graphs compiled: {', '.join(parts)}"
    return f"partial, {hit} of {total} compiled graphs loaded, {', '.join(parts)}"


def default_folder(trainer: pl.Trainer) -> Path:
    """``compile_cache`` under the logger's ``save_dir`` (the trainer's ``default_root_dir`` without one)."""
    save_dir = getattr(trainer.logger, "save_dir", None) if trainer.logger is not None else None
    return Path(save_dir or trainer.default_root_dir) / FOLDER_NAME


def _file_count(folder: Path) -> int:
    return sum(1 for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


class CompileCache(pl.Callback):
    """Keep torch.compile's and Triton's caches in ``folder`` during a fit, validation or test, and report the first
    training step's time with the cache's outcome.

    At ``setup`` the caches move to the folder (inductor's through ``TORCHINDUCTOR_CACHE_DIR``, Triton's through
    ``TRITON_CACHE_DIR``, the variables both read for their cache folders) and one line says where and what is
    there; at ``teardown`` the previous values come back. After the first training step (the GPU synchronised)
    one line gives its time and whether the compiled graphs came from the cache.

    Args:
        folder: where the caches go; None: ``compile_cache`` under the logger's ``save_dir``
            (:func:`default_folder`), shared by the runs logged there.
    """

    def __init__(self, folder: str | os.PathLike | None = None) -> None:
        self.folder = None if folder is None else Path(folder)
        #: The folder in use (set at ``setup``).
        self.path: Path | None = None
        #: The first training step's seconds and the cache's outcome (``describe_outcome``), once known.
        self.first_step_s: float | None = None
        self.outcome: str | None = None
        self._saved: dict[str, str | None] = {}
        self._counts: dict[str, int] = {}
        self._step_start: float | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.path = (self.folder or default_folder(trainer)).resolve()
        files = _file_count(self.path)
        self._saved = {name: os.environ.get(name) for name in _CACHE_VARIABLES}
        for name, sub in _CACHE_VARIABLES.items():
            os.environ[name] = str(self.path / sub)
        self._counts = cache_counts()
        self.first_step_s = self.outcome = self._step_start = None
        shown = self.folder if self.folder is not None else default_folder(trainer)
        pl_module.print(f"compile cache: {shown} "
                        f"({f'{files} files from earlier runs' if files else 'empty: this run fills it'})")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.first_step_s is None and self._step_start is None:
            self._step_start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._step_start is None or self.first_step_s is not None:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # the step's kernels, not only their launches
        self.first_step_s = time.perf_counter() - self._step_start
        self.outcome = describe_outcome(self._counts, cache_counts())
        pl_module.print(f"first step: {self.first_step_s:.1f} s (compile cache: {self.outcome or 'nothing compiled'})")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved = {}

