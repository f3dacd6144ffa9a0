"""benchmarks/scripts/power_cycle_probe.py on the CPU: its reading of nvidia-smi's samples and of the timed iterations
on constructed input, exact; and the refusal without a GPU."""

from __future__ import annotations

import datetime
import subprocess
import sys

import pytest
from conftest import SCRIPTS, load_script


def test_parse_smi_reads_the_query_and_skips_what_does_not_parse() -> None:
    probe = load_script("power_cycle_probe")
    lines = ["timestamp, clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active",
             "2026/11/28 13:05:23.120, 1650 MHz, 305.25 W, 0x0000000000000004",
             "2026/11/28 13:05:23.170, [N/A], 300.00 W, 0x0000000000000000",
             "2026/11/28 13:05:23.220, 1980 MHz, 80.54 W, 0x0000000000000001"]
    samples = probe.parse_smi(lines)
    first = datetime.datetime(2026, 11, 28, 13, 5, 23, 120000).timestamp()
    assert samples == [(pytest.approx(first), 1650, 305.25, 4), (pytest.approx(first + 0.1), 1980, 80.54, 1)]


def test_slow_iterations_and_the_load_summary() -> None:
    probe = load_script("power_cycle_probe")
    rows = [(100.0, 30.0), (100.5, 30.0), (101.0, 36.0), (101.5, 30.0), (102.0, 30.9), (102.5, 31.0)]
    result = probe.slow_iterations(rows, slow=1.03)
    # median of 30, 30, 30, 30.9, 31, 36 = 30.45; 36 / 30.45 and 31 / 30.45 are over 1.03 only for 36
    assert result == {"iterations": 6, "median_ms": 30.45, "slow": [[1.0, round(36 / 30.45, 3)]]}
    samples = [(0.0, 1980, 80.0, 1), (0.05, 1650, 600.0, 4), (0.1, 1400, 700.0, 4 | 1), (0.15, 1700, 650.0, 0)]
    assert probe.load_summary(samples) == {"samples": 3, "sm_mhz_median": 1650, "sm_mhz_min": 1400,
                                           "power_w_median": 650.0, "power_cap_share": 2 / 3}
    assert probe.load_summary(samples[:1]) is None


def test_smi_index_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = load_script("power_cycle_probe")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert probe.smi_index() == "0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert probe.smi_index() == "3"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_says_so_in_one_line() -> None:
    done = subprocess.run([sys.executable, str(SCRIPTS / "power_cycle_probe.py"), "--seconds", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "power_cycle_probe: needs a CUDA GPU; none is visible."]
