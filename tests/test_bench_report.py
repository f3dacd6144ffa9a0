"""`python -m lmtrain bench report`: the Markdown report and its plots, from canned results."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lmtrain.bench import model as bench
from lmtrain.bench.report import estimate_seconds, with_current_plan, write_report
from lmtrain.bench.studies import STUDIES


def canned_rows() -> dict[str, list[dict]]:
    per_study: dict[str, list[dict]] = {"timing": [], "memory": []}
    for size, base in (("small", 10.0), ("medium", 30.0)):
        for t in (128, 256, 512):
            for mode in ("forward", "forward_backward"):
                cell = bench.Cell(size, t, 4, "32-true", "sdpa", False, mode, 3, 10)
                row = bench.base_row(cell)
                ms = base * t / 128 * (1 if mode == "forward" else 3)
                row.update(status="ok", step_ms_mean=ms, step_ms_std=0.1, forward_ms_mean=base, forward_ms_std=0.1,
                           tokens_per_s=4 * t / ms * 1e3, mfu=0.4, device="NVIDIA H100 80GB HBM3")
                per_study["timing"].append(bench.finish_row(row))
    for t in (128, 512, 1024):
        cell = bench.Cell("2.7B", t, 4, "32-true", "sdpa", False, "train", 1, 2)
        row = bench.base_row(cell)
        if t == 1024:
            row.update(status="OOM", error="CUDA out of memory")
        else:
            row.update(status="ok", step_ms_mean=900.0, peak_gib=row["estimate_gib"] * 1.03, device="NVIDIA H100")
        per_study["memory"].append(bench.finish_row(row))
    return per_study


def test_report_has_tables_plots_and_commands(tmp_path: Path) -> None:
    out = tmp_path / "2026-01-01-H100-model.md"
    written = write_report(out, canned_rows(), ["python -m lmtrain bench report --out x.md"],
                           {"date": "2026-01-01", "torch": "2.11.0", "triton": "3.6.0"},
                           skipped={"compile": "estimated 30.0 min, 2.0 min of the budget left",
                                    "memory": "estimated 9.0 min, 1.0 min of the budget left"})
    text = re.sub(" +", " ", out.read_text())  # tables are padded to column width
    # a skipped study with cells from an earlier run is shown, marked partial; one without cells is only named
    memory = text[text.index("(`--study memory`)"):]
    assert memory.index("Partial: this report did not run the study (estimated 9.0 min") < memory.index("| 2.7B |")
    assert text.count("Partial:") == 1
    assert text.startswith("# Model benchmarks: 2026-01-01")
    assert "| torch | 2.11.0 |" in text and "python -m lmtrain bench report --out x.md" in text
    assert "## Timing per size and context (`--study timing`)" in text
    assert "| small | 128,625,408 | 128 |" in text
    assert "`compile`: estimated 30.0 min" in text
    assert re.search(r"\| 2\.7B \| 1024 \| 4 \| 32-true \| train \| - \| 7\d\.\d\d \| - \| - \| OOM \|", text)
    assert "| -2.9% |" in text  # plan = peak / 1.03: the estimate error column
    pngs = [p for p in written if p.suffix == ".png"]
    assert len(pngs) == 2 and all(p.read_bytes().startswith(b"\x89PNG") for p in pngs)
    assert all(f"]({p.name})" in text for p in pngs)


def test_time_estimate_counts_cells_and_skips_done() -> None:
    probe_cell = bench.Cell("small", 128, 4, "32-true", "sdpa", False, "forward", 1, 2)
    probe = {"step_ms_mean": 10.0, "wall_s": 2.03, "device": "cpu"}
    cells = bench.cells_from_values({**bench.DEFAULTS, **STUDIES["timing"].preset})
    full = estimate_seconds(cells, probe, probe_cell, set())
    half = estimate_seconds(cells, probe, probe_cell, {c.key() for c in cells[: len(cells) // 2]})
    assert 0 < half < full
    assert estimate_seconds(cells[:1], probe, probe_cell, set()) >= 2.0  # at least the start-up cost
    json.dumps(full)


def test_rows_get_the_current_memory_plan() -> None:
    cell = bench.Cell("small", 128, 4, "bf16-mixed", "sdpa", False, "forward", 1, 2)
    row = bench.finish_row({**bench.base_row(cell), "status": "ok", "peak_gib": 1.0})
    stale = {**row, "estimate_gib": 99.0, "estimate_error_pct": 9800.0}  # an older planner's numbers
    fresh = with_current_plan(stale)
    assert fresh["estimate_gib"] == pytest.approx(row["estimate_gib"]) and fresh["estimate_gib"] != 99.0
    assert fresh["estimate_error_pct"] == pytest.approx(100.0 * (row["estimate_gib"] - 1.0))
    assert with_current_plan({"key": "not json", "estimate_gib": 3.0})["estimate_gib"] == 3.0


def test_report_from_results_only_uses_the_recorded_environment_and_commands(tmp_path: Path) -> None:
    from lmtrain.cli import main

    results = tmp_path / "res.csv"
    rows = [r for rows in canned_rows().values() for r in rows]
    env = {"python": "3.12.3", "torch": "2.11.0+cu130", "lightning": "2.6.6", "CUDA (torch build)": "13.0",
           "triton": "3.6.0", "driver": "580.1"}
    bench.save_results(results, rows, {"commands": ["python -m lmtrain bench model --study timing --out res.csv"],
                                       "environment": env, "launcher": "fork"})
    out = tmp_path / "report.md"
    assert main(["bench", "report", "--out", str(out), "--results", str(results), "--no-run",
                 "--studies", "timing", "memory"]) == 0
    text = re.sub(" +", " ", out.read_text())
    assert "| torch | 2.11.0+cu130 |" in text and "| driver | 580.1 |" in text
    block = text[text.index("Commands:"):]
    assert block.index("bench model --study timing --out res.csv") < block.index("bench report --out")
    assert "| 2.7B | 1024 | 4 | 32-true | train |" in text  # the OOM cell, from the file alone
