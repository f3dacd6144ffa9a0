"""``lmtrain.analysis.kernels.step_comparison``: the profiled steps' GPU time next to the timer's unprofiled step."""

from __future__ import annotations

import pytest

from lmtrain.analysis.kernels import step_comparison


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and "---" not in line]


def test_host_bound_step_shows_busy_span_wall_and_timer_step() -> None:
    metrics = {"kernels/gpu_busy_ms_per_step": 12.0, "kernels/gpu_span_ms_per_step": 50.0,
               "kernels/step_wall_ms": 60.0, "kernels/total_ms_per_step": 12.5}
    scalars, text = step_comparison(metrics, 59.0, 22)
    assert scalars == pytest.approx({"kernels/timer_step_ms": 59.0, "kernels/busy_to_timer_step": 12 / 59,
                                     "kernels/span_to_timer_step": 50 / 59, "kernels/wall_to_timer_step": 60 / 59})
    assert _rows(text)[1:] == [["kernel busy time", "12.000", "0.203"],
                               ["GPU span (first kernel to last)", "50.000", "0.847"],
                               ["profiled step, wall time", "60.000", "1.017"],
                               ["timer step, median of 22 unprofiled steps", "59.000", "1.000"]]


def test_without_a_timer_only_the_profiled_times_and_a_note() -> None:
    scalars, text = step_comparison({"kernels/total_ms_per_step": 3.0, "kernels/step_wall_ms": 4.0}, None)
    assert scalars == {}
    assert _rows(text)[1:3] == [["kernel busy time", "3.000", "-"], ["GPU span (first kernel to last)", "-", "-"]]
    assert "No timer step to compare with" in text
