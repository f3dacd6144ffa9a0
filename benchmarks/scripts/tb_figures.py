"""Draw, from a run's TensorBoard event files, the panels a user looks at in TensorBoard for each question of
``docs/callbacks.md``, as PNG files (matplotlib).

Usage::

    python benchmarks/scripts/tb_figures.py OUT_DIR LOG_DIR [--only where launch comm hardware] [--prefix NAME]

LOG_DIR is a run's version folder (``logs/lmtrain/version_N``); OUT_DIR gets ``<prefix>-<figure>.png`` for each
figure below whose tags the run has (a figure with none of its tags is skipped, with a line saying so). Each
scalar tag is one panel, value against the step as TensorBoard's Scalars tab shows it (a value logged once is one
point); each text tag is one panel with the text as logged (the Text tab shows it rendered as Markdown). These are
drawings of the logged values, not screenshots of TensorBoard.

Figures and their tags (the same lists as :data:`FIGURES`):

- ``where``: ``time/forward_ms``, ``time/backward_ms``, ``time/optimizer_ms``, ``time/step_ms``,
  ``breakdown/compute_share``, ``breakdown/idle_share``, ``breakdown/memory_share``; text ``kernels/breakdown``.
- ``launch``: ``launch/host_wait_share``, ``launch/short_kernel_share``, ``launch/delay_median_us``,
  ``idle/host_wait_share``, ``kernels/busy_to_timer_step``, ``kernels/span_to_timer_step``; text
  ``kernels/step_comparison``.
- ``comm``: ``kernels/communication_ms_step``, ``kernels/communication_exposed_ms_step``,
  ``breakdown/comm_overlap_share``, ``time/straggler_ratio``, ``time/step_ms_slowest``, ``time/step_ms_fastest``.
- ``hardware``: ``roofline/gemm_tflops_of_peak``, ``roofline/attention_tflops_of_peak``,
  ``roofline/model_tflops_of_peak``, ``roofline/copy_gbps_of_peak``, ``throughput/mfu``; text ``kernels/report``.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

FIGURES: dict[str, tuple[str, list[str], list[str]]] = {
    "where": ("Where does my step go?",
              ["time/forward_ms", "time/backward_ms", "time/optimizer_ms", "time/step_ms", "breakdown/compute_share",
               "breakdown/idle_share", "breakdown/memory_share"],
              ["kernels/breakdown"]),
    "launch": ("Am I launch-bound?",
               ["launch/host_wait_share", "launch/short_kernel_share", "launch/delay_median_us",
                "idle/host_wait_share", "kernels/busy_to_timer_step", "kernels/span_to_timer_step"],
               ["kernels/step_comparison"]),
    "comm": ("Is communication hidden?",
             ["kernels/communication_ms_step", "kernels/communication_exposed_ms_step",
              "breakdown/comm_overlap_share", "time/straggler_ratio", "time/step_ms_slowest", "time/step_ms_fastest"],
             []),
    "hardware": ("How far from the hardware is each part?",
                 ["roofline/gemm_tflops_of_peak", "roofline/attention_tflops_of_peak", "roofline/model_tflops_of_peak",
                  "roofline/copy_gbps_of_peak", "throughput/mfu"],
                 ["kernels/report"]),
}
#: Lines of a text panel drawn at most (the rest is cut, with a line saying so).
TEXT_LINES = 40
#: Characters per drawn line: prose is wrapped at this width, a table row longer than it is cut (a wrapped row
#: would break the table's columns). Without it one long line made a figure thousands of pixels wide.
TEXT_WIDTH = 150


def panel_lines(text: str, width: int = TEXT_WIDTH, max_lines: int = TEXT_LINES) -> list[str]:
    """The lines of a text panel: prose wrapped at ``width``, table rows cut to it (ending in "..."), at most
    ``max_lines`` of them and then one line saying how many more there were."""
    lines: list[str] = []
    for line in text.splitlines():
        if len(line) <= width:
            lines.append(line)
        elif line.lstrip().startswith("|"):
            lines.append(line[:width - 3] + "...")
        else:
            lines += textwrap.wrap(line, width, subsequent_indent="  ", break_on_hyphens=False)
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more lines)"]
    return lines


def read(log_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, str]]:
    """Scalars (tag -> [(step, value)]) and texts (tag -> the last value) of the event files in ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    texts = {}
    for tag in acc.Tags().get("tensors", []):
        events = acc.Tensors(tag)
        if events and events[-1].tensor_proto.string_val:
            texts[tag.removesuffix("/text_summary")] = events[-1].tensor_proto.string_val[0].decode()
    return scalars, texts


def draw(title: str, scalars: dict[str, list[tuple[int, float]]], texts: dict[str, str], path: Path,
         source: str) -> None:
    """One PNG: a row of scalar panels (three per row), then one panel per text, captioned with ``source``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 3
    scalar_rows = -(-len(scalars) // columns)
    text_lines = {tag: panel_lines(text) for tag, text in texts.items()}
    text_heights = [len(lines) * 0.16 + 0.6 for lines in text_lines.values()]
    height = 2.4 * scalar_rows + sum(text_heights) + 0.8
    fig = plt.figure(figsize=(13, height))
    grid = fig.add_gridspec(scalar_rows + len(texts), columns,
                            height_ratios=[2.4] * scalar_rows + text_heights, hspace=0.6, wspace=0.3)
    for i, (tag, values) in enumerate(scalars.items()):
        ax = fig.add_subplot(grid[i // columns, i % columns])
        steps, ys = zip(*values, strict=True)
        ax.plot(steps, ys, marker="o" if len(values) < 5 else None, markersize=4, linewidth=1.2, color="#ff7043")
        ax.set_title(tag, fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if len(values) == 1:
            ax.annotate(f"{ys[0]:.4g}", (steps[0], ys[0]), textcoords="offset points", xytext=(6, 6), fontsize=8)
    for j, (tag, lines) in enumerate(text_lines.items()):
        ax = fig.add_subplot(grid[scalar_rows + j, :])
        ax.axis("off")
        ax.set_title(tag, fontsize=9, loc="left")
        ax.text(0, 1, "\n".join(lines), family="monospace", fontsize=7, va="top", ha="left", transform=ax.transAxes)
    fig.suptitle(f"{title}\nDrawn from the TensorBoard event files of {source}", fontsize=11)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for the PNG files")
    parser.add_argument("log_dir", type=Path, help="a run's version folder (logs/lmtrain/version_N)")
    parser.add_argument("--only", nargs="+", choices=sorted(FIGURES), help="some figures only")
    parser.add_argument("--prefix", default="callbacks", help="file name prefix")
    args = parser.parse_args(argv)
    scalars, texts = read(args.log_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    for key in args.only or FIGURES:
        title, scalar_tags, text_tags = FIGURES[key]
        have_scalars = {t: scalars[t] for t in scalar_tags if t in scalars}
        have_texts = {t: texts[t] for t in text_tags if t in texts}
        missing = [t for t in scalar_tags + text_tags if t not in have_scalars and t not in have_texts]
        if not have_scalars and not have_texts:
            print(f"{key}: none of its tags in {args.log_dir}; skipped")
            continue
        path = args.out / f"{args.prefix}-{key}.png"
        draw(title, have_scalars, have_texts, path, "/".join(args.log_dir.resolve().parts[-3:]))
        print(f"{key}: {path}" + (f" (not in this run: {', '.join(missing)})" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
