"""benchmarks/scripts/blas_memset_probe.py on the CPU: its per-replay figures on a constructed trace, exact; and the
refusal without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import SCRIPTS, load_script


def test_replay_stats_on_a_constructed_trace() -> None:
    probe = load_script("blas_memset_probe")

    def op(cat: str, name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    # two replays: memset (1 µs), gap 4, GEMM 100, gap 2, attention 50 overlapped by a copy, then a 500 µs pause
    events = []
    for t0 in (0.0, 1000.0):
        events += [op("gpu_memset", "Memset (Device)", t0, 1), op("kernel", "nvjet_sm90_tst_coopB_NTT", t0 + 5, 100),
                   op("kernel", "_flash_attn_fwd", t0 + 107, 50), op("gpu_memcpy", "Memcpy DtoD", t0 + 120, 60)]
    events.append({"ph": "i", "cat": "kernel", "name": "instant", "ts": 3})  # not a complete event: ignored
    stats = probe.replay_stats(events, replays=2)
    assert stats["ops_per_replay"] == 4 and stats["memsets_per_replay"] == 1
    # busy per replay: 1 + 100 + (107..180) 73 = 174 µs; gaps under 200 µs: 4 + 2 (the 820 µs pause is not one)
    assert stats["busy_ms"] == pytest.approx(0.174) and stats["small_gaps_ms"] == pytest.approx(0.006)
    assert stats["gemm_ms"] == pytest.approx(0.1)
    assert stats["memset_before"] == {"nvjet_sm90_tst_coopB_NTT": 2}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_says_so_in_one_line() -> None:
    done = subprocess.run([sys.executable, str(SCRIPTS / "blas_memset_probe.py")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "blas_memset_probe: needs a CUDA GPU (it captures a CUDA graph); none is visible."]
