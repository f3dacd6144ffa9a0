"""``benchmarks/scripts/tb_figures.py``: the docs' figures drawn from TensorBoard event files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tb_figures():  # noqa: ANN201 (a module)
    sys.path.insert(0, str(ROOT / "benchmarks" / "scripts"))
    try:
        import tb_figures

        yield tb_figures
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "scripts"))


@pytest.mark.slow
def test_figures_of_the_tags_a_run_has(tmp_path: Path, tb_figures, capsys: pytest.CaptureFixture) -> None:  # noqa: ANN001
    pytest.importorskip("matplotlib")
    from torch.utils.tensorboard import SummaryWriter

    log_dir = tmp_path / "lmtrain" / "version_0"
    writer = SummaryWriter(str(log_dir))
    for step in range(3):
        writer.add_scalar("time/step_ms", 10.0 + step, step)
    writer.add_scalar("launch/host_wait_share", 0.4, 7)
    writer.add_text("kernels/step_comparison", "| per step | ms |\n| --- | --- |\n| kernel busy time | 3.0 |", 9)
    writer.close()
    assert tb_figures.main([str(tmp_path / "png"), str(log_dir), "--prefix", "run"]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == ["run-launch.png", "run-where.png"]
    assert "comm: none of its tags" in out and "hardware: none of its tags" in out
    scalars, texts = tb_figures.read(log_dir)
    assert scalars["time/step_ms"] == [(0, 10.0), (1, 11.0), (2, 12.0)]
    assert texts["kernels/step_comparison"].endswith("| kernel busy time | 3.0 |")


def test_long_text_lines_are_wrapped_or_cut(tb_figures) -> None:  # noqa: ANN001
    prose = "word " * 70  # 350 characters
    row = "| " + " | ".join(f"cell {i:03d}" for i in range(40)) + " |"
    lines = tb_figures.panel_lines(f"{prose}\n{row}\nshort", width=100, max_lines=40)
    assert all(len(line) <= 100 for line in lines)
    assert lines[-1] == "short"
    assert lines[-2] == row[:97] + "..."  # a table row is cut, not wrapped
    wrapped = lines[:-2]
    assert len(wrapped) == 4 and " ".join(w.strip() for w in wrapped) == prose.strip()
    many = tb_figures.panel_lines("\n".join(f"line {i}" for i in range(50)), width=100, max_lines=40)
    assert len(many) == 41 and many[-1] == "... (10 more lines)" and many[39] == "line 39"
