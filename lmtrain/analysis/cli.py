"""Analyse a saved profiler trace or allocator snapshot: the tables and charts the callbacks make, offline.

Two sub-commands, for files taken by anyone (a script, another machine, an earlier run):

``python -m lmtrain analyze kernels TRACE.json[.gz] | FOLDER``
    A Chrome trace exported by ``torch.profiler`` (``prof.export_chrome_trace``, or KernelShare's
    ``kernel_trace.json.gz``), or a folder holding one such trace per rank. Prints KernelShare's report (time per
    phase, top kernels, GEMM share, categories, softmax vs matmul), the per-phase kernel tables and the temporal
    breakdown (compute / communication / memory / idle per phase, the idle split, the communication overlap,
    launch statistics: ``lmtrain.analysis.temporal``; how much slower compute ran beside communication kernels:
    ``lmtrain.analysis.kernels.communication_interference``); for a folder, each rank's breakdown and a table comparing
    the ranks. With ``--out`` it writes ``kernel_table.csv`` and ``kernel_categories.png`` (the
    ``kernels/categories`` chart) there (``_rank<r>`` in the names for a folder). Phases come from
    ``record_function`` ranges named ``forward``, ``backward`` and ``optimizer`` in the trace; kernels launched
    outside them are ``outside``; a trace without them (a plain script's) has one phase, ``unknown``. A trace
    without CUDA activities is read as CPU operator time.

``python -m lmtrain analyze memory SNAPSHOT.pickle``
    An allocator snapshot (``torch.cuda.memory._dump_snapshot``, or MemorySnapshot's
    ``memory_snapshot_*.pickle``). Prints MemorySnapshot's ``memory/top_allocations`` text (what was live at
    the peak, by category, and the largest blocks with the Python frame that allocated them) for each
    device in the snapshot, and writes ``memory_timeline_<name>_device<d>.png`` (the ``memory/timeline``
    chart). Unpickling runs code named in the file: analyse only snapshots you trust.

Files go to ``--out``; without it nothing is written (the input's folder is never written to unasked). Exit status
0, or 2 for a file that cannot be read.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from lmtrain.errors import LmtrainError, check_writable_folder

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``kernels`` and ``memory`` sub-commands and their options."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = ("sub-commands:\n"
                     "  kernels TRACE   kernel time per phase and category of a torch.profiler Chrome trace\n"
                     "  memory SNAPSHOT live memory at the peak and the timeline of an allocator snapshot\n\n"
                     "python -m lmtrain analyze kernels --help / memory --help for their options.")
    sub = parser.add_subparsers(dest="what", required=True, metavar="{kernels,memory}")
    kernels = sub.add_parser("kernels", help="kernel time per phase and category of a torch.profiler Chrome trace",
                             description="Kernel tables, shares and report of a Chrome trace (.json or .json.gz) "
                                         "exported by torch.profiler, as KernelShare logs them.")
    kernels.add_argument("trace", type=Path, help="the Chrome trace (.json or .json.gz), or a folder of one per rank")
    kernels.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                         help="read GPU kernels (cuda) or CPU operator self times (cpu); auto: cuda when the trace "
                              "has GPU activities")
    kernels.add_argument("--top-k", type=int, default=15, help="rows of the kernel tables (default 15)")
    kernels.add_argument("--head-dim", type=int, default=None,
                         help="attention head dimension, for the softmax/matmul FLOP ratio")
    kernels.add_argument("--out", type=Path, default=None, help="folder for the CSV and PNG (default: none written)")
    kernels.add_argument("--no-chart", action="store_true", help="do not write the category chart")
    memory = sub.add_parser("memory", help="live memory at the peak and the timeline of an allocator snapshot",
                            description="What was live at the peak of an allocator snapshot (.pickle from "
                                        "torch.cuda.memory._dump_snapshot), as MemorySnapshot logs it, and the "
                                        "active-memory timeline PNG.")
    memory.add_argument("snapshot", type=Path, help="the snapshot (.pickle)")
    memory.add_argument("--device", type=int, default=None, help="CUDA device index (default: every device in it)")
    memory.add_argument("--top-n", type=int, default=10, help="rows of the top-allocation table (default 10)")
    memory.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default: none written)")
    memory.add_argument("--no-chart", action="store_true", help="do not write the timeline PNG")


def run(args: argparse.Namespace) -> int:
    """Run the chosen sub-command; prints the report, writes the files, returns the exit status."""
    try:
        if args.out is not None:
            check_writable_folder("--out", args.out)
        return _kernels(args) if args.what == "kernels" else _memory(args)
    except LmtrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _check(field: str, value: int | None, minimum: int) -> None:
    if value is not None and value < minimum:
        raise LmtrainError(f"analyze.{field}", f"must be >= {minimum}, got {value}.", f"give {field} >= {minimum}.")


def _input(path: Path, what: str) -> Path:
    if not path.is_file():
        raise LmtrainError(f"analyze {what}", f"{path} is not a file.", f"give the path of a saved {what} file.")
    return path


def _kernels(args: argparse.Namespace) -> int:
    from lmtrain.analysis import kernels

    _check("top_k", args.top_k, 1)
    _check("head_dim", args.head_dim, 1)
    paths = _trace_files(args.trace)
    found = {}
    for rank, path in paths.items():
        try:
            trace = kernels.load_trace(path)
        except (OSError, ValueError) as e:  # not JSON, not gzip, not a trace
            raise LmtrainError("analyze kernels", f"cannot read {path}: {e}",
                               "give a Chrome trace from torch.profiler (export_chrome_trace).") from e
        found[rank] = kernels.analyze_trace(trace, args.device, head_dim=args.head_dim, top_k=args.top_k,
                                            batches=f"{_profiler_steps(trace)} (ProfilerStep numbers) of {path.name}")
    first = found[min(found)]
    if len(found) > 1:
        print(f"# {len(found)} ranks in {args.trace}; the kernel report of rank {min(found)}\n")
    print(first.report)
    for scope, table in first.tables(args.top_k).items():
        if scope != "step":  # the report ends with the step's table
            print(f"\n**Top {'kernel' if first.cuda else 'CPU op'}s, {scope}:**\n{table}")
    for rank, one in found.items():
        print(f"\n## Rank {rank}: temporal breakdown ({paths[rank].name})\n" if len(found) > 1 else "")
        print(one.breakdown)
    if len(found) > 1:
        print("\n" + rank_table(found))
    if args.out is None:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for rank, one in found.items():
        suffix = f"_rank{rank}" if len(found) > 1 else ""
        kernels.write_csv(one.summary, str(args.out / f"kernel_table{suffix}.csv"))
        written.append(args.out / f"kernel_table{suffix}.csv")
        fig = None if args.no_chart else kernels.category_chart(one.summary, cuda=one.cuda)
        if fig is not None:
            fig.savefig(args.out / f"kernel_categories{suffix}.png", dpi=110)
            written.append(args.out / f"kernel_categories{suffix}.png")
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


def rank_table(found: dict) -> str:
    """Markdown: one row per rank with its breakdown shares, overlap, how much slower compute ran beside
    communication (and the ms per step that cost), host wait and launch-bound verdict."""
    from lmtrain.analysis.tables import markdown_table

    def pct(m: dict, key: str) -> str:
        return f"{100 * m[key]:.1f}%" if key in m else "-"

    def beside(m: dict) -> str:
        slowdown = m.get("kernels/compute_beside_comm_slowdown")
        return "-" if slowdown is None else \
            f"{slowdown:.2f}x ({m['kernels/compute_beside_comm_excess_ms_step']:+.2f} ms)"

    rows = [[r, f"{m.get('breakdown/span_ms_per_step', 0.0):.3f}", *[pct(m, f"breakdown/{k}_share") for k in
            ("compute", "communication", "memory", "idle")], pct(m, "breakdown/comm_overlap_share"), beside(m),
             pct(m, "idle/host_wait_share"), f"{m.get('launch/kernels_per_step', 0):g}",
             "yes" if m.get("launch/bound") else "no"]
            for r, m in ((rank, one.metrics) for rank, one in sorted(found.items()))]
    return markdown_table(["rank", "span ms/step", "compute", "communication", "memory", "idle", "comm hidden",
                           "compute beside comm", "idle: host wait", "kernels/step", "launch-bound"], rows)


def _trace_files(path: Path) -> dict[int, Path]:
    """Rank -> trace file: the file itself (rank 0), or a folder's ``*.json`` / ``*.json.gz`` files (those with
    ``trace`` in their names when there are any: a run's log folder holds other JSON too), ranked by a ``rank<r>`` in
    their names, else in name order."""
    if path.is_file():
        return {0: path}
    if not path.is_dir():
        raise LmtrainError("analyze kernels", f"{path} is neither a file nor a folder.",
                           "give a saved trace file, or a folder with one trace per rank.")
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith((".json", ".json.gz")))
    files = [p for p in files if "trace" in p.name] or files
    if not files:
        raise LmtrainError("analyze kernels", f"{path} holds no .json or .json.gz trace.",
                           "give a folder with one torch.profiler trace per rank.")
    ranks = [re.search(r"rank[_-]?(\d+)", p.name) for p in files]
    if all(ranks) and len({int(m.group(1)) for m in ranks}) == len(files):
        return {int(m.group(1)): p for m, p in sorted(zip(ranks, files, strict=True), key=lambda x: int(x[0].group(1)))}
    return dict(enumerate(files))


def _profiler_steps(trace: dict) -> str:
    """``ProfilerStep#a..b`` ranges of a trace, as ``a..b`` (``?`` when it has none)."""
    steps = sorted(int(e["name"].split("#", 1)[1]) for e in trace.get("traceEvents", [])
                   if str(e.get("name", "")).startswith("ProfilerStep#") and e["name"].split("#", 1)[1].isdigit())
    return f"{steps[0]}..{steps[-1]}" if steps else "?"


def _memory(args: argparse.Namespace) -> int:
    from lmtrain.analysis import memory

    _check("top_n", args.top_n, 1)
    _check("device", args.device, 0)
    path = _input(args.snapshot, "snapshot")
    try:
        snapshot = memory.load_snapshot(path)
    except Exception as e:  # noqa: BLE001 (unpickling can fail in many ways: say which file and go)
        raise LmtrainError("analyze memory", f"cannot read {path}: {type(e).__name__}: {e}",
                           "give a snapshot pickled by torch.cuda.memory._dump_snapshot.") from e
    devices = memory.snapshot_devices(snapshot) if args.device is None else [args.device]
    if not devices or not any(memory.device_trace(snapshot, d) for d in devices):
        raise LmtrainError("analyze memory", f"{path} holds no allocation trace for device(s) {devices or '-'}.",
                           "record it with torch.cuda.memory._record_memory_history() before the snapshot.")
    out, written = args.out, []
    for device in devices:
        print(f"## Device {device}\n")
        print(memory.peak_report(snapshot, device, args.top_n, where=f"`{path.name}` (device {device})",
                                 snapshot_name=path.name))
        print()
        if out is not None and not args.no_chart:
            out.mkdir(parents=True, exist_ok=True)
            fig = memory.render_timeline(snapshot, device, [], title=f"{path.name}: active memory, device {device}")
            png = out / f"memory_timeline_{path.stem}_device{device}.png"
            fig.savefig(png, dpi=110)
            written.append(png)
    if written:
        print("wrote " + ", ".join(str(p) for p in written))
    return 0
