"""Run the studies that fit a time budget and write one Markdown report: tables, device, versions, commands, plots;
or, with ``--records``, write the current-numbers page from the newest records.

    python -m lmtrain bench report --out benchmarks/2026-11-23-H100-model.md --budget-min 20 \\
        [--studies timing precision memory compile] [--steps 5] [--warmup 2]
    python -m lmtrain bench report --records benchmarks --out docs/performance.md

The studies are those of ``python -m lmtrain bench model --study NAME`` (``lmtrain.bench.studies``). Before
running, one probe cell (small, context 128, forward) measures the per-cell start-up cost and the FLOP/s this
device reaches; each study's time is then estimated from its cell count and FLOPs (fp16/bf16 cells scaled by
the device's peak ratio, cells whose memory plan exceeds the device marked as quick OOMs, a fixed
``COMPILE_SECONDS`` per compiled cell), and the studies are run in the order given while they fit the budget.
Studies that do not fit are named in the report with their estimate. All cells go to one results file
(``--results``, default: the report's path with ``.csv``), so an interrupted report resumes, and
``--no-run`` writes the report from the results already there. Plots (PNG, beside the report): step time vs
context per size, and measured peak memory vs context with the memory plan.

``--records DIR`` runs nothing: it writes ``--out`` from the newest record of each kind in DIR
(``lmtrain.bench.performance``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path
from typing import Any

from lmtrain.bench.environment import environment
from lmtrain.bench.model import (
    Cell,
    base_row,
    cell_config,
    cells_of_study,
    comma_list,
    command_line,
    load_meta,
    load_results,
    run_sweep,
    with_current_plan,
)
from lmtrain.bench.performance import write_performance
from lmtrain.bench.studies import STUDIES
from lmtrain.bench.tables import markdown_rows
from lmtrain.errors import LmtrainError
from lmtrain.flops import flops_per_step
from lmtrain.memory_plan import GIB

#: Seconds added per compiled cell to the time estimate (torch.compile of forward and backward graphs).
COMPILE_SECONDS = 60.0

DEFAULT_STUDIES = ["timing", "precision", "memory", "warmup", "compile", "attention-backends"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="the Markdown report (PNG plots go beside it)")
    parser.add_argument("--budget-min", type=float, default=20.0, help="minutes of benchmarking allowed")
    parser.add_argument("--studies", nargs="+", choices=sorted(STUDIES), default=DEFAULT_STUDIES,
                        help="studies to run, in priority order")
    parser.add_argument("--results", type=Path, help="results CSV shared by all studies (default: OUT with .csv)")
    parser.add_argument("--warmup", type=comma_list(int), help="override every study's")
    parser.add_argument("--steps", type=comma_list(int), help="override every study's")
    parser.add_argument("--sizes", type=comma_list(str), help="override every study's sizes")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per cell")
    parser.add_argument("--launcher", choices=("fork", "spawn"), default="fork")
    parser.add_argument("--logdir", default="none", help="TensorBoard folder ('none': no logs)")
    parser.add_argument("--no-run", action="store_true", help="write the report from the results file only")
    parser.add_argument("--records", type=Path,
                        help="run nothing: write OUT as the current-numbers page from the newest records in this "
                             "folder (e.g. --records benchmarks --out docs/performance.md)")


def _study_args(args: argparse.Namespace, name: str) -> argparse.Namespace:
    keys = ["sizes", "contexts", "batch_size", "precision", "attention", "compile", "mode", "warmup", "steps",
            "vocab_size", "stop_after_oom"]
    ns = argparse.Namespace(**{k: getattr(args, k, None) for k in keys})
    ns.study = [name]
    return ns


def study_cells(args: argparse.Namespace) -> dict[str, list[Cell]]:
    """Each requested study's cells, with the report's overrides applied."""
    return {name: cells_of_study(_study_args(args, name), name)[0] for name in args.studies}


def study_command(args: argparse.Namespace, name: str, results: Path) -> str:
    """The ``bench model`` command that runs one study of the report into the same results file."""
    parts = ["python -m lmtrain bench model", f"--study {name}", f"--out {results}"]
    for flag, key in (("--sizes", "sizes"), ("--warmup", "warmup"), ("--steps", "steps")):
        if getattr(args, key, None):
            parts.append(f"{flag} {','.join(str(v) for v in getattr(args, key))}")
    return " ".join(parts)


def estimate_seconds(cells: list[Cell], probe: dict[str, Any], probe_cell: Cell, done: set[str]) -> float:
    """Seconds to run ``cells`` (those not in ``done``), from the probe cell's start-up time and FLOP/s."""
    from lmtrain.flops import peak_flops

    step_s = (probe.get("step_ms_mean") or 0.0) / 1e3
    n_probe = probe_cell.warmup + probe_cell.steps
    overhead = max(0.5, (probe.get("wall_s") or 1.0) - n_probe * step_s)
    cfg = cell_config(probe_cell)
    probe_flops = flops_per_step(cfg, probe_cell.batch_size, probe_cell.context, probe_cell.mode)
    rate = probe_flops / step_s if step_s > 0 else 1e12
    device = probe.get("device") or "cpu"
    memory = (probe.get("device_memory_gib") or 0.0) * GIB
    total = 0.0
    for cell in cells:
        if cell.key() in done:
            continue
        row = base_row(cell)
        if memory and (row.get("estimate_gib") or 0.0) * GIB > memory:
            total += overhead
            continue
        speed = rate
        p32, p16 = peak_flops(device, "32-true"), peak_flops(device, cell.precision)
        if p32 and p16:
            speed = rate * p16 / p32
        flops = flops_per_step(cell_config(cell), cell.batch_size, cell.context, cell.mode)
        total += overhead + (cell.warmup + cell.steps) * flops / speed + (COMPILE_SECONDS if cell.compile else 0.0)
    return total


# -- plots ----------------------------------------------------------------------------------------------------


def _series(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows split into lines: one per size (and attention backend / batch size where those vary), one point per
    context (where several studies measured the same point, the cell with the most measured steps)."""
    vary_attn = len({r["attention"] for r in rows}) > 1
    vary_batch = len({r["batch_size"] for r in rows}) > 1
    lines: dict[str, dict[int, dict[str, Any]]] = {}
    for r in rows:
        label = str(r["size"]) + (f" {r['attention']}" if vary_attn else "") + (f" B{r['batch_size']}" if vary_batch
                                                                                else "")
        points = lines.setdefault(label, {})
        old = points.get(r["context"])
        if old is None or (r.get("steps") or 0) > (old.get("steps") or 0):
            points[r["context"]] = r
    return {label: [pts[t] for t in sorted(pts)] for label, pts in lines.items()}


def _context_axis(ax: Any, contexts: list[int]) -> None:
    """Log-scaled context axis labelled with the measured contexts themselves."""
    from matplotlib.ticker import NullFormatter, NullLocator

    ax.set_xscale("log")
    ticks = sorted(set(contexts))
    ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=7)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("context (tokens)")


def plot_step_times(rows: list[dict[str, Any]], path: Path) -> bool:
    """Step time vs context, one line per size, one panel per (precision, mode). False when nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok" and r.get("step_ms_mean") and r.get("compile") == "off"]
    groups = sorted({(r["precision"], r["mode"]) for r in ok})
    groups = [g for g in groups if len({r["context"] for r in ok if (r["precision"], r["mode"]) == g}) > 1]
    if not groups:
        return False
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.8), squeeze=False)
    for ax, (precision, mode) in zip(axes[0], groups, strict=True):
        sel = [r for r in ok if (r["precision"], r["mode"]) == (precision, mode)]
        for label, pts in _series(sel).items():
            ax.plot([r["context"] for r in pts], [r["step_ms_mean"] for r in pts], marker="o", label=label)
        _context_axis(ax, [r["context"] for r in sel])
        ax.set(yscale="log", ylabel="step time (ms)", title=f"{mode}, {precision}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_memory(rows: list[dict[str, Any]], path: Path) -> bool:
    """Measured peak (solid) and memory plan (dashed) vs context: one panel per size, a line per precision x mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r.get("estimate_gib") is not None and r.get("compile") == "off"]
    sizes = [s for s in dict.fromkeys(r["size"] for r in sel) if any(r.get("peak_gib") for r in sel if r["size"] == s)]
    if not sizes:
        return False
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes), 3.8), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        mine = [r for r in sel if r["size"] == size]
        groups = list(dict.fromkeys((r["precision"], r["mode"], r["attention"], r["batch_size"]) for r in mine))
        many_attn, many_batch = len({g[2] for g in groups}) > 1, len({g[3] for g in groups}) > 1
        for i, g in enumerate(groups):
            line = [r for r in mine if (r["precision"], r["mode"], r["attention"], r["batch_size"]) == g]
            pts = next(iter(_series(line).values()))
            color = f"C{i % 10}"
            measured = [r for r in pts if r.get("peak_gib")]
            label = f"{g[0]} {g[1]}" + (f" {g[2]}" if many_attn else "") + (f" B{g[3]}" if many_batch else "")
            ax.plot([r["context"] for r in measured], [r["peak_gib"] for r in measured], marker="o", color=color,
                    label=label)
            ax.plot([r["context"] for r in pts], [r["estimate_gib"] for r in pts], linestyle="--", marker=".",
                    color=color)
            oom = [r for r in pts if r.get("status") == "OOM"]
            if oom:
                ax.scatter([r["context"] for r in oom], [r["estimate_gib"] for r in oom], marker="x", color=color, s=60)
        _context_axis(ax, [r["context"] for r in mine])
        ax.set(ylabel="GiB", title=size)
        ax.legend(fontsize=6)
    fig.suptitle("peak memory: measured (solid), plan (dashed), OOM (x at the plan)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- the report -----------------------------------------------------------------------------------------------


def write_report(
    out: Path,
    per_study: dict[str, list[dict[str, Any]]],
    commands: list[str],
    info: dict[str, str],
    skipped: dict[str, str] | None = None,
    notes: list[str] | None = None,
) -> list[Path]:
    """Write the Markdown report and its PNG plots; returns the files written.

    Args:
        out: the report's path.
        per_study: study name -> its rows (from the results file).
        commands: the exact commands that produced the results.
        info: device and version lines (name -> value).
        skipped: study name -> why it was not run.
        notes: free-form lines added under the header.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    all_rows = list({r["key"]: r for rows in per_study.values() for r in rows}.values())
    devices = sorted({r["device"] for r in all_rows if r.get("device")})
    date = info.get("date") or dt.date.today().isoformat()
    lines = [f"# Model benchmarks: {date}, {', '.join(devices) or 'unknown device'}", ""]
    lines += ["| item | value |", "| --- | --- |"]
    lines += [f"| device | {', '.join(devices) or 'n/a'} |"] + [f"| {k} | {v} |" for k, v in info.items()
                                                                if k != "date"]
    lines += ["", "Commands:", "", "```"] + commands + ["```", ""]
    lines += [f"- {n}" for n in notes or []] + ([""] if notes else [])
    if skipped:
        lines += ["Studies not run:", ""] + [f"- `{k}`: {v}" for k, v in skipped.items()] + [""]
    for name, rows in per_study.items():
        lines += [f"## {STUDIES[name].title} (`--study {name}`)", ""]
        if skipped and name in skipped:
            lines += [f"Partial: this report did not run the study ({skipped[name]}); the cells below come from "
                      "an earlier run into the same results file.", ""]
        lines += [STUDIES[name].render(rows) if rows else "No cells of this study have results.", ""]
    written = [out]
    plots = []
    step_png = out.with_name(out.stem + "_step_time.png")
    if plot_step_times(all_rows, step_png):
        plots.append(("Step time vs context", step_png))
    mem_png = out.with_name(out.stem + "_memory.png")
    if plot_memory(all_rows, mem_png):
        plots.append(("Peak memory vs context, with the memory plan", mem_png))
    if plots:
        lines += ["## Plots", ""] + [f"![{title}]({p.name})" for title, p in plots] + [""]
        written += [p for _, p in plots]
    lines += ["## All cells", "", markdown_rows(all_rows), ""]
    out.write_text("\n".join(lines))
    return written


def run(args: argparse.Namespace) -> int:
    if args.records is not None:
        if not args.records.is_dir():
            raise LmtrainError("--records", f"{args.records} is not a folder.",
                               "give the folder that holds the JSON records (e.g. --records benchmarks).")
        print(write_performance(args.records, args.out))
        return 0
    results = args.results or args.out.with_suffix(".csv")
    per_cells = study_cells(args)
    logdir = None if str(args.logdir).lower() == "none" else args.logdir
    skipped: dict[str, str] = {}
    commands = [command_line(args)]
    if not args.no_run:
        done = {r["key"] for r in load_results(results) if r.get("status")}
        probe_cell = Cell("small", 128, 4, "32-true", "sdpa", False, "forward", 1, 2)
        probe = run_sweep([probe_cell], results, launcher=args.launcher, timeout=args.timeout, logdir=None)[0]
        done.add(probe_cell.key())
        budget = args.budget_min * 60 - (probe.get("wall_s") or 0.0)
        for name, cells in per_cells.items():
            need = estimate_seconds(cells, probe, probe_cell, done)
            if need > budget:
                skipped[name] = f"estimated {need / 60:.1f} min, {max(budget, 0) / 60:.1f} min of the budget left"
                print(f"skipping study {name}: {skipped[name]}", file=sys.stderr)
                continue
            print(f"study {name}: {len(cells)} cells, estimated {need / 60:.1f} min", file=sys.stderr)
            t0 = dt.datetime.now()
            run_sweep(cells, results, launcher=args.launcher, timeout=args.timeout, logdir=logdir,
                      stop_after_oom=bool(STUDIES[name].preset.get("stop_after_oom")),
                      meta={"command": commands[0]})
            budget -= (dt.datetime.now() - t0).total_seconds()
            done.update(c.key() for c in cells)
            commands.append(study_command(args, name, results))
    by_key = {r["key"]: with_current_plan(r) for r in load_results(results)}
    # A skipped study still shows the cells an earlier run (same results file) measured, marked as partial.
    per_study = {name: [by_key[c.key()] for c in cells if c.key() in by_key] for name, cells in per_cells.items()}
    per_study = {name: rows for name, rows in per_study.items() if rows or name not in skipped}
    if args.no_run:
        # The environment and the commands of the machine that ran the cells, as the results file recorded them.
        meta = load_meta(results)
        commands = list(meta.get("commands", [])) + commands
        env = meta.get("environment") or environment()
    else:
        env = environment()
    info = {"date": dt.date.today().isoformat(), **env}
    written = write_report(args.out, per_study, commands, info, skipped)
    print("\n".join(str(p) for p in written))
    return 0
