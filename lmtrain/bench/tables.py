"""Formatting of sweep rows: numbers, ``mean ± std`` times, statuses and the per-cell Markdown table."""

from __future__ import annotations

import math
from typing import Any

from lmtrain.analysis.tables import markdown_table

#: Columns of the Markdown table printed on stdout (one row per cell).
MARKDOWN_COLUMNS = [
    "size", "params", "context", "batch", "precision", "attention", "compile", "mode", "options", "forward ms",
    "backward ms", "optimizer ms", "step ms", "tokens/s", "MFU", "peak GiB", "estimate GiB", "status",
]


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


def is_on(value: Any) -> bool:
    """Whether a row's on/off field is on (rows hold ``on``/``off`` or booleans, ``True``/``False`` after a CSV)."""
    return value in (True, "True", "true", "on")


def options_text(row: dict[str, Any]) -> str:
    """The memory and speed options set in a row, and the plain runner, e.g. ``graphs, overlap`` (``-``: none)."""
    parts = []
    if row.get("activation_checkpointing") not in (None, "", "none"):
        parts.append(f"checkpointing {row['activation_checkpointing']}")
    if row.get("loss_chunk_tokens"):
        parts.append(f"loss chunk {row['loss_chunk_tokens']}")
    parts += [name for name, key in (("graphs", "cuda_graphs"), ("in-backward", "optimizer_in_backward"),
                                     ("overlap", "optimizer_overlap"), ("master weights", "master_weights"))
              if is_on(row.get(key))]
    if row.get("optimizer_state_dtype") not in (None, "", "float32"):
        parts.append(f"{row['optimizer_state_dtype']} moments")
    if row.get("compile_mode") not in (None, "", "default"):
        parts.append(f"compile mode {row['compile_mode']}")
    parts += _other_options(row)
    if row.get("runner") == "plain":
        parts.append("plain loop")
    return ", ".join(parts) or "-"


#: Step options that ``options_text`` names in words of its own, or that are columns of their own.
_DESCRIBED = {"activation_checkpointing", "loss_chunk_tokens", "cuda_graphs", "optimizer_in_backward",
              "optimizer_overlap", "master_weights", "optimizer_state_dtype", "compile_mode", "attention", "compile",
              "step_mode"}


def _other_options(row: dict[str, Any]) -> list[str]:
    """Every other step option of the schema that a row sets away from its default, as ``name value``."""
    from lmtrain.config import step_fields

    parts = []
    for f in step_fields():
        value = row.get(f.name)
        if f.name in _DESCRIBED or value is None or value == "":
            continue
        name = f.name.replace("_", " ")
        if isinstance(f.default, bool):
            if is_on(value) != f.default:
                parts.append(name if is_on(value) else f"no {name}")
        elif str(value) != str(f.default):
            parts.append(f"{name} {value}")
    return parts


#: How a cell that ``bench model --skip-unfit`` did not run is marked: the start of its ``error``.
PLAN_SKIP = "plan: needs"


def skipped_by_plan(row: dict[str, Any]) -> bool:
    """The row is a cell ``--skip-unfit`` did not run because its memory plan does not fit."""
    return row.get("status") == "skipped" and str(row.get("error") or "").startswith(PLAN_SKIP)


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
            r.get("attention"), r.get("compile"), r.get("mode"), options_text(r), fmt_ms(r, "forward"),
            fmt_ms(r, "backward"), fmt_ms(r, "optimizer"), fmt_ms(r, "step"), fmt(r.get("tokens_per_s"), ",.0f"),
            fmt(r.get("mfu"), ".1%"), fmt(r.get("peak_gib"), ".2f"), fmt(r.get("estimate_gib"), ".2f"),
            status_text(r),
        ])
    return markdown_table(MARKDOWN_COLUMNS, body)
