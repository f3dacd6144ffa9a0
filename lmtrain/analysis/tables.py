"""Plain-text tables shared by reports, callbacks and benchmarks."""

from __future__ import annotations

from typing import Any


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table (TensorBoard renders it in the Text tab; terminals print it readably)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + " |" for row in cells]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)
