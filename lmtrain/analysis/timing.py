"""Step-timing statistics and the summary tables of ``CudaSyncTimer`` (pure functions of measured rows)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from lmtrain.analysis.tables import markdown_table

__all__ = ["phase_statistics", "summary_text", "tokens_in_batch"]


def phase_statistics(rows: Sequence[dict[str, Any]], phases: Sequence[str]) -> dict[str, dict[str, float]]:
    """Phase key -> mean, std (sample; 0 for one value), median, min, max and count over the rows that have it.

    Args:
        rows: one dict per step, phase key -> ms (other keys are ignored).
        phases: the phase keys, in output order (``forward_ms``, ``backward_ms``, ...).
    """
    out: dict[str, dict[str, float]] = {}
    for key in phases:
        values = [row[key] for row in rows if key in row]
        if not values:
            continue
        out[key] = {
            "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "count": float(len(values)),
        }
    return out


def stats_table(stats: dict[str, dict[str, float]]) -> str:
    """Markdown table of :func:`phase_statistics`."""
    rows = [[k.removesuffix("_ms"), f"{s['mean']:.3f} ± {s['std']:.3f}", f"{s['median']:.3f}",
             f"{s['min']:.3f}", f"{s['max']:.3f}", int(s["count"])] for k, s in stats.items()]
    return markdown_table(["phase", "mean ± std (ms)", "median (ms)", "min (ms)", "max (ms)", "steps"], rows)


def summary_text(step_times: Sequence[dict[str, Any]], excluded_times: Sequence[dict[str, Any]],
                 warmup_times: Sequence[float], clock: str, model_row: tuple[str, int],
                 phases: Sequence[str]) -> str:
    """The timing summary as Markdown.

    A per-phase table of the summarised steps, the same means in the ``Model Params Forward (s) Backward (s)``
    format of the reference profiling study's timing tables, and the steps inside other callbacks'
    measurement windows with their own table, apart.

    Args:
        step_times: the summarised steps (``step`` and phase keys in ms).
        excluded_times: steps inside other callbacks' windows (also ``windows``: those callbacks' names).
        warmup_times: step time in ms of each warm-up step.
        clock: how the times were measured, for the first line.
        model_row: (model name, parameter count).
        phases: the phase keys, in table order.
    """
    stats = phase_statistics(step_times, phases)
    warm = ", ".join(f"{t:.1f}" for t in warmup_times)
    n_out = len(excluded_times)
    lines = [f"Step timing ({clock}); {len(warmup_times)} warm-up step(s) excluded"
             + (f" (ms: {warm})" if warm else "") + f"; {n_out} step(s) inside other callbacks' measurement "
             "windows excluded" + (" (below)" if n_out else "") + ".", "", stats_table(stats), ""]
    name, params = model_row

    def seconds(key: str) -> str:
        s = stats.get(key)
        return f"{s['mean'] / 1000:.6f}±{s['std'] / 1000:.6f}" if s else "-"

    lines += ["```", f"{'Model':<10} {'Params':<12} {'Forward (s)':<15} {'Backward (s)'}", "-" * 60,
              f"{name:<10} {params:<12,} {seconds('forward_ms'):<15} {seconds('backward_ms')}", "```"]
    if n_out:
        by_window: dict[str, list[int]] = {}
        for row in excluded_times:
            for window in row["windows"]:
                by_window.setdefault(window, []).append(int(row["step"]))
        where = "; ".join(f"{w}: steps {', '.join(map(str, steps))}" for w, steps in by_window.items())
        lines += ["", f"Excluded: {n_out} step(s) inside other callbacks' measurement windows ({where}):", "",
                  stats_table(phase_statistics(excluded_times, phases))]
    return "\n".join(lines)


def tokens_in_batch(batch: Any) -> int | None:
    """Input tokens of a batch: B * T for lmtrain windows (B, T + 1); B * T for (inputs, ...) pairs."""
    if isinstance(batch, torch.Tensor) and batch.ndim == 2:
        return batch.shape[0] * (batch.shape[1] - 1)
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor) and batch[0].ndim == 2:
        return math.prod(batch[0].shape)
    return None
