"""lmtrain's temporal breakdown against HolisticTraceAnalysis (HTA) on the same trace files, as one table.

Usage (HTA: ``pip install HolisticTraceAnalysis``)::

    python benchmarks/scripts/hta_compare.py TRACE.json.gz [TRACE2.json.gz ...]
    python benchmarks/scripts/hta_compare.py TRACE_FOLDER          # one trace per rank (rank<r> in the names)

For each rank it prints, in percentage points: idle, compute and non-compute (communication + memory) time over the
span (HTA ``get_temporal_breakdown``), the communication-computation overlap (``get_comm_comp_overlap``) and the
idle split into host wait / kernel wait / other summed over streams (``get_idle_time_breakdown``, with lmtrain's
``idle_split(per_stream=True)``), then lmtrain's whole-GPU idle split. HTA runs with
``include_last_profiler_step=True`` so that both cover every step in the trace. Rows differing by more than 2
points are marked. Where HTA cannot read a trace (CUDA-graph traces fail an assertion in HTA 0.5) the error is
printed with lmtrain's figures alone.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from lmtrain.analysis.kernels import load_trace
from lmtrain.analysis.tables import markdown_table
from lmtrain.analysis.temporal import activities, idle_split, temporal_breakdown

TOLERANCE_POINTS = 2.0


def lmtrain_figures(path: Path) -> dict[str, float]:
    acts, steps = activities(load_trace(path), "cuda")
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


def hta_figures(path: Path, rank: int) -> dict[str, float]:
    from hta.trace_analysis import TraceAnalysis

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


def traces(args: list[str]) -> dict[int, Path]:
    files: list[Path] = []
    for arg in map(Path, args):
        found = sorted(p for p in arg.iterdir() if p.name.endswith((".json", ".json.gz"))) if arg.is_dir() else [arg]
        files += [p for p in found if "trace" in p.name] or found
    ranks = [re.search(r"rank[_-]?(\d+)", p.name) for p in files]
    if all(ranks) and len({int(m.group(1)) for m in ranks}) == len(files):
        return {int(m.group(1)): p for m, p in zip(ranks, files, strict=True)}
    return dict(enumerate(files))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("traces", nargs="+", help="trace files (.json / .json.gz) or folders of them")
    args = parser.parse_args(argv)
    worst, compared = 0.0, 0
    for rank, path in sorted(traces(args.traces).items()):
        mine = lmtrain_figures(path)
        try:
            theirs = hta_figures(path, rank)
        except Exception as e:  # noqa: BLE001 (HTA's failure modes are many; report and go on)
            print(f"\nrank {rank}: HTA cannot read {path} ({type(e).__name__}: {e}); lmtrain's figures alone.")
            theirs = {}
        rows = []
        for key, value in mine.items():
            other = theirs.get(key)
            diff = None if other is None else value - other
            if diff is not None:
                worst, compared = max(worst, abs(diff)), compared + 1
            flag = "" if diff is None or abs(diff) <= TOLERANCE_POINTS else " **> 2**"
            rows.append([key, f"{value:.2f}", "-" if other is None else f"{other:.2f}",
                         "-" if diff is None else f"{diff:+.2f}{flag}"])
        print(f"\n## rank {rank}: {path.name}\n")
        print(markdown_table(["figure", "lmtrain", "HTA", "lmtrain - HTA (points)"], rows))
    print(f"\nlargest difference: {worst:.2f} points over {compared} figures (tolerance {TOLERANCE_POINTS:g})"
          if compared else "\nno HTA figures to compare")
    return 0 if worst <= TOLERANCE_POINTS else 1


if __name__ == "__main__":
    sys.exit(main())
