"""lmtrain's temporal breakdown against HolisticTraceAnalysis (HTA) on the same trace files, as one table.

Usage (HTA: ``pip install HolisticTraceAnalysis``)::

    python benchmarks/scripts/hta_compare.py TRACE.json.gz [TRACE2.json.gz ...]
    python benchmarks/scripts/hta_compare.py TRACE_FOLDER          # one trace per rank (rank<r> in the names)

For each rank it prints, in percentage points: idle, compute and non-compute (communication + memory) time over the
span (HTA ``get_temporal_breakdown``), the communication-computation overlap (``get_comm_comp_overlap``) and the
idle split into host wait / kernel wait / other summed over streams (``get_idle_time_breakdown``, with lmtrain's
``idle_split(per_stream=True)``), then lmtrain's whole-GPU idle split. HTA runs with
``include_last_profiler_step=True``, the window lmtrain uses (``lmtrain.analysis.temporal``).

HTA runs twice. The comparison (rows differing by more than 2 points are marked, and set the exit status) is with
HTA reading the profiler's timestamps as they are (``HTA_DISABLE_NS_ROUNDING=1``). Next to it: HTA as it runs by
default, which first rounds every event inward to whole µs (start up, end down), and lmtrain on the trace rounded
the same way; the two agree, so what separates HTA's default from lmtrain is the rounding alone (several points on
steps of many few-µs kernels, such as CUDA graph replays). Where HTA cannot read a trace (the rounding gives a
sub-µs memset a negative duration, which trips HTA's ``non_compute_time >= 0`` check) the error is printed in
that column. The exit status is 1 when a difference exceeds 2 points, or when HTA compared nothing (it is not
installed, or it failed on every trace).

HTA takes every trace event with a ``stream`` argument for GPU work. In a trace of a compiled model, the CPU
operators that launch inductor's Triton kernels (``triton_poi_fused_...``, category ``cpu_op``) carry one too, so
HTA adds their CPU time to the compute time and the span's kernel count. The last column runs HTA (unrounded) on a
copy of the trace without those CPU operators' ``stream`` arguments: what HTA computes when it counts GPU work
only. Where lmtrain and HTA differ, that column says whether those operators are the difference.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path

from lmtrain.analysis.kernels import load_trace
from lmtrain.analysis.tables import markdown_table
from lmtrain.analysis.temporal import activities, idle_split, temporal_breakdown

TOLERANCE_POINTS = 2.0
#: HTA's switch for its whole-µs rounding of sub-µs traces (``hta/configs/env_options.py``).
HTA_NO_ROUNDING = "HTA_DISABLE_NS_ROUNDING"


def rounded_like_hta(trace: dict) -> dict:
    """The trace as HTA 0.5 reads it by default: when any timestamp is fractional, every complete event's start is
    rounded up and its end down to whole µs (``hta/common/trace_parser.py``, ``round_down_time_stamps``)."""
    events = trace.get("traceEvents", [])
    if not any(isinstance(e.get("ts"), float) for e in events):
        return trace
    out = []
    for e in events:
        if e.get("ph") == "X" and "ts" in e and "dur" in e:
            start, end = math.ceil(float(e["ts"])), math.floor(float(e["ts"]) + float(e["dur"]))
            e = {**e, "ts": start, "dur": end - start}
        out.append(e)
    return {**trace, "traceEvents": out}


def lmtrain_figures(path: Path, hta_rounding: bool = False) -> dict[str, float]:
    """lmtrain's figures of a trace file (percent); ``hta_rounding``: of the trace rounded as HTA rounds it."""
    trace = load_trace(path)
    acts, steps = activities(rounded_like_hta(trace) if hta_rounding else trace, "cuda")
    t = temporal_breakdown(acts, steps)
    per_stream = idle_split(acts, per_stream=True)
    idle_total = sum(per_stream.values()) or 1.0
    whole = sum(t.idle_us.values()) or 1.0
    out = {"idle %": 100 * t.share("idle"), "compute %": 100 * t.share("compute"),
           "non-compute %": 100 * (t.share("communication") + t.share("memory")),
           "comm overlap %": 100 * (t.overlap_share or 0.0)}
    out.update({f"idle {k.replace('_', ' ')} % (per stream)": 100 * v / idle_total for k, v in per_stream.items()})
    out.update({f"idle {k.replace('_', ' ')} % (whole GPU)": 100 * v / whole for k, v in t.idle_us.items()})
    return out


@contextlib.contextmanager
def _hta_rounding(on: bool) -> Iterator[None]:
    """HTA reads its switch from the environment each time it parses a trace: set it for this block only."""
    saved = os.environ.get(HTA_NO_ROUNDING)
    os.environ[HTA_NO_ROUNDING] = "0" if on else "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(HTA_NO_ROUNDING, None)
        else:
            os.environ[HTA_NO_ROUNDING] = saved


def without_cpu_op_streams(trace: dict) -> tuple[dict, int]:
    """The trace without the ``stream`` argument of its CPU operators, and how many had one (HTA counts an event
    with a stream as GPU work; inductor's Triton launch operators have one)."""
    out, dropped = [], 0
    for e in trace.get("traceEvents", []):
        args = e.get("args")
        if e.get("cat") == "cpu_op" and isinstance(args, dict) and "stream" in args:
            e = {**e, "args": {k: v for k, v in args.items() if k != "stream"}}
            dropped += 1
        out.append(e)
    return {**trace, "traceEvents": out}, dropped


def hta_figures(path: Path, rank: int, rounding: bool = False, gpu_only: bool = False) -> dict[str, float]:
    """HTA's figures of a trace file (percent), reading its timestamps as they are unless ``rounding`` (HTA's
    default); ``gpu_only``: of a copy without the CPU operators' stream arguments (:func:`without_cpu_op_streams`)."""
    if gpu_only:
        with tempfile.TemporaryDirectory() as folder:
            copy = Path(folder) / f"rank{rank}_trace.json"
            copy.write_text(json.dumps(without_cpu_op_streams(load_trace(path))[0]))
            return hta_figures(copy, rank, rounding)
    from hta.trace_analysis import TraceAnalysis

    with _hta_rounding(rounding):
        analyzer = TraceAnalysis(trace_files={rank: str(path)}, trace_dir=str(path.parent),
                                 include_last_profiler_step=True)
    temporal = analyzer.get_temporal_breakdown(visualize=False).set_index("rank").loc[rank]
    overlap = analyzer.get_comm_comp_overlap(visualize=False).set_index("rank").loc[rank]
    idle = analyzer.get_idle_time_breakdown(ranks=[rank], visualize=False)[0]
    by_cat = idle.groupby("idle_category")["idle_time"].sum()
    total = float(by_cat.sum()) or 1.0
    out = {"idle %": float(temporal["idle_time_pctg"]), "compute %": float(temporal["compute_time_pctg"]),
           "non-compute %": float(temporal["non_compute_time_pctg"]),
           "comm overlap %": float(overlap["comp_comm_overlap_pctg"])}
    out.update({f"idle {name.replace('_', ' ')} % (per stream)": 100 * float(by_cat.get(name, 0.0)) / total
                for name in ("host_wait", "kernel_wait", "other")})
    return out


def _hta_or_error(path: Path, rank: int, rounding: bool, gpu_only: bool = False) -> dict[str, float] | str:
    try:
        return hta_figures(path, rank, rounding, gpu_only)
    except Exception as e:  # noqa: BLE001 (HTA's failure modes are many; report and go on)
        where = traceback.extract_tb(e.__traceback__)[-1]  # a bare assertion says nothing: name the check
        return f"{type(e).__name__}: {str(e) or where.line} ({Path(where.filename).name}:{where.lineno})"


def traces(args: list[str]) -> dict[int, Path]:
    files: list[Path] = []
    for arg in map(Path, args):
        found = sorted(p for p in arg.iterdir() if p.name.endswith((".json", ".json.gz"))) if arg.is_dir() else [arg]
        files += [p for p in found if "trace" in p.name] or found
    ranks = [re.search(r"rank[_-]?(\d+)", p.name) for p in files]
    if all(ranks) and len({int(m.group(1)) for m in ranks}) == len(files):
        return {int(m.group(1)): p for m, p in zip(ranks, files, strict=True)}
    return dict(enumerate(files))


def _cell(figures: dict[str, float] | str, key: str) -> str:
    value = figures.get(key) if isinstance(figures, dict) else None
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("traces", nargs="+", help="trace files (.json / .json.gz) or folders of them")
    args = parser.parse_args(argv)
    worst, compared = 0.0, 0
    for rank, path in sorted(traces(args.traces).items()):
        mine, mine_rounded = lmtrain_figures(path), lmtrain_figures(path, hta_rounding=True)
        exact, rounded = _hta_or_error(path, rank, False), _hta_or_error(path, rank, True)
        launches = without_cpu_op_streams(load_trace(path))[1]
        gpu_only = _hta_or_error(path, rank, False, gpu_only=True) if launches else exact
        rows = []
        for key, value in mine.items():
            other = exact.get(key) if isinstance(exact, dict) else None
            diff = None if other is None or other != other else value - other  # NaN: HTA without communication
            if diff is not None:
                worst, compared = max(worst, abs(diff)), compared + 1
            flag = "" if diff is None or abs(diff) <= TOLERANCE_POINTS else " **> 2**"
            rows.append([key, f"{value:.2f}", _cell(exact, key), "-" if diff is None else f"{diff:+.2f}{flag}",
                         _cell(rounded, key), "-" if "whole GPU" in key else _cell(mine_rounded, key),
                         _cell(gpu_only, key)])
        print(f"\n## rank {rank}: {path.name} ({launches} CPU operators with a stream argument)\n")
        print(markdown_table(["figure", "lmtrain", "HTA", "lmtrain - HTA (points)", "HTA, µs-rounded (default)",
                              "lmtrain, µs-rounded trace", "HTA, GPU events only"], rows))
        for what, figures in (("HTA", exact), ("HTA with its default rounding", rounded),
                              ("HTA on GPU events only", gpu_only)):
            if isinstance(figures, str):
                print(f"\n{what} cannot read {path}: {figures}")
    if not compared:  # HTA read no trace (not installed, or failed on each): nothing was checked
        print("\nno HTA figures to compare: HTA did not run on any trace (see the errors above); exit status 1")
        return 1
    print(f"\nlargest difference: {worst:.2f} points over {compared} figures (tolerance {TOLERANCE_POINTS:g})")
    return 0 if worst <= TOLERANCE_POINTS else 1


if __name__ == "__main__":
    sys.exit(main())
