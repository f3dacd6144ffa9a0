"""benchmarks/scripts/comm_interference_probe.py on the CPU: two gloo ranks run each collective beside a burst of
matrix products, and rank 0 prints one JSON row per setting whose figures agree with each other; bad options stop
at parsing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import SCRIPTS, load_script


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
def test_two_gloo_ranks_print_one_consistent_row(op: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPTS / "comm_interference_probe.py"), "--device", "cpu", "--op", op, "--mib", "0.5",
           "--gemm", "48,40,32", "--gemms", "2", "--repeats", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1  # rank 0 only, one setting
    row = rows[0]
    assert (row["op"], row["world_size"], row["gemm"], row["carveout"], row["device"]) == (op, 2, [48, 40, 32], 0,
                                                                                           "cpu")
    assert row["comm_ms"] > 0 and row["gemms_alone_ms"] > 0 and row["gemms_beside_ms"] > 0
    assert row["slowdown"] == pytest.approx(row["gemms_beside_ms"] / row["gemms_alone_ms"])
    assert row["together_ms"] >= row["gemms_beside_ms"]
    assert row["blas"] == "-" and "| carveout | BLAS | NCCL settings |" in done.stdout


@pytest.mark.parametrize("argv, message", [
    (["--gemm", "8,8"], "--gemm: give M,N,K"),
    (["--gemm", "8,x,8"], "--gemm: give M,N,K"),
    (["--repeats", "0"], "--repeats: must be at least 1"),
    (["--mib", "0"], "--mib: must be above 0"),
    (["--device", "cpu", "--carveout", "8"], "--carveout: CUDA only"),
    (["--carveout", "-1"], "--carveout: SMs left free cannot be negative"),
])
def test_bad_options_stop_at_parsing(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    probe = load_script("comm_interference_probe")
    with pytest.raises(SystemExit) as stopped:
        probe.parse_args(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_a_buffer_of_less_than_one_element_per_rank_stops_with_one_line() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPTS / "comm_interference_probe.py"), "--device", "cpu", "--mib", "0.000001", "--gemm", "8,8,8"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.count("error: --mib: 1e-06 MiB is less than one element per rank") == 1
