"""``python -m lmtrain bench comm``: bus bandwidth as nccl-tests defines it, and a run over 2 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmtrain.bench.comm import bandwidths, bus_factor, parse_size, read_record
from lmtrain.cli import main
from lmtrain.errors import LmtrainError


def test_bus_bandwidth_factors() -> None:
    assert bus_factor("all_gather", 8) == bus_factor("reduce_scatter", 8) == 7 / 8
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8
    # 1 GB gathered in 10 ms over 4 ranks: 100 GB/s of algorithm bandwidth, 75 GB/s per link.
    assert bandwidths("all_gather", 10**9, 10.0, 4) == pytest.approx((100.0, 75.0))
    assert bandwidths("all_reduce", 10**9, 10.0, 4) == pytest.approx((100.0, 150.0))
    # 256 MiB (268,435,456 bytes) in 2 ms over 8 ranks: algbw 268435456 / 2e-3 / 1e9 = 134.217728 GB/s; busbw x 7/8
    # = 117.440512 (all-gather, reduce-scatter), x 2 * 7/8 = 234.881024 (all-reduce).
    assert bandwidths("all_gather", 256 * 2**20, 2.0, 8) == pytest.approx((134.217728, 117.440512))
    assert bandwidths("reduce_scatter", 256 * 2**20, 2.0, 8) == pytest.approx((134.217728, 117.440512))
    assert bandwidths("all_reduce", 256 * 2**20, 2.0, 8) == pytest.approx((134.217728, 234.881024))
    # Two ranks: each sends half of an all-gather's buffer (x 1/2) and all of an all-reduce's (x 1).
    assert bandwidths("all_gather", 4096, 0.001, 2) == pytest.approx((4.096, 2.048))
    assert bandwidths("all_reduce", 4096, 0.001, 2) == pytest.approx((4.096, 4.096))


def test_sizes() -> None:
    assert [parse_size(s) for s in ("4K", "16M", "1G", "512", "2MiB")] == [4096, 16 * 2**20, 2**30, 512, 2 * 2**20]
    for bad in ("", "M", "-1K", "1.5M", "0"):
        with pytest.raises(LmtrainError, match="--sizes"):
            parse_size(bad)


def test_bad_arguments_stop_with_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "comm.json"
    assert main(["bench", "comm", "--allow-cpu", "--devices", "1", "--out", str(out)]) == 2
    assert main(["bench", "comm", "--allow-cpu", "--ops", "broadcast", "--out", str(out)]) == 2
    assert main(["bench", "comm", "--allow-cpu", "--sizes", "2", "--dtype", "fp32", "--out", str(out)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert [e.split(":")[1].strip() for e in errors] == ["--devices", "--ops", "--sizes"]
    assert not out.exists()


@pytest.mark.slow
def test_two_gloo_ranks_write_a_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "comm.json"
    assert main(["bench", "comm", "--allow-cpu", "--devices", "2", "--sizes", "4K,64K", "--warmup", "1", "--iters",
                 "2", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "busbw GB/s" in table and "reduce_scatter" in table
    record = read_record(out)
    assert record["meta"]["world_size"] == 2 and record["meta"]["backend"] == "gloo"
    rows = record["rows"]
    assert [(r["op"], r["dtype"], r["bytes"]) for r in rows] == [
        (op, dtype, size) for op, dtype in (("all_gather", "bf16"), ("reduce_scatter", "fp32"), ("all_reduce", "fp32"))
        for size in (4096, 65536)]
    # nccl-tests' factors on 2 ranks, written out: (n-1)/n = 1/2 for all-gather and reduce-scatter, 2(n-1)/n = 1 for
    # all-reduce; algbw is the whole buffer over the time.
    factor = {"all_gather": 0.5, "reduce_scatter": 0.5, "all_reduce": 1.0}
    for r in rows:
        assert r["ms"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["ms"] / 1e6)
        assert r["busbw_gbps"] == pytest.approx(r["bytes"] / r["ms"] / 1e6 * factor[r["op"]])


def test_a_file_that_is_no_record_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(LmtrainError, match="not a bench comm record"):
        read_record(path)


@pytest.mark.gpu
def test_two_gpus_reach_a_bus_bandwidth(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "comm.json"
    assert main(["bench", "comm", "--devices", "2", "--sizes", "1M,256M", "--out", str(out)]) == 0
    record = read_record(out)
    assert record["meta"]["backend"] == "nccl" and len(record["rows"]) == 6
    print(capsys.readouterr().out)
    # NVLink or PCIe, a 256 MiB collective between two GPUs moves well over 1 GB/s per link.
    assert all(r["busbw_gbps"] > 1.0 for r in record["rows"] if r["bytes"] == 256 * 2**20)


def test_sizes_that_name_nothing_are_refused_before_the_ranks_start(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "comm", "--allow-cpu", "--devices", "2", "--sizes", ","]) == 2
    assert "error: --sizes:" in capsys.readouterr().err
