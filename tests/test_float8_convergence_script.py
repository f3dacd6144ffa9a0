"""The float8 convergence driver (benchmarks/scripts/float8_convergence.py): its commands, its table and verdict on
constructed results, and its CPU smoke end to end (float8 refused on a CPU, recorded as such)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "scripts" / "float8_convergence.py"


@pytest.fixture(scope="module")
def driver() -> ModuleType:
    return load_script("float8_convergence")


def _rows(table: str) -> dict[str, list[str]]:
    return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in table.splitlines()[2:]}


def test_runs_differ_only_in_state_and_float8(driver, tmp_path: Path) -> None:  # noqa: ANN001
    commands = {name: driver.run_command(name, tmp_path, tmp_path / "cache", ["--model.lr", "1e-3"])
                for name in driver.RUNS}
    assert list(commands)[0] == driver.REFERENCE == "bf16_fp32_state"
    for name, command in commands.items():
        options = {key: command[i + 1] for i, key in enumerate(command[:-1]) if key.startswith("--")}
        assert options["--trainer.logger.init_args.version"] == name
        assert options["--compile_cache"] == str(tmp_path / "cache")
        assert command[-2:] == ["--model.lr", "1e-3"]
        assert options["--model.master_weights"] == ("true" if "compact" in name else "false")
        assert options["--model.optimizer_state_dtype"] == ("bfloat16" if "compact" in name else "float32")
        assert options["--model.float8"] == ("tensorwise" if name.startswith("float8") else "none")
        # small's widths are 768 and 3072: the default size rule (2048) would convert none of its layers.
        assert (options.get("--model.float8_min_features") == "768") == name.startswith("float8")


def test_table_ratio_and_one_percent_verdict(driver) -> None:  # noqa: ANN001
    rows = {
        "float8": {"status": 0, "final_val_loss": 2.03, "step_ms_median": 9.5, "wall_s": 80.0},
        "bf16_fp32_state": {"status": 0, "final_val_loss": 2.0, "step_ms_median": 7.0, "wall_s": 70.0},
        "bf16_compact": {"status": 0, "final_val_loss": 2.015, "step_ms_median": 6.0, "wall_s": 60.5},
        "float8_compact": {"status": 2, "refused": "error: model.float8: no GPU", "wall_s": 5.0},
    }
    table = driver.table(rows)
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:]] == list(driver.RUNS)
    got = _rows(table)
    assert got["bf16_fp32_state"][1:4] == ["2.0000", "1.0000", "yes"]
    assert got["bf16_compact"][1:4] == ["2.0150", "1.0075", "yes"]
    assert got["float8"][1:4] == ["2.0300", "1.0150", "no"]
    assert got["float8"][4:7] == ["9.50", "80.0", "ok"]
    assert got["float8_compact"][1:5] == ["", "", "", ""]
    assert got["float8_compact"][6] == "refused: error: model.float8: no GPU"
    assert not driver.passed(rows, list(rows))
    assert driver.passed(rows, ["bf16_fp32_state", "bf16_compact"])
    assert driver.passed(rows, ["bf16_compact", "float8_compact"], allow_refused=True)
    assert not driver.passed(rows, ["bf16_compact", "float8_compact"])
    # Without the reference there is nothing to compare with.
    del rows["bf16_fp32_state"]
    assert _rows(driver.table(rows))["bf16_compact"][1:4] == ["2.0150", "", ""]
    assert not driver.passed(rows, ["bf16_compact"])


def test_within_is_relative_on_both_sides(driver) -> None:  # noqa: ANN001
    assert driver.within(3.0, 2.0, tolerance=0.5) and driver.within(1.0, 2.0, tolerance=0.5)
    assert not driver.within(3.0, 2.0, tolerance=0.25) and not driver.within(1.0, 2.0, tolerance=0.25)
    assert driver.within(2.0, 2.0, tolerance=0.0)


def test_val_every_must_divide_steps(driver, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        driver.main(["--out", str(out), "--steps", "10", "--val-every", "3"])
    assert exit_info.value.code == 2
    assert not out.exists()


@pytest.mark.slow
def test_cpu_smoke_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "conv"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--cpu-smoke"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert list(runs) == ["bf16_fp32_state", "bf16_compact", "float8", "float8_compact"]
    for name in ("bf16_fp32_state", "bf16_compact"):
        row = runs[name]
        assert row["status"] == 0 and "refused" not in row
        assert [step for step, _ in row["val_loss"]] == [1, 3]  # validated after steps 2 and 4
        assert row["final_val_loss"] == row["val_loss"][-1][1] > 0
        assert len(row["train_loss"]) == 4 and row["step_ms_median"] > 0
        assert (out / "tensorboard" / name).is_dir()
    for name in ("float8", "float8_compact"):
        assert runs[name]["status"] == 2 and "model.float8" in runs[name]["refused"]
        assert "--model.float8_min_features 768" in runs[name]["command"]
    table = (out / "table.md").read_text()
    assert _rows(table)["bf16_fp32_state"][2:4] == ["1.0000", "yes"]
    assert table.strip() in result.stdout
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A second call for one run keeps the other runs' results from the first.
    again = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--cpu-smoke", "--runs", "float8"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    kept = json.loads((out / "results.json").read_text())["runs"]
    assert set(kept) == set(runs) and kept["bf16_compact"] == runs["bf16_compact"]


def test_side_by_side_launch_shows_one_gpu_and_stops_a_hung_run(driver) -> None:  # noqa: ANN001
    show = [sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"]
    status, output, _ = driver.finish(driver.launch(show, "3"), timeout=60)
    assert (status, output.strip()) == (0, "3")
    status, output, wall = driver.finish(driver.launch([sys.executable, "-c", "import time; time.sleep(30)"], None),
                                         timeout=1)
    assert status == -1 and "stopped after 1 s" in output and wall < 20
