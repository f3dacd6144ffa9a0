"""Sweep sizes x contexts x precisions x modes: step times, tokens/s, MFU, peak memory and the memory plan.

Every cell of the sweep (one size, context, batch size, precision, attention backend, compile flag, step
mode, warm-up and step count, plus the step options in which it differs from the config) trains the real ``LMModule`` on
``LMDataModule(source="synthetic")`` with a real ``Trainer.fit`` and ``lmtrain.callbacks.CudaSyncTimer``, so a
number in the table means what it means in TensorBoard. Beside the timer, the benchmark's own callback
``lmtrain.bench.step_events.StepEvents`` times every measured step and the pipeline of steps with its own CUDA
events, and keeps every step's loss. A cell with ``runner="plain"`` trains the same model with the plain-PyTorch
reference loop of ``lmtrain.bench.reference`` instead (no Lightning; GPU only). Each cell runs in a fresh
process: an out-of-memory cell is recorded as ``OOM``, a crash as ``error: <first line>``, a cell over
``--timeout`` as ``timeout``, and the sweep goes on; memory fragmentation of one cell never reaches the next.

Processes: by default (``--launcher fork``) cells are forked from this process, which has imported torch
and Lightning but never touched CUDA, so a cell starts in about a second instead of re-importing
everything; ``--launcher spawn`` starts a fresh interpreter instead (used automatically when CUDA is
already initialised here, since a forked child must never inherit a CUDA context). Both are
``lmtrain.bench.runner``'s. Results come back as a JSON file per cell; a cell's stdout and stderr go to
``<out>_cells/<cell>.log``. A cell given as a config YAML is resolved by the ``fit`` parser
(``lmtrain.cli_config``), with the cell's context, attention, compile flag and step mode as overrides.

A cell is a difference from a config: its option fields, flags (``--cuda-graphs off,on``), key, name and CSV columns
are the step options of the schema (``lmtrain.config.step_fields``: the memory, speed and float8 groups, so
``--float8 none,tensorwise`` is the float8 axis), read from
``ModelConfig``'s fields; an option at its default is left out of the key and the name, so results files written
before it existed still match.

Output: a Markdown table on stdout (one row per cell; columns ``MARKDOWN_COLUMNS``), ``--out`` as CSV (all
``CSV_COLUMNS``) with the same rows as JSON beside it (``.json``), TensorBoard logs under ``--logdir``.
Rerunning with the same ``--out`` skips finished cells (matched on every cell parameter); ``--retry-failed``
runs error and timeout cells again. Studies (``--study NAME``, see ``lmtrain.bench.studies``) preset the
sweep flags (a study with ``variants`` is the union of several presets) and add their own tables; flags given
explicitly override the preset. Defaults: warm-up 3 steps, 10 measured steps, batch size 4, vocabulary 10000
(the course's benchmark setup), fp32, sdpa attention.
"""

from __future__ import annotations

import argparse
import csv
import functools
import itertools
import json
import os
import shlex
import sys
import time
import typing
from dataclasses import Field, asdict, fields, make_dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

from lmtrain.bench.environment import environment
from lmtrain.bench.runner import cuda_initialised
from lmtrain.bench.studies import STUDIES
from lmtrain.bench.tables import PLAN_SKIP, markdown_rows, skipped_by_plan, status_text
from lmtrain.config import SIZES, STUDY_SIZES, ModelConfig, check_option, doc_of, step_fields
from lmtrain.errors import LmtrainError, positive_number
from lmtrain.flops import STEP_MODES, parameter_count
from lmtrain.memory_plan import GIB, PRECISIONS, estimate_memory, usable_bytes

#: Cell parameters that are axes of their own (flags ``--contexts``, ``--attention``, ``--compile``, ``--mode``,
#: ``--vocab-size``) rather than step options, and the schema fields they set.
AXIS_FIELDS: dict[str, str] = {"context": "context_length", "attention": "attention", "compile": "compile",
                               "mode": "step_mode", "vocab_size": "vocab_size"}
#: How a cell trains: ``lightning`` (``LMModule`` under ``Trainer.fit``) or ``plain`` (the plain-PyTorch reference
#: loop of ``lmtrain.bench.reference``, GPU only).
RUNNERS = ("lightning", "plain")
#: Columns of the CSV and JSON rows after the cell's parameters.
MEASUREMENT_COLUMNS = [
    "status", "error", "forward_ms_mean", "forward_ms_std", "backward_ms_mean",
    "backward_ms_std", "optimizer_ms_mean", "optimizer_ms_std", "step_ms_mean", "step_ms_std", "step_ms_median",
    "step_ms_min", "step_ms_max", "first_step_ms", "events_step_ms_mean", "pipeline_step_ms", "timer_vs_events_pct",
    "tokens_per_s", "mfu", "peak_gib", "reserved_gib", "estimate_gib", "estimate_needed_gib", "estimate_error_pct",
    "wall_s", "device", "device_memory_gib",
]

_DONE_STATUSES = ("ok", "OOM", "error", "timeout", "skipped")


def option_fields(config_class: type[ModelConfig] = ModelConfig) -> tuple[Field, ...]:
    """The step options a cell can differ in: the schema's step fields (``lmtrain.config.step_fields``) that are not
    axes of their own."""
    return tuple(f for f in step_fields(config_class) if f.name not in AXIS_FIELDS.values())


class CellBase:
    """Methods of a cell (``Cell`` is a frozen dataclass built from the schema by :func:`cell_class`)."""

    #: The schema the cell's options come from.
    config_class: type[ModelConfig] = ModelConfig
    #: The cell's option fields and their defaults: left out of the key and the name at their defaults, so results
    #: files written before an option existed still match.
    defaults: dict[str, Any] = {}
    #: How a set option shows in the cell's name: ``_<short><value>`` (the value left out for True).
    short_names: dict[str, str] = {}

    def options(self) -> dict[str, Any]:
        """The ``LMModule`` options that differ from their defaults."""
        return {k: v for k, v in self._set_fields().items() if k != "runner"}

    def _set_fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k, default in self.defaults.items() if getattr(self, k) != default}

    def key(self) -> str:
        """Identity of the cell in a results file (every parameter; options and runner only where set)."""
        return json.dumps({k: v for k, v in asdict(self).items()  # type: ignore[call-overload]
                           if k not in self.defaults or v != self.defaults[k]}, sort_keys=True)

    @property
    def label(self) -> str:
        """Short name of the size (a YAML path's stem)."""
        return Path(self.size).stem if _is_yaml(self.size) else self.size  # type: ignore[attr-defined]

    @property
    def slug(self) -> str:
        """File-name-safe name of the cell."""
        c = "compiled" if self.compile else "eager"  # type: ignore[attr-defined]
        options = "".join(f"_{self.short_names[k]}{'' if v is True else v}" for k, v in self._set_fields().items())
        text = (f"{self.label}_T{self.context}_B{self.batch_size}_{self.precision}_{self.attention}_{c}"  # type: ignore
                f"_{self.mode}_w{self.warmup}_s{self.steps}{options}")  # type: ignore[attr-defined]
        return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in text)


def cell_class(config_class: type[ModelConfig] = ModelConfig) -> type:
    """The cell dataclass of a schema: the axes (size, context, batch size, precision, attention, compile, mode,
    warm-up, steps, vocabulary), one field per step option (``option_fields``) with the schema's default, and
    ``runner`` (``RUNNERS``). The row of every cell also holds ``losses``: the training loss of each step, warm-up
    included."""
    options = option_fields(config_class)
    defaults = {f.name: f.default for f in options} | {"runner": "lightning"}
    shorts = {f.name: f.metadata.get("short") or f.name for f in options} | {"runner": ""}
    hints = typing.get_type_hints(config_class)
    spec = [("size", str), ("context", int), ("batch_size", int), ("precision", str), ("attention", str),
            ("compile", bool), ("mode", str), ("warmup", int), ("steps", int),
            ("vocab_size", int, dataclass_field(default=10_000))]
    spec += [(f.name, hints[f.name], dataclass_field(default=f.default)) for f in options]
    spec += [("runner", str, dataclass_field(default="lightning"))]
    return make_dataclass("Cell", spec, bases=(CellBase,), frozen=True,
                          namespace={"config_class": config_class, "defaults": defaults, "short_names": shorts,
                                     "__module__": __name__,
                                     "__doc__": "One point of the sweep. ``size`` is a named size or a config YAML "
                                                "path; the step options are ``ModelConfig``'s fields."})


#: The cells of ``ModelConfig``.
Cell = cell_class()
#: Defaults of the sweep flags (a study's preset and then explicit flags override them): booleans as off/on.
DEFAULTS: dict[str, Any] = {
    "sizes": ["small"], "contexts": [512], "batch_size": [4], "precision": ["32-true"], "attention": ["sdpa"],
    "compile": ["off"], "mode": ["forward_backward"], "warmup": [3], "steps": [10], "vocab_size": 10_000,
    **{k: [("on" if v else "off") if isinstance(v, bool) else v] for k, v in Cell.defaults.items()},
}
#: Columns of the CSV and JSON rows.
CSV_COLUMNS = ["size", "params", "context", "batch_size", "precision", "attention", "compile", "mode", "warmup",
               "steps", "vocab_size", *Cell.defaults, *MEASUREMENT_COLUMNS]


def _is_yaml(size: str) -> bool:
    return size.endswith((".yaml", ".yml"))


# -- cell configuration (shared by the parent, the child and the planner) -------------------------------------


def module_kwargs(cell: Cell) -> dict[str, Any]:
    """``LMModule`` arguments of a cell: the named size, or the YAML resolved like ``fit`` does, plus the cell's values.

    Raises:
        LmtrainError: the YAML is missing or invalid.
    """
    overrides = {"context_length": cell.context, "attention": cell.attention, "compile": cell.compile,
                 "step_mode": cell.mode, **cell.options()}
    if not _is_yaml(cell.size):
        return {"size": cell.size, "vocab_size": cell.vocab_size, **overrides}
    return dict(_resolved_model(cell.size, tuple(overrides.items())))


@functools.lru_cache(maxsize=64)
def _resolved_model(path: str, overrides: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    # Cached: a sweep asks for the same cell's arguments several times (plan, row, time estimate).
    from lmtrain.cli_config import resolve_config

    resolved = resolve_config(path, {f"model.{k}": v for k, v in overrides})
    return tuple(resolved.model.items())


def cell_config(cell: Cell) -> ModelConfig:
    """The ``ModelConfig`` (of the cell's schema) a cell's ``LMModule`` builds (no torch model is created)."""
    return cell.config_class.from_module_kwargs(module_kwargs(cell))


# -- the child: one cell --------------------------------------------------------------------------------------


def _make_timer(warmup: int) -> Any:
    """The timing callback of a cell (tests replace this module attribute with a stub)."""
    from lmtrain.callbacks.timer import CudaSyncTimer

    return CudaSyncTimer(warmup_steps=warmup, sync="events", peak_flops=None, log_every_n_steps=1,
                         print_summary=False)


def measure_cell(cell: Cell, logdir: str | None, on_result: Any = None) -> dict[str, Any]:
    """Run one Lightning cell in this process and return its measurements (raises on failure).

    The weights start from seed 0 and the batches are the synthetic data's, so cells that differ only in how
    they compute a step see the same losses (up to rounding). Besides the timer, ``StepEvents`` times the
    measured steps with its own clock and keeps every step's loss.

    ``on_result(row)``, when given, is called at the end of the last step (``on_train_end``), before
    Lightning's teardown: a cell process uses it to write its result and exit at once, skipping the copy of
    the model and optimizer state back to the CPU (tens of seconds for 2.7B) that the table does not need.
    """
    import warnings

    import lightning.pytorch as pl
    import torch

    from lmtrain.bench.clock import Clock
    from lmtrain.bench.step_events import StepEvents
    from lmtrain.data import LMDataModule
    from lmtrain.module import LMModule

    warnings.filterwarnings("ignore", module="lightning")  # worker-count and logging hints; the table says it all
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    total = cell.warmup + cell.steps
    module = LMModule(**module_kwargs(cell))
    data = LMDataModule(source="synthetic", batch_size=cell.batch_size, context_length=cell.context,
                        vocab_size=module.config.vocab_size, train_batches=total, val_batches=1)
    timer = _make_timer(cell.warmup)
    events = StepEvents(cell.warmup, Clock(cuda))
    logger: Any = False
    if logdir:
        from lightning.pytorch.loggers import TensorBoardLogger

        logger = TensorBoardLogger(logdir, name=cell.slug, version="")
    result: dict[str, Any] = {}

    class _Collect(pl.Callback):  # after the timer in the callback list: its summary is complete here
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            result.update(_result_row(cell, timer, module))
            result.update(events.columns(result.get("step_ms_mean")))
            for lg in trainer.loggers:
                lg.finalize("success")
            if on_result is not None:
                on_result(result)

    from lmtrain.cli_config import lightning_notices_off

    with lightning_notices_off():  # a cell's log holds the run, not Lightning's product tips
        trainer = pl.Trainer(
            accelerator="auto", devices=1, precision=cell.precision, max_steps=total, max_epochs=1,
            limit_val_batches=0, num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, logger=logger, callbacks=[timer, events, _Collect()], log_every_n_steps=1,
            default_root_dir=logdir or None,
        )
        trainer.fit(module, datamodule=data)
    return result


def _result_row(cell: Cell, timer: Any, module: Any) -> dict[str, Any]:
    """Times, throughput, MFU and memory peaks of a finished cell."""
    stats = timer.summary()
    row: dict[str, Any] = {"status": "ok"}
    for phase in ("forward", "backward", "optimizer", "step"):
        s = stats.get(f"{phase}_ms")
        if s:
            row[f"{phase}_ms_mean"], row[f"{phase}_ms_std"] = s["mean"], s["std"]
    if "step_ms" in stats:
        s = stats["step_ms"]
        row.update(step_ms_median=s["median"], step_ms_min=s["min"], step_ms_max=s["max"])
    first = timer.warmup_times[0] if timer.warmup_times else (timer.step_times[0].get("step_ms")
                                                             if timer.step_times else None)
    row["first_step_ms"] = first
    row.update(_device_columns(cell, module.config, row.get("step_ms_mean")))
    if module.config.attention == "flash_triton":  # which kernels served it (the JSON row; not a CSV column)
        from lmtrain.module import flash_kernels_record

        row["flash_kernels"] = flash_kernels_record(module.config, module.device, cell.precision)
    return row


def _device_columns(cell: Cell, config: ModelConfig, step_ms: float | None) -> dict[str, Any]:
    """The device, tokens/s and MFU at the mean step time ``step_ms``, and the memory peaks (CUDA) of a cell."""
    import torch

    from lmtrain.flops import flops_per_step, mfu, peak_flops

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "cpu"
    row: dict[str, Any] = {"device": device}
    if step_ms:
        row["tokens_per_s"] = cell.batch_size * cell.context / (step_ms / 1e3)
        flops = flops_per_step(config, cell.batch_size, cell.context, mode=cell.mode)
        row["mfu"] = mfu(flops, step_ms / 1e3, peak_flops(device, cell.precision)) if cuda else None
    if cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        row["reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        row["device_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / GIB
    return row


def measure_plain_cell(cell: Cell) -> dict[str, Any]:
    """Run a ``runner="plain"`` cell in this process: the reference loop of ``lmtrain.bench.reference``.

    The row has the Lightning cells' columns where they apply: step statistics from the loop's CUDA events
    around each step, the first step, ``pipeline_step_ms``, tokens/s, MFU, memory peaks and ``losses``.

    Raises:
        LmtrainError: the cell asks for what the plain loop does not do (a step mode other than ``train``, a
            memory or optimizer option), or no CUDA GPU is visible.
    """
    from lmtrain.analysis.timing import phase_statistics
    from lmtrain.bench.reference import train_plain

    asked = ([f"mode {cell.mode}"] if cell.mode != "train" else []) + sorted(
        k for k in cell.options() if k != "cuda_graphs")
    if asked:
        raise LmtrainError("--runner", f"the plain reference loop times whole training steps without memory or "
                           f"optimizer options; cell {cell.slug} asks for {', '.join(asked)}.",
                           "give plain cells --mode train and leave those options at their defaults.")
    config = cell_config(cell)
    run = train_plain(config, cell.batch_size, cell.precision, compile=cell.compile, cuda_graphs=cell.cuda_graphs,
                      warmup=cell.warmup, steps=cell.steps)
    stats = phase_statistics([{"step_ms": ms} for ms in run.step_ms], ["step_ms"])["step_ms"]
    row: dict[str, Any] = {"status": "ok", "step_ms_mean": stats["mean"], "step_ms_std": stats["std"],
                           "step_ms_median": stats["median"], "step_ms_min": stats["min"], "step_ms_max": stats["max"],
                           "first_step_ms": (run.warmup_ms or run.step_ms)[0], "pipeline_step_ms": run.pipeline_step_ms,
                           "losses": run.losses}
    row.update(_device_columns(cell, config, stats["mean"]))
    return row


def run_cell_in_child(payload: dict[str, Any]) -> dict[str, Any]:
    """Child target of :func:`launch_cell` (``lmtrain.bench.runner``): measure one cell.

    The row is written at the end of the last step and the process ends there (``exit_with_result``).
    """
    from lmtrain.bench.runner import exit_with_result

    cell = Cell(**payload["cell"])
    if cell.runner == "plain":
        exit_with_result(measure_plain_cell(cell))  # ends the process
    return measure_cell(cell, payload.get("logdir"), on_result=exit_with_result)


#: The function a cell's process runs (``module:function``); tests point it at a wrapper that injects failures.
CELL_TARGET = "lmtrain.bench.model:run_cell_in_child"


def launch_cell(cell: Cell, launcher: str, timeout: float, logdir: str | None, work_dir: Path) -> dict[str, Any]:
    """Run one cell in a fresh process and return its row fields (status, times, memory, error, wall time)."""
    from lmtrain.bench.runner import run_child

    child = run_child(cell.slug, CELL_TARGET, {"cell": asdict(cell), "logdir": logdir}, work_dir, timeout=timeout,
                      launcher=launcher)
    row: dict[str, Any] = dict(child.result or {})
    row["status"] = child.status
    if child.status != "ok":
        row["error"] = child.error
    row["wall_s"] = child.seconds
    return row


def _bad_fork(row: dict[str, Any]) -> bool:
    text = str(row.get("error") or "").lower()
    return row.get("status") == "error" and "cuda" in text and ("forked subprocess" in text or "initializ" in text)


# -- rows, files, tables --------------------------------------------------------------------------------------


def base_row(cell: Cell) -> dict[str, Any]:
    """The parameters of a cell as a row, with parameter count and the memory plan (GiB)."""
    row: dict[str, Any] = {k: v for k, v in asdict(cell).items()}
    row["size"] = cell.label
    row["compile"] = "on" if cell.compile else "off"
    row["key"] = cell.key()
    try:
        cfg = cell_config(cell)
        # The options that ran: a config YAML's own values where the cell leaves them at their defaults.
        row.update({k: getattr(cfg, k) for k in cell.defaults if k != "runner" and hasattr(cfg, k)})
        row["params"] = parameter_count(cfg)
        row["vocab_size"] = cfg.vocab_size
        if cell.precision in PRECISIONS:
            plan = estimate_memory(cfg, cell.batch_size, cell.context, cell.precision, cell.mode)
            row["estimate_gib"] = plan.peak_gib
            row["estimate_needed_gib"] = plan.needed / GIB
    except LmtrainError:
        pass
    return row


def with_current_plan(row: dict[str, Any]) -> dict[str, Any]:
    """The row with the memory plan of this lmtrain version (analytic: re-evaluated, the peak is not re-measured).

    A results file can hold cells measured by an earlier version; its plan columns would otherwise show that
    version's planner. Rows whose key is not a cell are returned unchanged.
    """
    try:
        cell = Cell(**json.loads(row["key"]))
    except (KeyError, TypeError, ValueError):
        return row
    fresh = base_row(cell)
    if fresh.get("estimate_gib") is None:
        return row
    return finish_row({**row, **{k: fresh.get(k) for k in ("estimate_gib", "estimate_needed_gib")}})


def finish_row(row: dict[str, Any]) -> dict[str, Any]:
    """Add derived columns (estimate error) and the empty ones."""
    row["estimate_error_pct"] = None
    if row.get("peak_gib") and row.get("estimate_gib"):
        row["estimate_error_pct"] = 100.0 * (row["estimate_gib"] - row["peak_gib"]) / row["peak_gib"]
    for col in CSV_COLUMNS:
        row.setdefault(col, None)
    return row


def load_results(out: Path) -> list[dict[str, Any]]:
    """Rows of an earlier run with the same ``--out`` (from the JSON beside the CSV), or []."""
    path = out.with_suffix(".json")
    if not path.is_file():
        return []
    return list(json.loads(path.read_text()).get("rows", []))


def load_meta(out: Path) -> dict[str, Any]:
    """The ``meta`` of the results JSON beside ``out`` (commands, environment, launcher), or {}."""
    path = out.with_suffix(".json")
    if not path.is_file():
        return {}
    return dict(json.loads(path.read_text()).get("meta", {}))


def _merged_meta(out: Path, meta: dict[str, Any] | None, launcher: str) -> dict[str, Any]:
    """The results file's meta updated for this run: every command that added cells, in order, and the
    environment (versions, driver) of the latest run."""
    old = load_meta(out)
    commands = list(old.get("commands") or ([old["command"]] if old.get("command") else []))
    new = dict(meta or {})
    command = new.pop("command", None)
    if command and (not commands or commands[-1] != command):
        commands.append(command)
    return {**{k: v for k, v in old.items() if k != "command"}, **new, "commands": commands, "launcher": launcher,
            "environment": environment()}


def save_results(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Write the rows as CSV (``out``) and JSON (``out`` with ``.json``), atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    os.replace(tmp, out.with_suffix(".json"))
    tmp = out.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_COLUMNS})
    os.replace(tmp, out if out.suffix == ".csv" else out.with_suffix(".csv"))


# -- the sweep ------------------------------------------------------------------------------------------------


def _bigger_failed(cell: Cell, failed: list[Cell]) -> Cell | None:
    """An OOM cell equal to ``cell`` except for a smaller-or-equal context and batch size."""
    for f in failed:
        same = all(getattr(f, k.name) == getattr(cell, k.name) for k in fields(Cell)
                   if k.name not in ("context", "batch_size"))
        if same and f.context <= cell.context and f.batch_size <= cell.batch_size:
            return f
    return None


def _unfit(row: dict[str, Any], device_gib: float) -> str | None:
    """Why the cell's plan does not fit a ``device_gib`` device, or None when it fits (or has no plan)."""
    needed = row.get("estimate_needed_gib")
    usable = usable_bytes(int(device_gib * GIB)) / GIB
    if needed is None or needed <= usable:
        return None
    return f"{PLAN_SKIP} {needed:.2f} GiB, {usable:.2f} GiB usable of {device_gib:g} GiB (--skip-unfit)"


def _progress(i: int, n: int, cell: Cell, row: dict[str, Any]) -> None:
    step = row.get("step_ms_mean")
    extra = f" step {step:.1f} ms" if step else ""
    peak = row.get("peak_gib")
    extra += f" peak {peak:.2f} GiB" if peak else ""
    print(f"[{i}/{n}] {cell.slug}: {status_text(row)}{extra} ({row.get('wall_s', 0.0):.1f} s)", file=sys.stderr,
          flush=True)


def run_sweep(
    cells: list[Cell],
    out: Path,
    launcher: str = "fork",
    timeout: float = 600.0,
    logdir: str | None = None,
    retry_failed: bool = False,
    stop_after_oom: bool = False,
    max_minutes: float | None = None,
    meta: dict[str, Any] | None = None,
    skip_unfit_gib: float | None = None,
) -> list[dict[str, Any]]:
    """Run the cells not yet in ``out`` (each in a fresh process), saving after every cell.

    Args:
        cells: the cells, in the order to run them (duplicates are run once).
        out: CSV path; the JSON beside it holds the rows and is read back to resume.
        launcher: ``fork`` or ``spawn`` (``fork`` falls back to ``spawn`` when CUDA is initialised here).
        timeout: seconds a cell may take before it is killed and recorded as ``timeout``.
        logdir: TensorBoard folder (None: no TensorBoard logs).
        retry_failed: run cells recorded as error or timeout again.
        stop_after_oom: skip a cell when the same cell with a smaller or equal context and batch ran out of memory.
        max_minutes: stop launching cells after this many minutes (the rest stay to be resumed).
        meta: extra information stored in the JSON.
        skip_unfit_gib: record the cells whose memory plan does not fit a device of this many GiB (its usable part:
            ``lmtrain.memory_plan.usable_bytes``) as ``skipped`` without running them; a later run without it runs
            them.

    Returns:
        The rows of ``cells`` (finished ones; cells not run because of ``max_minutes`` are absent).
    """
    if launcher == "fork" and cuda_initialised():
        print("note: CUDA is initialised in this process; cells are spawned, not forked", file=sys.stderr)
        launcher = "spawn"
    unique = list(dict.fromkeys(cells))
    existing = {r["key"]: r for r in load_results(out) if r.get("key")}
    stored = dict(existing)
    for key, row in existing.items():  # rows of an earlier run get the current planner's columns
        existing[key] = with_current_plan(row)
    if existing != stored:
        save_results(out, list(existing.values()), load_meta(out))
    rerun = ("error", "timeout") if retry_failed else ()

    def pending(cell: Cell) -> bool:
        row = existing.get(cell.key())
        if row is None or row.get("status") in rerun:
            return True
        # a cell the plan skipped runs when no budget is given now, or when this run's budget fits it
        return skipped_by_plan(row) and (skip_unfit_gib is None or _unfit(base_row(cell), skip_unfit_gib) is None)

    todo = [c for c in unique if pending(c)]
    meta = _merged_meta(out, meta, launcher) if todo else {}
    work_dir = out.parent / f"{out.stem}_cells"
    failed = [c for c in unique if existing.get(c.key(), {}).get("status") == "OOM"]
    start = time.perf_counter()
    if len(todo) < len(unique):
        print(f"resuming {out}: {len(unique) - len(todo)} of {len(unique)} cells already done", file=sys.stderr)
    for i, cell in enumerate(todo, 1):
        if max_minutes is not None and time.perf_counter() - start > max_minutes * 60:
            print(f"stopping after {max_minutes:g} min: {len(todo) - i + 1} cells left (rerun to resume)",
                  file=sys.stderr)
            break
        row = base_row(cell)
        smaller = _bigger_failed(cell, failed) if stop_after_oom else None
        unfit = _unfit(row, skip_unfit_gib) if skip_unfit_gib is not None else None
        if unfit is not None:
            row.update(status="skipped", error=unfit, wall_s=0.0)
        elif smaller is not None:
            row.update(status="OOM", error=f"skipped: context {smaller.context} already ran out of memory",
                       wall_s=0.0)
        else:
            result = launch_cell(cell, launcher, timeout, logdir, work_dir)
            if launcher == "fork" and _bad_fork(result):
                # CUDA was initialised in this process by something outside torch's own bookkeeping.
                print("note: CUDA failed in a forked cell; switching to spawned cells", file=sys.stderr)
                launcher = meta["launcher"] = "spawn"
                result = launch_cell(cell, launcher, timeout, logdir, work_dir)
            row.update(result)
        finish_row(row)
        if row["status"] == "OOM":
            failed.append(cell)
        existing[cell.key()] = row
        save_results(out, list(existing.values()), meta)
        _progress(i, len(todo), cell, row)
    return [existing[c.key()] for c in unique if c.key() in existing]


# -- command line ---------------------------------------------------------------------------------------------


def comma_list(kind: type) -> Any:
    """An argparse ``type``: a comma-separated list of ``kind`` (blanks around items ignored)."""

    def parse(text: str) -> list[Any]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        try:
            return [kind(s) for s in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}: {text!r}") from None

    return parse


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_parser(f: Field, annotation: Any) -> Any:
    """The ``type`` of an option's flag: off/on for booleans, whole numbers (``none`` for null) for integers."""
    if annotation is bool:
        return comma_list(str)
    args = set(typing.get_args(annotation)) or {annotation}
    if int in args and bool not in args:
        optional = type(None) in args

        def number(text: str) -> int | None:
            return None if optional and text.lower() in ("none", "null") else int(text)

        number.__name__ = "int"
        return comma_list(number)
    return comma_list(str)


def add_option_arguments(parser: argparse.ArgumentParser, config_class: type[ModelConfig] = ModelConfig) -> None:
    """One comma-separated flag per step option of the schema (``--cuda-graphs off,on``), help from the field."""
    hints = typing.get_type_hints(config_class)
    for f in option_fields(config_class):
        annotation = hints[f.name]
        default = ("on" if f.default else "off") if annotation is bool else f.default
        values = "off, on or off,on" if annotation is bool else "comma-separated values"
        rule = f"; {SWEEP_RULES[f.name]}" if f.name in SWEEP_RULES else ""
        text = f"{doc_of(f)} (model.{f.name}) In a sweep: {values}{rule} (default {default})"
        parser.add_argument(_flag(f.name), type=_value_parser(f, annotation), dest=f.name,
                            help=text.replace("%", "%%"))  # argparse formats help with %: a "2%" in a doc is text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--study", action="append", choices=sorted(STUDIES), default=[],
                        help="a ready-made study (repeatable): presets the flags below and adds its tables")
    parser.add_argument("--sizes", type=comma_list(str),
                        help=f"named sizes ({', '.join(SIZES)}), 'study' for the model sizes of the reference "
                        f"profiling study ({','.join(STUDY_SIZES)}), or config YAML paths (default small)")
    parser.add_argument("--contexts", type=comma_list(int), help="tokens per sequence (default 512)")
    parser.add_argument("--batch-size", type=comma_list(int), help="sequences per batch (default 4)")
    parser.add_argument("--precision", type=comma_list(str), help=f"Lightning precisions: {', '.join(PRECISIONS)} "
                        "(default 32-true)")
    parser.add_argument("--attention", type=comma_list(str), help="attention backends (default sdpa)")
    parser.add_argument("--compile", type=comma_list(str), help="off, on or off,on (default off)")
    parser.add_argument("--mode", type=comma_list(str), help=f"step modes: {', '.join(STEP_MODES)} "
                        "(default forward_backward)")
    parser.add_argument("--warmup", type=comma_list(int), help="warm-up steps excluded from the statistics (default 3)")
    parser.add_argument("--steps", type=comma_list(int), help="measured steps (default 10)")
    parser.add_argument("--vocab-size", type=int, help="vocabulary of named sizes (default 10000)")
    add_option_arguments(parser)
    parser.add_argument("--runner", type=comma_list(str),
                        help="lightning (LMModule under Trainer.fit), plain (the plain-PyTorch reference loop of "
                             "lmtrain.bench.reference, GPU only) or lightning,plain (default lightning)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/model.csv"),
                        help="results CSV (JSON beside it; rerun with the same path to resume)")
    parser.add_argument("--logdir", default="logs/bench", help="TensorBoard folder ('none': no logs)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per cell before it is killed")
    parser.add_argument("--launcher", choices=("fork", "spawn"), default="fork", help="how cells get a process")
    parser.add_argument("--retry-failed", action="store_true", help="run error and timeout cells again")
    parser.add_argument("--stop-after-oom", action="store_true", default=None,
                        help="skip cells larger than one that ran out of memory")
    parser.add_argument("--max-minutes", type=float, help="launch no new cell after this many minutes")
    parser.add_argument("--skip-unfit", type=positive_number, metavar="GIB",
                        help="record cells whose memory plan does not fit a GPU of GIB GiB (its total less the CUDA "
                             "context and fragmentation allowances of `estimate`) as skipped, without running them; "
                             "a later run without the flag runs them")


def sweep_values(args: argparse.Namespace, study: str | None = None,
                 variant: dict[str, Any] | None = None) -> dict[str, Any]:
    """Flag values: defaults, then the study's preset and one of its variants, then the flags given explicitly."""
    values = {**DEFAULTS, "stop_after_oom": False}
    if study is not None:
        values.update({k: v for k, v in STUDIES[study].preset.items() if k != "variants"})
    values.update(variant or {})
    for k in list(values):
        given = getattr(args, k, None)
        if given is not None:
            values[k] = given
    return values


def cells_of_study(args: argparse.Namespace, study: str | None = None) -> tuple[list[Cell], bool]:
    """The cells of a study (or of the flags alone) and whether to stop after an OOM.

    A study whose preset has ``variants`` (partial presets: flag values that override the preset's) has the
    cells of each variant's product, once each, ordered so that the cells of one size and context are adjacent,
    in variant order.
    """
    variants = (STUDIES[study].preset.get("variants") if study is not None else None) or [None]
    cells: list[Cell] = []
    stop = False
    for variant in variants:
        values = sweep_values(args, study, variant)
        cells += cells_from_values(values)
        stop = stop or bool(values["stop_after_oom"])
    cells = list(dict.fromkeys(cells))
    if len(variants) > 1:
        sizes = list(dict.fromkeys(c.size for c in cells))
        cells.sort(key=lambda c: (sizes.index(c.size), c.context))  # stable: variant order within a group
    return cells, stop


def plan_cells(args: argparse.Namespace) -> tuple[list[Cell], dict[str, list[Cell]], bool]:
    """All cells of a command line (the union of its studies), each study's cells, and stop-after-OOM."""
    if not args.study:
        cells, stop = cells_of_study(args)
        return cells, {}, stop
    per_study = {}
    stop = False
    for name in dict.fromkeys(args.study):
        per_study[name], study_stop = cells_of_study(args, name)
        stop = stop or study_stop
    union = list(dict.fromkeys(c for cells in per_study.values() for c in cells))
    return union, per_study, stop


#: The sweep's rules between options (:func:`_cell` applies them), shown in the flags' help.
SWEEP_RULES: dict[str, str] = {"optimizer_overlap": "on implies --optimizer-in-backward on",
                               "compile_mode": "compiled cells only",
                               "optimizer_state_dtype": "master-weight cells of the lightning runner only",
                               "float8_head": "float8 cells only",
                               "float8_min_features": "float8 cells only"}


def _option_value(name: str, value: Any) -> Any:
    """A flag's value of option ``name`` as the field holds it (off/on as booleans), checked by the schema.

    Raises:
        LmtrainError: the value is not allowed (named by its flag).
    """
    if isinstance(Cell.defaults[name], bool):
        if value not in ("on", "off"):
            raise LmtrainError(_flag(name), f"unknown value {value!r}.", "use on, off.")
        value = value == "on"
    try:
        check_option(Cell.config_class, name, value)
    except LmtrainError as exc:
        raise LmtrainError(_flag(name), exc.problem, exc.fix) from None
    return value


def _cell(size: str, context: int, batch: int, precision: str, attention: str, compile: bool, mode: str, warmup: int,
          steps: int, vocab_size: int, options: dict[str, Any], runner: str) -> Cell:
    """A cell with the sweep's rules between options: the overlap implies the in-backward optimizer, the compile
    mode applies to compiled cells only, the optimizer state's dtype to master-weight cells of Lightning only, the
    float8 head to float8 cells only (a ``--float8 none,tensorwise`` sweep is the float8 axis)."""
    if options.get("optimizer_overlap"):
        options["optimizer_in_backward"] = True
    if not compile:
        options["compile_mode"] = "default"
    if not options.get("master_weights") or runner != "lightning":
        options["optimizer_state_dtype"] = "float32"
    if options.get("float8", "none") == "none":  # one bf16 cell, whatever the float8 flags
        options["float8_head"] = False
        options["float8_min_features"] = Cell.defaults["float8_min_features"]
    return Cell(size=size, context=context, batch_size=batch, precision=precision, attention=attention,
                compile=compile, mode=mode, warmup=warmup, steps=steps, vocab_size=vocab_size, runner=runner,
                **options)


def cells_from_values(values: dict[str, Any]) -> list[Cell]:
    """The product of the flag lists, validated, in a stable order (sizes outermost)."""
    sizes: list[str] = []
    for s in values["sizes"]:
        sizes.extend(STUDY_SIZES if s in ("study", "seed") else [s])  # "seed": the former name
    for s in sizes:
        if s not in SIZES and not _is_yaml(s):
            raise LmtrainError("--sizes", f"unknown size {s!r}.", f"use {', '.join(SIZES)} or a config YAML path.")
    for p in values["precision"]:
        if p not in PRECISIONS:
            raise LmtrainError("--precision", f"unknown precision {p!r}.", f"use {', '.join(PRECISIONS)}.")
    for m in values["mode"]:
        if m not in STEP_MODES:
            raise LmtrainError("--mode", f"unknown mode {m!r}.", f"use {', '.join(STEP_MODES)}.")
    for c in values["compile"]:
        if c not in ("on", "off"):
            raise LmtrainError("--compile", f"expected on or off, got {c!r}.", "use --compile off,on.")
    for v in values["runner"]:
        if v not in RUNNERS:
            raise LmtrainError("--runner", f"unknown value {v!r}.", f"use {', '.join(RUNNERS)}.")
    from lmtrain.attention import available_backends

    for a in values["attention"]:
        if a not in available_backends():
            raise LmtrainError("--attention", f"unknown backend {a!r}.", f"use {', '.join(available_backends())}.")
    names = list(Cell.defaults)[:-1]  # the step options (runner is the last field)
    choices = [[_option_value(name, v) for v in values[name]] for name in names]
    cells = list(dict.fromkeys(
        _cell(s, t, b, p, a, c == "on", m, w, n, values["vocab_size"], dict(zip(names, opts, strict=True)), r)
        for s in sizes for p in values["precision"] for a in values["attention"] for c in values["compile"]
        for m in values["mode"] for opts in itertools.product(*choices) for b in values["batch_size"]
        for t in sorted(values["contexts"]) for w in values["warmup"] for n in values["steps"]
        for r in values["runner"]
    ))
    for c in cells:
        for flag, value, least in (("--contexts", c.context, 1), ("--batch-size", c.batch_size, 1),
                                   ("--steps", c.steps, 1), ("--warmup", c.warmup, 0)):
            if value < least:
                raise LmtrainError(flag, f"cell {c.slug} has {flag.removeprefix('--')} {value}.",
                                   f"use {flag} of at least {least}.")
    return cells


def command_line(args: argparse.Namespace | None = None) -> str:
    """The command that is running, as ``python -m lmtrain ...`` (for reports): as the command line passed it to
    ``main``, else from ``sys.argv``."""
    given = getattr(args, "command_line", None)
    return given if given else "python -m lmtrain " + shlex.join(sys.argv[1:])


def run(args: argparse.Namespace) -> int:
    cells, per_study, stop_after_oom = plan_cells(args)
    logdir = None if str(args.logdir).lower() == "none" else args.logdir
    print(f"{len(cells)} cells -> {args.out}", file=sys.stderr)
    try:
        rows = run_sweep(cells, args.out, launcher=args.launcher, timeout=args.timeout, logdir=logdir,
                         retry_failed=args.retry_failed, stop_after_oom=stop_after_oom,
                         max_minutes=args.max_minutes, meta={"command": command_line(args)},
                         skip_unfit_gib=args.skip_unfit)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"stopped by Ctrl-C; the cells finished so far are in {args.out} "
                                "(rerun the same command to resume).") from None
    print(markdown_rows(rows))
    by_key = {r["key"]: r for r in rows}
    for name, study_cells in per_study.items():
        print()
        print(STUDIES[name].render([by_key[c.key()] for c in study_cells if c.key() in by_key]))
    return 0
