"""Sweep sizes x contexts x precisions x modes: step times, tokens/s, MFU, peak memory and the memory plan.

Every cell of the sweep (one size, context, batch size, precision, attention backend, compile flag, step
mode, warm-up and step count) trains the real ``LMModule`` on ``LMDataModule(source="synthetic")`` with a
real ``Trainer.fit`` and ``lmtrain.callbacks.CudaSyncTimer``, so a number in the table means what it means
in TensorBoard. Each cell runs in a fresh process: an out-of-memory cell is recorded as ``OOM``, a crash
as ``error: <first line>``, a cell over ``--timeout`` as ``timeout``, and the sweep goes on; memory
fragmentation of one cell never reaches the next.

Processes: by default (``--launcher fork``) cells are forked from this process, which has imported torch
and Lightning but never touched CUDA, so a cell starts in about a second instead of re-importing
everything; ``--launcher spawn`` starts ``python -m lmtrain.bench._cell`` instead (used automatically when
CUDA is already initialised here, since a forked child must never inherit a CUDA context). Results come
back as a JSON file per cell; a cell's stdout and stderr go to ``<out>_cells/<cell>.log``.

Output: a Markdown table on stdout (one row per cell; columns ``MARKDOWN_COLUMNS``), ``--out`` as CSV (all
``CSV_COLUMNS``) with the same rows as JSON beside it (``.json``), TensorBoard logs under ``--logdir``.
Rerunning with the same ``--out`` skips finished cells (matched on every cell parameter); ``--retry-failed``
runs error and timeout cells again. Studies (``--study NAME``, see ``lmtrain.bench.studies``) preset the
sweep flags and add their own tables; flags given explicitly override the preset. Defaults: warm-up 3 steps,
10 measured steps, batch size 4, vocabulary 10000 (the seeds' setup), fp32, sdpa attention.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from lmtrain.analysis.tables import markdown_table
from lmtrain.config import SEED_SIZES, SIZES, ModelConfig
from lmtrain.errors import LmtrainError
from lmtrain.flops import STEP_MODES, parameter_count
from lmtrain.memory_plan import GIB, PRECISIONS, estimate_memory

#: Environment variable for tests: ``"key=value,key=value:kind;..."`` makes matching cells fail on purpose
#: (kind ``oom`` raises ``torch.OutOfMemoryError``, ``crash`` raises ``RuntimeError``, ``exit`` ends the
#: process with status 3, ``hang`` sleeps past the timeout).
FAIL_ENV = "LMTRAIN_BENCH_FAIL"

#: Defaults of the sweep flags (a study's preset and then explicit flags override them).
DEFAULTS: dict[str, Any] = {
    "sizes": ["small"], "contexts": [512], "batch_size": [4], "precision": ["32-true"], "attention": ["sdpa"],
    "compile": ["off"], "mode": ["forward_backward"], "warmup": [3], "steps": [10], "vocab_size": 10_000,
}

#: Columns of the CSV and JSON rows.
CSV_COLUMNS = [
    "size", "params", "context", "batch_size", "precision", "attention", "compile", "mode", "warmup", "steps",
    "vocab_size", "status", "error",
    "forward_ms_mean", "forward_ms_std", "backward_ms_mean", "backward_ms_std", "optimizer_ms_mean",
    "optimizer_ms_std", "step_ms_mean", "step_ms_std", "step_ms_median", "step_ms_min", "step_ms_max",
    "first_step_ms", "tokens_per_s", "mfu", "peak_gib", "reserved_gib", "estimate_gib", "estimate_error_pct",
    "wall_s", "device", "device_memory_gib",
]

#: Columns of the Markdown table printed on stdout (one row per cell).
MARKDOWN_COLUMNS = [
    "size", "params", "context", "batch", "precision", "attention", "compile", "mode", "forward ms", "backward ms",
    "optimizer ms", "step ms", "tokens/s", "MFU", "peak GiB", "estimate GiB", "status",
]

_DONE_STATUSES = ("ok", "OOM", "error", "timeout", "skipped")


@dataclass(frozen=True)
class Cell:
    """One point of the sweep. ``size`` is a named size or a config YAML path."""

    size: str
    context: int
    batch_size: int
    precision: str
    attention: str
    compile: bool
    mode: str
    warmup: int
    steps: int
    vocab_size: int = 10_000

    def key(self) -> str:
        """Identity of the cell in a results file (every parameter)."""
        return json.dumps(asdict(self), sort_keys=True)

    @property
    def label(self) -> str:
        """Short name of the size (a YAML path's stem)."""
        return Path(self.size).stem if _is_yaml(self.size) else self.size

    @property
    def slug(self) -> str:
        """File-name-safe name of the cell."""
        c = "compiled" if self.compile else "eager"
        text = (f"{self.label}_T{self.context}_B{self.batch_size}_{self.precision}_{self.attention}_{c}_{self.mode}"
                f"_w{self.warmup}_s{self.steps}")
        return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in text)


def _is_yaml(size: str) -> bool:
    return size.endswith((".yaml", ".yml"))


# -- cell configuration (shared by the parent, the child and the planner) -------------------------------------


def module_kwargs(cell: Cell) -> dict[str, Any]:
    """``LMModule`` arguments of a cell: the size (or the YAML's ``model`` section) plus the sweep's values."""
    kwargs: dict[str, Any] = {"size": cell.size, "vocab_size": cell.vocab_size}
    if _is_yaml(cell.size):
        import yaml

        path = Path(cell.size)
        if not path.is_file():
            raise LmtrainError("--sizes", f"config {cell.size} does not exist.", "give a named size or a YAML path.")
        model = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
        kwargs = {k: v for k, v in model.items() if k not in ("context_length", "attention", "compile", "step_mode")}
    kwargs.update(context_length=cell.context, attention=cell.attention, compile=cell.compile, step_mode=cell.mode)
    return kwargs


_CONFIG_KEYS = ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff", "rope_theta",
                "attention", "activation_checkpointing")


def cell_config(cell: Cell) -> ModelConfig:
    """The ``ModelConfig`` a cell's ``LMModule`` builds (no torch model is created)."""
    kw = module_kwargs(cell)
    return ModelConfig.from_size(kw.get("size", "small"), **{k: kw[k] for k in _CONFIG_KEYS if k in kw})


# -- the child: one cell --------------------------------------------------------------------------------------


def _make_timer(warmup: int) -> Any:
    """The timing callback of a cell (tests replace this module attribute with a stub)."""
    from lmtrain.callbacks.timer import CudaSyncTimer

    return CudaSyncTimer(warmup_steps=warmup, sync="events", peak_flops=None, log_every_n_steps=1,
                         print_summary=False)


def _inject_failure(cell: Cell) -> None:
    spec = os.environ.get(FAIL_ENV, "")
    values = {k: str(v) for k, v in asdict(cell).items()}
    for item in filter(None, spec.split(";")):
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


def measure_cell(cell: Cell, logdir: str | None, on_result: Any = None) -> dict[str, Any]:
    """Run one cell in this process and return its measurements (raises on failure).

    ``on_result(row)``, when given, is called at the end of the last step (``on_train_end``), before
    Lightning's teardown: a cell process uses it to write its result and exit at once, skipping the copy of
    the model and optimizer state back to the CPU (tens of seconds for 2.7B) that the table does not need.
    """
    import warnings

    import lightning.pytorch as pl
    import torch

    from lmtrain.data import LMDataModule
    from lmtrain.module import LMModule

    warnings.filterwarnings("ignore", module="lightning")  # worker-count and logging hints; the table says it all
    _inject_failure(cell)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    total = cell.warmup + cell.steps
    module = LMModule(**module_kwargs(cell))
    data = LMDataModule(source="synthetic", batch_size=cell.batch_size, context_length=cell.context,
                        vocab_size=module.config.vocab_size, train_batches=total, val_batches=1)
    timer = _make_timer(cell.warmup)
    logger: Any = False
    if logdir:
        from lightning.pytorch.loggers import TensorBoardLogger

        logger = TensorBoardLogger(logdir, name=cell.slug, version="")
    result: dict[str, Any] = {}

    class _Collect(pl.Callback):  # after the timer in the callback list: its summary is complete here
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            result.update(_result_row(cell, timer, module))
            for lg in trainer.loggers:
                lg.finalize("success")
            if on_result is not None:
                on_result(result)

    trainer = pl.Trainer(
        accelerator="auto", devices=1, precision=cell.precision, max_steps=total, max_epochs=1,
        limit_val_batches=0, num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, logger=logger, callbacks=[timer, _Collect()], log_every_n_steps=1,
        default_root_dir=logdir or None,
    )
    trainer.fit(module, datamodule=data)
    return result


def _result_row(cell: Cell, timer: Any, module: Any) -> dict[str, Any]:
    """Times, throughput, MFU and memory peaks of a finished cell."""
    import torch

    from lmtrain.flops import flops_per_step, mfu, peak_flops

    cuda = torch.cuda.is_available()
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
    device = torch.cuda.get_device_name() if cuda else "cpu"
    row["device"] = device
    step_ms = row.get("step_ms_mean")
    if step_ms:
        tokens = cell.batch_size * cell.context
        row["tokens_per_s"] = tokens / (step_ms / 1e3)
        flops = flops_per_step(module.config, cell.batch_size, cell.context, mode=cell.mode)
        row["mfu"] = mfu(flops, step_ms / 1e3, peak_flops(device, cell.precision)) if cuda else None
    if cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        row["reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        row["device_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / GIB
    return row


def _is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def run_cell_to_file(cell: Cell, logdir: str | None, result_path: str) -> None:
    """Child entry point: measure ``cell`` and write the result (or the failure) as JSON to ``result_path``."""
    def write(row: dict[str, Any]) -> None:
        tmp = result_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(row, f)
        os.replace(tmp, result_path)

    def write_and_exit(row: dict[str, Any]) -> None:
        write({**row, "status": "ok"})
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # a cell process: no teardown needed, the GPU memory goes with the process

    try:
        row = measure_cell(cell, logdir, on_result=write_and_exit)
    except BaseException as exc:  # noqa: BLE001 (every failure becomes a table row; the parent goes on)
        first = (str(exc).strip().splitlines() or [""])[0]
        if _is_oom(exc):
            row = {"status": "OOM", "error": first[:300]}
        else:
            traceback.print_exc()
            row = {"status": "error", "error": f"{type(exc).__name__}: {first}"[:300]}
    write(row)


def _child_main(cell_dict: dict[str, Any], logdir: str | None, result_path: str, log_path: str) -> None:
    """Forked child: send stdout/stderr to the cell's log file, then run the cell."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    run_cell_to_file(Cell(**cell_dict), logdir, result_path)
    sys.stdout.flush()
    sys.stderr.flush()


# -- the parent: launching cells ------------------------------------------------------------------------------


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _bad_fork(row: dict[str, Any]) -> bool:
    text = str(row.get("error") or "").lower()
    return row.get("status") == "error" and "cuda" in text and ("forked subprocess" in text or "initializ" in text)


def launch_cell(cell: Cell, launcher: str, timeout: float, logdir: str | None, work_dir: Path) -> dict[str, Any]:
    """Run one cell in a fresh process and return its row fields (status, times, memory, error)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    result_path = work_dir / f"{cell.slug}.json"
    log_path = work_dir / f"{cell.slug}.log"
    result_path.unlink(missing_ok=True)
    start = time.perf_counter()
    exitcode: int | None
    if launcher == "fork":
        import multiprocessing

        proc = multiprocessing.get_context("fork").Process(
            target=_child_main, args=(asdict(cell), logdir, str(result_path), str(log_path)), daemon=False)
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            exitcode = None
        else:
            exitcode = proc.exitcode
    else:
        import subprocess

        cmd = [sys.executable, "-m", "lmtrain.bench._cell", json.dumps(asdict(cell)), logdir or "", str(result_path)]
        with open(log_path, "w") as log:
            try:
                exitcode = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                exitcode = None
    wall = time.perf_counter() - start
    if exitcode is None:
        row: dict[str, Any] = {"status": "timeout", "error": f"no result within --timeout {timeout:g} s"}
    elif result_path.is_file():
        row = json.loads(result_path.read_text())
    else:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] if log_path.is_file() else []
        row = {"status": "error", "error": f"process exited with status {exitcode}"
               + (f" ({tail[0][:200]})" if tail else "")}
    row["wall_s"] = wall
    return row


# -- rows, files, tables --------------------------------------------------------------------------------------


def base_row(cell: Cell) -> dict[str, Any]:
    """The parameters of a cell as a row, with parameter count and the memory plan (GiB)."""
    row: dict[str, Any] = {k: v for k, v in asdict(cell).items()}
    row["size"] = cell.label
    row["compile"] = "on" if cell.compile else "off"
    row["key"] = cell.key()
    try:
        cfg = cell_config(cell)
        row["params"] = parameter_count(cfg)
        row["vocab_size"] = cfg.vocab_size
        if cell.precision in PRECISIONS:
            plan = estimate_memory(cfg, cell.batch_size, cell.context, cell.precision, cell.mode)
            row["estimate_gib"] = plan.peak_gib
    except LmtrainError:
        pass
    return row


def finish_row(row: dict[str, Any]) -> dict[str, Any]:
    """Add derived columns (estimate error) and the empty ones."""
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


def versions() -> dict[str, str]:
    """torch, triton, lightning, CUDA, driver and Python versions (of this process; cells run with the same)."""
    import platform

    import lightning
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__,
            "CUDA (torch build)": str(torch.version.cuda)}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "not installed"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "n/a"
    except (OSError, subprocess.SubprocessError):
        info["driver"] = "n/a"
    return info


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
            "environment": versions()}


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


def fmt_ms(row: dict[str, Any], phase: str) -> str:
    """``mean ± std`` in ms, or ``-``."""
    mean = row.get(f"{phase}_ms_mean")
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "-"
    return f"{mean:.2f} ± {row.get(f'{phase}_ms_std') or 0.0:.2f}"


def fmt(value: Any, spec: str) -> str:
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def status_text(row: dict[str, Any]) -> str:
    """``ok``, ``OOM``, ``timeout`` or ``error: <first line>``."""
    status = row.get("status") or "?"
    if status in ("error", "skipped") and row.get("error"):
        return f"{status}: {row['error']}".replace("|", "/")
    return status


def markdown_rows(rows: list[dict[str, Any]]) -> str:
    """The per-cell Markdown table (columns ``MARKDOWN_COLUMNS``)."""
    body = []
    for r in rows:
        body.append([
            r.get("size"), fmt(r.get("params"), ","), r.get("context"), r.get("batch_size"), r.get("precision"),
            r.get("attention"), r.get("compile"), r.get("mode"), fmt_ms(r, "forward"), fmt_ms(r, "backward"),
            fmt_ms(r, "optimizer"), fmt_ms(r, "step"), fmt(r.get("tokens_per_s"), ",.0f"), fmt(r.get("mfu"), ".1%"),
            fmt(r.get("peak_gib"), ".2f"), fmt(r.get("estimate_gib"), ".2f"), status_text(r),
        ])
    return markdown_table(MARKDOWN_COLUMNS, body)


# -- the sweep ------------------------------------------------------------------------------------------------


def _bigger_failed(cell: Cell, failed: list[Cell]) -> Cell | None:
    """An OOM cell equal to ``cell`` except for a smaller-or-equal context and batch size."""
    for f in failed:
        same = all(getattr(f, k.name) == getattr(cell, k.name) for k in fields(Cell)
                   if k.name not in ("context", "batch_size"))
        if same and f.context <= cell.context and f.batch_size <= cell.batch_size:
            return f
    return None


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

    Returns:
        The rows of ``cells`` (finished ones; cells not run because of ``max_minutes`` are absent).
    """
    if launcher == "fork" and _cuda_initialised():
        print("note: CUDA is initialised in this process; cells are spawned, not forked", file=sys.stderr)
        launcher = "spawn"
    unique = list(dict.fromkeys(cells))
    existing = {r["key"]: r for r in load_results(out) if r.get("key")}
    rerun = ("error", "timeout") if retry_failed else ()
    todo = [c for c in unique if c.key() not in existing or existing[c.key()].get("status") in rerun]
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
        if smaller is not None:
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


def _list(kind: type) -> Any:
    def parse(text: str) -> list[Any]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        try:
            return [kind(s) for s in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}: {text!r}") from None

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lmtrain.bench.studies import STUDIES

    parser.add_argument("--study", action="append", choices=sorted(STUDIES), default=[],
                        help="a ready-made study (repeatable): presets the flags below and adds its tables")
    parser.add_argument("--sizes", type=_list(str), help=f"named sizes ({', '.join(SIZES)}), 'seed' for "
                        f"{','.join(SEED_SIZES)}, or config YAML paths (default small)")
    parser.add_argument("--contexts", type=_list(int), help="tokens per sequence (default 512)")
    parser.add_argument("--batch-size", type=_list(int), help="sequences per batch (default 4)")
    parser.add_argument("--precision", type=_list(str), help=f"Lightning precisions: {', '.join(PRECISIONS)} "
                        "(default 32-true)")
    parser.add_argument("--attention", type=_list(str), help="attention backends (default sdpa)")
    parser.add_argument("--compile", type=_list(str), help="off, on or off,on (default off)")
    parser.add_argument("--mode", type=_list(str), help=f"step modes: {', '.join(STEP_MODES)} "
                        "(default forward_backward)")
    parser.add_argument("--warmup", type=_list(int), help="warm-up steps excluded from the statistics (default 3)")
    parser.add_argument("--steps", type=_list(int), help="measured steps (default 10)")
    parser.add_argument("--vocab-size", type=int, help="vocabulary of named sizes (default 10000)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/model.csv"),
                        help="results CSV (JSON beside it; rerun with the same path to resume)")
    parser.add_argument("--logdir", default="logs/bench", help="TensorBoard folder ('none': no logs)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per cell before it is killed")
    parser.add_argument("--launcher", choices=("fork", "spawn"), default="fork", help="how cells get a process")
    parser.add_argument("--retry-failed", action="store_true", help="run error and timeout cells again")
    parser.add_argument("--stop-after-oom", action="store_true", default=None,
                        help="skip cells larger than one that ran out of memory")
    parser.add_argument("--max-minutes", type=float, help="launch no new cell after this many minutes")


def sweep_values(args: argparse.Namespace, study: str | None = None) -> dict[str, Any]:
    """Flag values: defaults, then the study's preset, then the flags given explicitly."""
    from lmtrain.bench.studies import STUDIES

    values = {**DEFAULTS, "stop_after_oom": False}
    if study is not None:
        values.update(STUDIES[study].preset)
    for k in list(values):
        given = getattr(args, k, None)
        if given is not None:
            values[k] = given
    return values


def plan_cells(args: argparse.Namespace) -> tuple[list[Cell], dict[str, list[Cell]], bool]:
    """All cells of a command line (the union of its studies), each study's cells, and stop-after-OOM."""
    if not args.study:
        values = sweep_values(args)
        return cells_from_values(values), {}, bool(values["stop_after_oom"])
    per_study = {}
    stop = False
    for name in dict.fromkeys(args.study):
        values = sweep_values(args, name)
        per_study[name] = cells_from_values(values)
        stop = stop or bool(values["stop_after_oom"])
    union = list(dict.fromkeys(c for cells in per_study.values() for c in cells))
    return union, per_study, stop


def cells_from_values(values: dict[str, Any]) -> list[Cell]:
    """The product of the flag lists, validated, in a stable order (sizes outermost)."""
    sizes: list[str] = []
    for s in values["sizes"]:
        sizes.extend(SEED_SIZES if s == "seed" else [s])
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
    from lmtrain.attention import available_backends

    for a in values["attention"]:
        if a not in available_backends():
            raise LmtrainError("--attention", f"unknown backend {a!r}.", f"use {', '.join(available_backends())}.")
    cells = [
        Cell(size=s, context=t, batch_size=b, precision=p, attention=a, compile=c == "on", mode=m, warmup=w,
             steps=n, vocab_size=values["vocab_size"])
        for s in sizes for p in values["precision"] for a in values["attention"] for c in values["compile"]
        for m in values["mode"] for b in values["batch_size"] for t in sorted(values["contexts"])
        for w in values["warmup"] for n in values["steps"]
    ]
    for c in cells:
        if c.steps < 1 or c.warmup < 0 or c.context < 1 or c.batch_size < 1:
            raise LmtrainError("--steps", f"cell {c.slug} has steps={c.steps}, warmup={c.warmup}.",
                               "use steps >= 1, warmup >= 0, positive contexts and batch sizes.")
    return cells


def command_line(args: argparse.Namespace | None = None) -> str:
    """The command that is running, as ``python -m lmtrain ...`` (for reports): as the command line passed it to
    ``main``, else from ``sys.argv``."""
    given = getattr(args, "command_line", None)
    return given if given else "python -m lmtrain " + shlex.join(sys.argv[1:])


def run(args: argparse.Namespace) -> int:
    from lmtrain.bench.studies import STUDIES

    cells, per_study, stop_after_oom = plan_cells(args)
    logdir = None if str(args.logdir).lower() == "none" else args.logdir
    print(f"{len(cells)} cells -> {args.out}", file=sys.stderr)
    rows = run_sweep(cells, args.out, launcher=args.launcher, timeout=args.timeout, logdir=logdir,
                     retry_failed=args.retry_failed, stop_after_oom=stop_after_oom,
                     max_minutes=args.max_minutes, meta={"command": command_line(args)})
    print(markdown_rows(rows))
    by_key = {r["key"]: r for r in rows}
    for name, study_cells in per_study.items():
        print()
        print(STUDIES[name].render([by_key[c.key()] for c in study_cells if c.key() in by_key]))
    return 0
