"""The scaling driver's cell names and its table (benchmarks/scripts/fsdp_scaling.py), on constructed results."""

from __future__ import annotations

import argparse

import pytest
from conftest import load_script


@pytest.fixture(scope="module")
def driver():  # noqa: ANN201
    return load_script("fsdp_scaling")


def test_cells_name_any_gpu_count(driver) -> None:  # noqa: ANN001
    assert [driver.cell_devices(c) for c in ("fsdp1", "baseline4", "ddp12")] == [1, 4, 12]
    assert driver.cell_name("fsdp4") == "fsdp4"
    for bad in ("fsdp", "fsdp0", "gpu4", "4"):
        with pytest.raises(argparse.ArgumentTypeError, match="fsdpN"):
            driver.cell_name(bad)


def test_table_scaling_and_baseline_ratio(driver) -> None:  # noqa: ANN001
    results = {
        "fsdp1": {"cell": "fsdp1", "devices": 1, "step_ms": 200.0, "tokens_per_s_per_gpu": 20480.0},
        "fsdp4": {"cell": "fsdp4", "devices": 4, "step_ms": 250.0, "tokens_per_s_per_gpu": 16384.0},
        "baseline4": {"cell": "baseline4", "devices": 4, "step_ms": 256.0, "tokens_per_s_per_gpu": 16000.0},
        "ddp2": {"cell": "ddp2", "error": "boom"},
    }
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in driver.table(results).splitlines()[2:]}
    assert rows["fsdp4"][4] == "0.800"  # 16384 / 20480
    assert rows["fsdp4"][5] == "1.024"  # 16384 / 16000
    assert rows["fsdp1"][4] == "" and rows["baseline4"][5] == ""
    assert "failed" in rows["ddp2"][2]
