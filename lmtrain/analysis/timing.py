"""Step-timing statistics and the summary tables of ``CudaSyncTimer`` (pure functions of measured rows)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmtrain.analysis.tables import markdown_table

__all__ = ["MARKS", "RANK_FIELDS", "clock_name", "cross_rank_metrics", "elapsed_ms", "phase_statistics", "phase_times",
           "step_metrics", "summary_text", "throughput", "tokens_in_batch"]

#: Marks ``CudaSyncTimer`` takes in one batch, in the order Lightning's hooks fire them.
MARKS = ("start", "before_backward", "after_backward", "before_opt", "end")


def elapsed_ms(start: Any, end: Any) -> float:
    """Milliseconds between two time stamps: CUDA events (both recorded and completed) or seconds."""
    if isinstance(start, torch.cuda.Event):
        return float(start.elapsed_time(end))
    return (end - start) * 1000.0


def phase_times(batches: Sequence[dict[str, Any]], elapsed_ms: Callable[[Any, Any], float]
                ) -> tuple[dict[str, float], set[str]]:
    """Phase times in ms of one step from the marks of its batches (several under gradient accumulation).

    Args:
        batches: per batch, mark name (:data:`MARKS`) -> a time stamp (seconds, or a CUDA event).
        elapsed_ms: ms between two stamps.

    Returns:
        ``(times, seen)``: ``forward_ms``, ``backward_ms``, ``optimizer_ms``, ``step_ms`` summed over the
        batches, and the keys that some batch had (forward runs to the backward, else to the optimizer step,
        else to the batch end).
    """
    start_k, bwd0_k, bwd1_k, opt0_k, end_k = MARKS
    times = {"forward_ms": 0.0, "backward_ms": 0.0, "optimizer_ms": 0.0, "step_ms": 0.0}
    seen: set[str] = set()
    for marks in batches:
        start, end = marks.get(start_k), marks.get(end_k)
        if start is None or end is None:
            continue
        bwd0, bwd1, opt0 = marks.get(bwd0_k), marks.get(bwd1_k), marks.get(opt0_k)
        times["step_ms"] += elapsed_ms(start, end)
        forward_end = bwd0 if bwd0 is not None else (opt0 if opt0 is not None else end)
        times["forward_ms"] += elapsed_ms(start, forward_end)
        seen.update(("step_ms", "forward_ms"))
        if bwd0 is not None and bwd1 is not None:
            times["backward_ms"] += elapsed_ms(bwd0, bwd1)
            seen.add("backward_ms")
        if opt0 is not None:
            times["optimizer_ms"] += elapsed_ms(opt0, end)
            seen.add("optimizer_ms")
    return times, seen


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
    format of the reference profiling study's timing tables, and the steps whose timing other callbacks
    perturbed (``perturbs_timing``) with their own table, apart.

    Args:
        step_times: the summarised steps (``step`` and phase keys in ms).
        excluded_times: steps other callbacks perturbed (also ``windows``: those callbacks' names).
        warmup_times: step time in ms of each warm-up step.
        clock: how the times were measured, for the first line.
        model_row: (model name, parameter count).
        phases: the phase keys, in table order.
    """
    stats = phase_statistics(step_times, phases)
    warm = ", ".join(f"{t:.1f}" for t in warmup_times)
    n_out = len(excluded_times)
    lines = [f"Step timing ({clock}); {len(warmup_times)} warm-up step(s) excluded"
             + (f" (ms: {warm})" if warm else "") + f"; {n_out} step(s) perturbed by other callbacks' "
             "measurements excluded" + (" (below)" if n_out else "") + ".", "", stats_table(stats), ""]
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
        lines += ["", f"Excluded: {n_out} step(s) perturbed by other callbacks' measurements ({where}):", "",
                  stats_table(phase_statistics(excluded_times, phases))]
    return "\n".join(lines)


def tokens_in_batch(batch: Any) -> int | None:
    """Input tokens of a batch: B * T for lmtrain windows (B, T + 1); B * T for (inputs, ...) pairs."""
    if isinstance(batch, torch.Tensor) and batch.ndim == 2:
        return batch.shape[0] * (batch.shape[1] - 1)
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor) and batch[0].ndim == 2:
        return math.prod(batch[0].shape)
    return None


#: What each rank contributes to a logging step of ``CudaSyncTimer`` on several ranks, in this order.
RANK_FIELDS = ("forward_ms", "backward_ms", "optimizer_ms", "step_ms", "tokens", "flops")


def cross_rank_metrics(per_rank: Sequence[Sequence[float]]) -> tuple[dict[str, float], float, float | None,
                                                                     float | None]:
    """The cross-rank tags of one step from each rank's :data:`RANK_FIELDS` values (NaN: the rank has none).

    Returns:
        ``(metrics, slowest_step_ms, tokens_all_ranks, flops_per_rank)``: ``metrics`` holds
        ``time/step_ms_slowest``, ``time/step_ms_fastest``, ``time/slowest_rank`` (lowest rank on ties),
        ``time/straggler_ratio`` (slowest / fastest) and ``time/{forward,backward,optimizer}_ms_max`` (each phase's
        maximum over the ranks that have it); the token count is the sum over ranks, the FLOPs the mean per
        rank; either is None when a rank could not count it.
    """
    steps = [row[3] for row in per_rank]
    slowest = max(range(len(steps)), key=lambda r: (steps[r], -r))
    fastest = min(steps)
    metrics = {"time/step_ms_slowest": steps[slowest], "time/step_ms_fastest": fastest,
               "time/slowest_rank": float(slowest)}
    if fastest > 0:
        metrics["time/straggler_ratio"] = steps[slowest] / fastest
    for i, key in enumerate(RANK_FIELDS[:3]):
        values = [row[i] for row in per_rank if not math.isnan(row[i])]
        if values:
            metrics[f"time/{key}_max"] = max(values)
    tokens = [row[4] for row in per_rank]
    flops = [row[5] for row in per_rank]
    total_tokens = None if any(math.isnan(t) for t in tokens) else sum(tokens)
    mean_flops = None if any(math.isnan(f) for f in flops) else sum(flops) / len(flops)
    return metrics, steps[slowest], total_tokens, mean_flops


def throughput(step_ms: float, tokens: float | None, flops: float | None,
               peak_flops: float | None) -> tuple[float | None, float | None]:
    """``(tokens per second, MFU before clipping)`` of a step of ``step_ms``: ``tokens`` over the step time, and
    ``flops`` (model FLOPs of one device) / (step time x ``peak_flops`` of one device); None where unknown."""
    seconds = step_ms / 1000.0
    if seconds <= 0:
        return None, None
    tps = tokens / seconds if tokens else None
    mfu = flops / seconds / peak_flops if flops and peak_flops else None
    return tps, mfu


def step_metrics(row: dict[str, float], per_rank: Sequence[Sequence[float]] | None, tokens: float | None,
                 flops: float | None, peak_flops: float | None) -> tuple[dict[str, float], float | None]:
    """Every scalar ``CudaSyncTimer`` logs for one step, and the MFU before clipping (None: not computed).

    Args:
        row: this rank's phase times, ``step`` -> index and phase key -> ms.
        per_rank: every rank's :data:`RANK_FIELDS` values (several ranks), or None (one process): then tokens/s
            and MFU use this rank's step time, tokens and FLOPs; else the slowest rank's step time, the tokens of
            all ranks and the mean FLOPs of one rank (see :func:`cross_rank_metrics`).
        tokens: this rank's tokens in the step (None: not countable).
        flops: this rank's model FLOPs in the step (None: unknown).
        peak_flops: peak FLOP/s of one device (None: no MFU).
    """
    metrics = {f"time/{k}": v for k, v in row.items() if k != "step"}
    wait_ms = row["step_ms"]
    if per_rank is not None:
        ranks, wait_ms, tokens, flops = cross_rank_metrics(per_rank)
        metrics.update(ranks)
    tokens_per_s, raw = throughput(wait_ms, tokens, flops, peak_flops)
    if tokens_per_s is not None:
        metrics["throughput/tokens_per_s"] = tokens_per_s
    if raw is not None:
        metrics["throughput/mfu"] = min(1.0, raw)
    return metrics, raw


def clock_name(cuda: bool, sync: str) -> str:
    """The clock ``CudaSyncTimer`` reads, for its summary."""
    if cuda:
        return "CUDA events" if sync == "events" else "torch.cuda.synchronize + time.perf_counter"
    return "time.perf_counter (host, no CUDA)"
