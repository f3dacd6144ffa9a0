"""``lmtrain.analysis.kernels.step_comparison``: the profiled steps' GPU time next to the timer's step, on the
unprofiled steps (its median) and on the very steps that were profiled (its mean)."""

from __future__ import annotations

import pytest

from lmtrain.analysis.kernels import step_comparison


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and "---" not in line]


#: A host-bound small-model step as an H100 shows it: the GPU busy 12 ms of an ordinary 61.5 ms step, the profiler
#: doubling the profiled steps (wall 120 ms; the timer's own clock on those steps: 119.8 ms).
HOST_BOUND = {"kernels/gpu_busy_ms_per_step": 12.0, "kernels/gpu_span_ms_per_step": 118.6,
              "kernels/gpu_idle_ms_per_step": 106.6, "kernels/step_wall_ms": 120.0, "kernels/total_ms_per_step": 12.5}


def test_host_bound_step_shows_busy_span_wall_and_timer_step() -> None:
    metrics = {"kernels/gpu_busy_ms_per_step": 12.0, "kernels/gpu_span_ms_per_step": 50.0,
               "kernels/step_wall_ms": 60.0, "kernels/total_ms_per_step": 12.5}
    scalars, text = step_comparison(metrics, 59.0, 22)
    assert scalars == pytest.approx({"kernels/timer_step_ms": 59.0, "kernels/busy_to_timer_step": 12 / 59,
                                     "kernels/span_to_timer_step": 50 / 59, "kernels/wall_to_timer_step": 60 / 59})
    assert _rows(text)[1:] == [["kernel busy time", "12.000", "0.203", "-"],
                               ["GPU span (first kernel to last)", "50.000", "0.847", "-"],
                               ["profiled step, wall time", "60.000", "1.017", "-"],
                               ["timer step, median of 22 unprofiled steps", "59.000", "1.000", "-"],
                               ["timer step, mean of 0 profiled steps", "-", "-", "-"]]


def test_the_profiled_steps_are_set_against_the_timer_on_those_same_steps() -> None:
    """busy / timer step 0.195 is the host-bound physics; span / timer on the profiled steps 0.990 says the trace
    accounts for the whole profiled step; wall / timer step 1.951 is the profiler's own slowdown."""
    scalars, text = step_comparison(HOST_BOUND, 61.5, 22, 119.8, 2)
    assert scalars == pytest.approx({
        "kernels/timer_step_ms": 61.5, "kernels/busy_to_timer_step": 12 / 61.5,
        "kernels/span_to_timer_step": 118.6 / 61.5, "kernels/wall_to_timer_step": 120 / 61.5,
        "kernels/timer_profiled_step_ms": 119.8, "kernels/busy_to_timer_profiled": 12 / 119.8,
        "kernels/span_to_timer_profiled": 118.6 / 119.8, "kernels/wall_to_timer_profiled": 120 / 119.8})
    # the span is busy + idle: its ratio is the trace's accounting of the whole profiled step
    busy_plus_idle = HOST_BOUND["kernels/gpu_busy_ms_per_step"] + HOST_BOUND["kernels/gpu_idle_ms_per_step"]
    assert scalars["kernels/span_to_timer_profiled"] == pytest.approx(busy_plus_idle / 119.8)
    assert _rows(text) == [["per step", "ms", "/ timer step", "/ timer, profiled steps"],
                           ["kernel busy time", "12.000", "0.195", "0.100"],
                           ["GPU span (first kernel to last)", "118.600", "1.928", "0.990"],
                           ["profiled step, wall time", "120.000", "1.951", "1.002"],
                           ["timer step, median of 22 unprofiled steps", "61.500", "1.000", "0.513"],
                           ["timer step, mean of 2 profiled steps", "119.800", "1.948", "1.000"]]
    assert "span / timer, profiled steps: near 1 when the trace accounts for the whole profiled step" in text


def test_the_profiled_steps_alone_when_every_step_was_profiled() -> None:
    """No step outside the windows (no median): the comparison on the profiled steps still stands."""
    scalars, text = step_comparison({"kernels/total_ms_per_step": 3.0, "kernels/step_wall_ms": 4.0}, None, 0, 5.0, 3)
    assert scalars == pytest.approx({"kernels/timer_profiled_step_ms": 5.0, "kernels/busy_to_timer_profiled": 0.6,
                                     "kernels/wall_to_timer_profiled": 0.8})
    assert _rows(text)[1:] == [["kernel busy time", "3.000", "-", "0.600"],
                               ["GPU span (first kernel to last)", "-", "-", "-"],
                               ["profiled step, wall time", "4.000", "-", "0.800"],
                               ["timer step, median of 0 unprofiled steps", "-", "-", "-"],
                               ["timer step, mean of 3 profiled steps", "5.000", "-", "1.000"]]
    assert "No unprofiled timer step to compare with" in text


def test_a_timer_without_every_profiled_step_says_so() -> None:
    scalars, text = step_comparison(HOST_BOUND, 61.5, 22, None, 2)
    assert not any("profiled" in tag for tag in scalars) and "kernels/span_to_timer_step" in scalars
    assert "The timer did not measure every profiled step" in text


def test_without_a_timer_only_the_profiled_times_and_a_note() -> None:
    scalars, text = step_comparison({"kernels/total_ms_per_step": 3.0, "kernels/step_wall_ms": 4.0}, None)
    assert scalars == {}
    assert _rows(text)[1:3] == [["kernel busy time", "3.000", "-", "-"], ["GPU span (first kernel to last)", "-", "-",
                                                                         "-"]]
    assert "No timer step to compare with" in text
