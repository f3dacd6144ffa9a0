"""The current-numbers page: one table per kind of benchmark, each from the newest record of its kind.

    python -m lmtrain bench report --records benchmarks --out docs/performance.md

Records are the JSON files that the ``bench`` commands write (``bench attention``: ``meta`` with device, versions
and command, ``rows`` of backends x shapes; ``bench model``: ``meta`` with commands and environment, ``rows`` of
cells; ``bench callbacks``: ``meta`` with device and config, ``rows`` of settings). Each record has a kind:

- ``attention``: a ``bench attention`` record with ``flash_triton`` and ``sdpa_cudnn`` rows;
- ``model SIZE CONTEXT BATCH``: a ``bench model`` record of one size, context and batch without ``--study``
  (the backends of the model step side by side);
- ``speed SIZE``: a ``bench model`` record with speed options (compile, CUDA graphs, master weights, the plain
  loop) or ``--study speed``; one kind per size it holds;
- ``long-context`` and ``memory``: ``bench model --study long-context`` / ``--study memory`` records.

Other records (probe scripts' output, ``bench callbacks``, whose figures need their record's explanation) are
listed in the records' index only.

The newest record of a kind is the one with the latest date (``meta["date"]``, else the ``YYYY-MM-DD`` its name
starts with); on the same date, the one git added last, then the one with more rows, then the later name. Each
table states the record's date, commit, device, versions, command and kernel settings (``meta["commit"]``,
``meta["kernels"]``, or the flash dispatcher's settings and plans in ``meta["flash_kernels"]``); a field an older
record lacks reads "not recorded".
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtrain.analysis.tables import markdown_table
from lmtrain.bench.tables import fmt, is_on, options_text, status_text

NOT_RECORDED = "not recorded"

#: The command that regenerates the page, printed at its top.
REGENERATE = "python -m lmtrain bench report --records benchmarks --out docs/performance.md"

_DATE = re.compile(r"^(\d{4}-\d{2}-\d{2})")
_VERSION_KEYS = ("python", "torch", "lightning", "CUDA (torch build)", "triton", "driver")


@dataclass
class Record:
    """One JSON record: its file, content, kind keys and the facts every table states."""

    path: Path
    meta: dict[str, Any]
    rows: list[dict[str, Any]]
    kinds: list[tuple[Any, ...]]
    added: str = ""

    @property
    def date(self) -> str:
        """``meta["date"]`` (its day), else the date the file name starts with, else ``not recorded``."""
        given = str(self.meta.get("date") or "")[:10]
        named = _DATE.match(self.path.name)
        return given or (named.group(1) if named else NOT_RECORDED)

    def order(self) -> tuple[str, str, int, str]:
        """Sort key: later is newer (date, time git added the file, rows, name)."""
        return (self.date if self.date != NOT_RECORDED else "", self.added, len(self.rows), self.path.name)

    def commands(self) -> list[str]:
        """The commands that wrote the record, in order."""
        if self.meta.get("commands"):
            return [str(c) for c in self.meta["commands"]]
        return [str(self.meta["command"])] if self.meta.get("command") else []

    def device(self) -> str:
        devices = [self.meta.get("device")] + [r.get("device") for r in self.rows]
        names = sorted({str(d) for d in devices if d and d != "cpu"})
        return ", ".join(names) or NOT_RECORDED

    def versions(self) -> str:
        env = {**self.meta, **(self.meta.get("environment") or {})}
        parts = [f"{k} {env[k]}" for k in _VERSION_KEYS if env.get(k)]
        return ", ".join(parts) or NOT_RECORDED

    def kernels(self) -> str:
        given = self.meta.get("kernels")
        flash = self.meta.get("flash_kernels")  # bench attention's record of the flash dispatcher (describe())
        if not given and isinstance(flash, dict):
            plans = "; ".join(f"{shape}: {'/'.join(plan.get(job, '?') for job in ('fwd', 'dq', 'dkdv'))}"
                              for shape, plan in (flash.get("plans") or {}).items())
            given = {**(flash.get("settings") or {}), **({"plans (fwd/dq/dkdv)": plans} if plans else {})}
        if not given:
            return NOT_RECORDED
        if isinstance(given, dict):
            return ", ".join(f"{k}={v}" for k, v in given.items())
        return str(given)


# -- kinds ----------------------------------------------------------------------------------------------------


def _is_sweep(meta: dict[str, Any], rows: list[dict[str, Any]]) -> bool:
    return any("bench model" in c for c in meta.get("commands") or []) and all("size" in r for r in rows)


def _speed_row(row: dict[str, Any]) -> bool:
    return (is_on(row.get("compile")) or is_on(row.get("cuda_graphs")) or is_on(row.get("master_weights"))
            or row.get("runner") == "plain")


def kinds_of(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """The kinds a record is the newest candidate for (none: the record is left out of the page)."""
    if not rows:
        return []
    if "bench attention" in str(meta.get("command") or ""):
        backends = {r.get("backend") for r in rows}
        return [("attention",)] if {"flash_triton", "sdpa_cudnn"} <= backends else []
    if not _is_sweep(meta, rows):
        return []
    commands = " ".join(meta.get("commands") or [])
    if "--study long-context" in commands:
        return [("long-context",)]
    if "--study memory" in commands:
        return [("memory",)]
    if "--study speed" in commands or any(_speed_row(r) for r in rows):
        return [("speed", size) for size in dict.fromkeys(r["size"] for r in rows)]
    if "--study" in commands:
        return []
    groups = dict.fromkeys((r["size"], r["context"], r["batch_size"]) for r in rows)
    return [("model", *g) for g in groups]


def _git_added(folder: Path) -> dict[Path, str]:
    """When git added each file now in ``folder`` (ISO commit time, followed through renames); {} without git."""
    try:
        top = subprocess.run(["git", "-C", str(folder), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=30, check=True).stdout.strip()
        log = subprocess.run(["git", "-C", top, "log", "--reverse", "-M", "--name-status", "--format=%x00%cI"],
                             capture_output=True, text=True, timeout=120, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    added: dict[str, str] = {}
    when = ""
    for line in log.splitlines():
        if line.startswith("\x00"):
            when = line[1:]
            continue
        parts = line.split("\t")
        if parts[0] == "A" and len(parts) == 2:
            added[parts[1]] = when
        elif parts[0].startswith("R") and len(parts) == 3:
            added[parts[2]] = added.pop(parts[1], when)
    return {Path(top) / p: t for p, t in added.items()}


def load_records(folder: Path) -> list[Record]:
    """Every JSON record in ``folder`` (not its sub-folders) that has a kind."""
    added = {p.resolve(): t for p, t in _git_added(folder).items()}
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            continue
        meta, rows = dict(data.get("meta") or {}), [r for r in data["rows"] if isinstance(r, dict)]
        kinds = kinds_of(meta, rows)
        if kinds:
            records.append(Record(path, meta, rows, kinds, added.get(path.resolve(), "")))
    return records


def newest(records: Iterable[Record]) -> dict[tuple[Any, ...], Record]:
    """Kind -> its newest record."""
    best: dict[tuple[Any, ...], Record] = {}
    for rec in records:
        for kind in rec.kinds:
            if kind not in best or rec.order() > best[kind].order():
                best[kind] = rec
    return best


# -- tables ---------------------------------------------------------------------------------------------------


def _step_ms(row: dict[str, Any]) -> float | None:
    return row.get("step_ms_median") if row.get("step_ms_median") is not None else row.get("step_ms_mean")


def _ratio(theirs: Any, ours: Any) -> str:
    return f"{theirs / ours:.2f}x" if isinstance(theirs, int | float) and isinstance(ours, int | float) and ours \
        else "-"


def attention_table(rec: Record) -> str:
    """flash_triton against cuDNN per shape; "x cuDNN" is cuDNN's time over ours (above 1: ours is faster)."""
    by = {(r["backend"], r["head_dim"], r["seq_len"], r["batch"], r["heads"]): r for r in rec.rows}
    shapes = sorted({k[1:] for k in by if k[0] == "flash_triton"})
    body = []
    for shape in shapes:
        ours, cudnn = by[("flash_triton", *shape)], by.get(("sdpa_cudnn", *shape), {})
        body.append([shape[0], shape[1], f"{shape[2]} x {shape[3]}",
                     fmt(ours.get("fwd_ms"), ".3f"), fmt(cudnn.get("fwd_ms"), ".3f"),
                     _ratio(cudnn.get("fwd_ms"), ours.get("fwd_ms")),
                     fmt(ours.get("fwd_bwd_ms"), ".3f"), fmt(cudnn.get("fwd_bwd_ms"), ".3f"),
                     _ratio(cudnn.get("fwd_bwd_ms"), ours.get("fwd_bwd_ms"))])
    header = ["head dim", "keys", "batch x heads", "forward ms", "cuDNN forward ms", "x cuDNN", "fwd+bwd ms",
              "cuDNN fwd+bwd ms", "x cuDNN"]
    return markdown_table(header, body)


def _cell_row(r: dict[str, Any], first: list[Any]) -> list[Any]:
    return [*first, fmt(_step_ms(r), ".2f"), fmt(r.get("tokens_per_s"), ",.0f"), fmt(r.get("mfu"), ".1%"),
            fmt(r.get("peak_gib"), ".2f"), status_text(r)]


_CELL_HEADER = ["step ms", "tokens/s", "MFU", "peak GiB", "status"]


def model_table(rec: Record, size: str, context: int, batch: int) -> str:
    rows = [r for r in rec.rows if (r["size"], r["context"], r["batch_size"]) == (size, context, batch)]
    body = [_cell_row(r, [r.get("attention"), r.get("precision"), r.get("mode")]) for r in rows]
    return markdown_table(["attention", "precision", "mode", *_CELL_HEADER], body)


def speed_table(rec: Record, size: str) -> str:
    rows = [r for r in rec.rows if r["size"] == size and r.get("status") == "ok"]
    rows.sort(key=lambda r: -(_step_ms(r) or 0.0))
    body = [_cell_row(r, [r.get("context"), r.get("batch_size"), r.get("attention"), r.get("compile"),
                          options_text(r)]) for r in rows]
    return markdown_table(["context", "batch", "attention", "compile", "options", *_CELL_HEADER], body)


def long_context_table(rec: Record) -> str:
    """Per size and context, the fastest cell that ran, and how many of the record's cells ran."""
    ran = [r for r in rec.rows if r.get("status") == "ok" and _step_ms(r)]
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for r in ran:
        key = (r["size"], r["context"])
        if key not in best or _step_ms(r) < _step_ms(best[key]):
            best[key] = r
    body = [[r["size"], r["context"], r["batch_size"], r.get("attention"), r.get("compile"), options_text(r),
             fmt(_step_ms(r), ".1f"), fmt(r.get("tokens_per_s"), ",.0f"), fmt(r.get("peak_gib"), ".2f"),
             fmt(r.get("estimate_gib"), ".2f"), sum(1 for x in ran if (x["size"], x["context"]) == k)]
            for k, r in sorted(best.items(), key=lambda kv: (kv[0][0], kv[0][1]))]
    header = ["size", "context", "batch", "attention", "compile", "options", "step ms", "tokens/s", "peak GiB",
              "plan GiB", "cells that ran"]
    return markdown_table(header, body)


def memory_table(rec: Record) -> str:
    """Measured peak against the memory plan recorded with it, training steps without compile."""
    rows = [r for r in rec.rows if r.get("mode") == "train" and not is_on(r.get("compile"))
            and r.get("estimate_gib") is not None and (r.get("peak_gib") or r.get("status") == "OOM")]
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        seen.setdefault((r["size"], r["precision"], r["batch_size"], r["context"], r.get("attention")), r)
    ordered = sorted(seen.values(), key=lambda r: (r.get("params") or 0, r["precision"], r["batch_size"],
                                                   r["context"]))
    body = [[r["size"], r["precision"], r["batch_size"], r["context"], r.get("attention"),
             fmt(r.get("peak_gib"), ".2f"), fmt(r.get("estimate_gib"), ".2f"),
             fmt(r.get("estimate_error_pct"), "+.1f"), status_text(r)] for r in ordered]
    return markdown_table(["size", "precision", "batch", "context", "attention", "peak GiB", "plan GiB",
                           "plan error %", "status"], body)


#: Kind name -> (section title from the kind's keys, one line on what the table shows, the table).
SECTIONS: dict[str, tuple[Callable[..., str], str, Callable[..., str]]] = {
    "attention": (lambda: "Attention: flash_triton against cuDNN",
                  "bf16, causal. Times in ms; x cuDNN is cuDNN's time over flash_triton's (above 1: flash_triton "
                  "is faster).", attention_table),
    "model": (lambda size, context, batch: f"Model step: {size}, context {context}, batch {batch}",
              "One training step (forward, loss, backward, AdamW) per attention backend; step ms is the median of "
              "the measured steps.", model_table),
    "speed": (lambda size: f"Step speed: {size}",
              "The speed options against each other, slowest first; step ms is the median of the measured steps.",
              speed_table),
    "long-context": (lambda: "Long context",
                     "The fastest combination of memory options that ran at each context.", long_context_table),
    "memory": (lambda: "Memory: measured peak against the plan",
               "Peak allocated memory of training steps against `python -m lmtrain estimate`'s plan as recorded.",
               memory_table),
}

_ORDER = list(SECTIONS)


def _described_in(rec: Record, notes: list[Path]) -> list[Path]:
    """The Markdown records that name the JSON record or its CSV."""
    names = (rec.path.name, rec.path.with_suffix(".csv").name)
    return [md for md in notes if any(n in md.read_text() for n in names)]


def render(records: list[Record], folder_link: str) -> str:
    """The page: a header, then one section per kind (in ``SECTIONS`` order), from the newest records.

    Args:
        records: the loaded records.
        folder_link: the records' folder as a link from the page (e.g. ``../benchmarks``).
    """
    best = newest(records)
    notes = sorted({p for rec in records for p in rec.path.parent.glob("*.md")} - {
        p for rec in records for p in rec.path.parent.glob("README.md")})
    lines = ["# Performance", "",
             "Current numbers only: each table comes from the newest record of its kind in "
             f"[{Path(folder_link).name}/]({folder_link}/README.md), which also indexes the history. "
             "Regenerate this page with one command from the repository root:", "", "```", REGENERATE, "```", ""]
    kinds = sorted(best, key=lambda k: (_ORDER.index(k[0]), [str(x) for x in k[1:]]))
    for kind in kinds:
        rec = best[kind]
        title, what, table = SECTIONS[kind[0]]
        link = f"[{rec.path.name}]({folder_link}/{rec.path.name})"
        described = ", ".join(f"[{p.name}]({folder_link}/{p.name})" for p in _described_in(rec, notes))
        commands = rec.commands()
        lines += [f"## {title(*kind[1:])}", "", what, ""]
        lines += [f"- record: {link}" + (f", described in {described}" if described else ""),
                  f"- date: {rec.date}", f"- commit: {rec.meta.get('commit') or NOT_RECORDED}",
                  f"- device: {rec.device()}", f"- versions: {rec.versions()}",
                  f"- kernel settings: {rec.kernels()}", ""]
        lines += ["Command:" if len(commands) == 1 else "Commands:", "", "```"]
        lines += commands or [NOT_RECORDED]
        lines += ["```", "", table(rec, *kind[1:]), ""]
    if not kinds:
        lines += ["No records with a known kind were found.", ""]
    return "\n".join(lines)


def write_performance(folder: Path, out: Path) -> Path:
    """Write the page at ``out`` from the records in ``folder``; links are relative to ``out``'s folder."""
    link = Path(os.path.relpath(folder.resolve(), out.parent.resolve())).as_posix()
    text = render(load_records(folder), link)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out
