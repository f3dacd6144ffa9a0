"""Check a fit's TensorBoard logs against the instrument acceptance: "other" share, KernelShare busy vs timer step.

Usage::

    python benchmarks/scripts/instruments_check.py LOG_DIR [LOG_DIR ...]

LOG_DIR is a run's version folder (``logs/lmtrain/version_N``) of a fit with CudaSyncTimer and KernelShare attached.
For each it prints the timer's median ``time/step_ms`` over the steps outside KernelShare's window, KernelShare's
GPU busy time per step (``kernels/gpu_busy_ms_per_step``: the union of kernel intervals) and GPU span per step, the
busy / step ratio, the "other" category's share of kernel time, the temporal breakdown shares, and whether the two
acceptance figures hold: other <= 1% and busy within 3% of the step.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lmtrain.analysis.tables import markdown_table


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def check(log_dir: Path) -> tuple[list[str], bool]:
    s = scalars(log_dir)
    window = {step for step, _ in s.get("kernels/total_ms_per_step", [])}
    last = max(window) if window else -1
    # KernelShare's window ends at its reporting step; keep the timer's steps well clear of it (3 on each side)
    steps = [v for step, v in s.get("time/step_ms", []) if abs(step - last) > 3]
    step_ms = statistics.median(steps) if steps else float("nan")
    first = {tag: values[0][1] for tag, values in s.items() if values}
    busy, other = first.get("kernels/gpu_busy_ms_per_step", float("nan")), first.get("kernels/other_share_step", 0.0)
    ratio = busy / step_ms if step_ms else float("nan")
    ok = other <= 0.01 and abs(ratio - 1) <= 0.03
    row = [log_dir.name, f"{step_ms:.3f}", f"{busy:.3f}", f"{first.get('breakdown/span_ms_per_step', 0):.3f}",
           f"{ratio:.3f}", f"{100 * other:.2f}%",
           *[f"{100 * first.get(f'breakdown/{k}_share', 0):.1f}%" for k in ("compute", "communication", "memory",
                                                                             "idle")],
           f"{100 * first.get('breakdown/comm_overlap_share', 0):.1f}%", "yes" if ok else "NO"]
    return row, ok


def main(argv: list[str]) -> int:
    rows, ok = [], True
    for arg in argv:
        row, good = check(Path(arg))
        rows.append(row)
        ok &= good
    print(markdown_table(["run", "timer step ms (median)", "GPU busy ms/step", "GPU span ms/step", "busy / step",
                          "other", "compute", "communication", "memory", "idle", "comm hidden", "pass"], rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
