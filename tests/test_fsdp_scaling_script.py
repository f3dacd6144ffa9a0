"""The scaling driver (benchmarks/scripts/fsdp_scaling.py): cell names, commands and table on constructed results,
and its cell runner on constructed commands (a cell that runs out of time with a child in a session of its own,
one that prints no step time, one with no timed step): each gives an error row with its reason, results.json is
written after every cell, and no process of a stopped cell is left."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import load_script


@pytest.fixture(scope="module")
def driver():  # noqa: ANN201
    return load_script("fsdp_scaling")


def _args(driver, **changes) -> argparse.Namespace:  # noqa: ANN001
    defaults = dict(warmup=3, steps=7, context=256, ddp_context=128, extra=["--trainer.num_nodes", "1"])
    return argparse.Namespace(**(defaults | changes))


def test_cells_name_any_gpu_count(driver) -> None:  # noqa: ANN001
    assert [driver.cell_devices(c) for c in ("fsdp1", "baseline4", "ddp12", "fsdp_same2")] == [1, 4, 12, 2]
    assert [driver.cell_kind(c) for c in ("fsdp1", "fsdp_same2")] == ["fsdp", "fsdp_same"]
    assert driver.cell_name("fsdp4") == "fsdp4" and driver.cell_name("fsdp_same2") == "fsdp_same2"
    for bad in ("fsdp", "fsdp0", "gpu4", "4", "fsdp_same", "same2"):
        with pytest.raises(argparse.ArgumentTypeError, match="fsdpN"):
            driver.cell_name(bad)


def test_every_cell_runs_the_same_warmup_and_timed_steps(driver, tmp_path: Path) -> None:  # noqa: ANN001
    cells = {c: driver.plan(c, _args(driver), tmp_path) for c in ("fsdp2", "fsdp_same2", "baseline2", "ddp1")}

    def value(cmd: list[str], flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert value(cells["baseline2"].cmd, "--warmup") == "3" and value(cells["baseline2"].cmd, "--steps") == "7"
    assert value(cells["baseline2"].cmd, "--nproc-per-node") == "2"
    for name in ("fsdp2", "fsdp_same2", "ddp1"):
        cmd = cells[name].cmd
        assert value(cmd, "--trainer.max_steps") == "10" and value(cmd, "--trainer.callbacks.warmup_steps") == "3"
        assert value(cmd, "--trainer.callbacks.path") == str(tmp_path / f"{name}.json")
        assert cmd[-2:] == ["--trainer.num_nodes", "1"]  # the extra arguments come last: they win
    assert cells["fsdp2"].context == 256 and cells["ddp1"].context == 128
    # fsdp_same is the FSDP2 config with the baseline's recipe on top; fsdp is the config as shipped.
    same = [str(tmp_path / "fsdp2.json") if a.endswith("fsdp_same2.json") else a for a in cells["fsdp_same2"].cmd]
    fsdp = cells["fsdp2"].cmd
    assert same[:len(fsdp) - 2] == fsdp[:-2]
    recipe = dict(zip(same[len(fsdp) - 2:-2:2], same[len(fsdp) - 1:-2:2], strict=True))
    assert recipe == {"--model.fsdp_reshard_after_forward": "blocks", "--model.fsdp_prefetch": "false",
                      "--model.master_weights": "false", "--model.optimizer_state_dtype": "float32",
                      "--model.compile_fullgraph": "true"}
    assert value(fsdp, "--config") == value(same, "--config") == "configs/2.7B_bf16_fsdp.yaml"


def test_baseline_recipe_options_are_lmtrain_options(driver) -> None:  # noqa: ANN001
    """Each option the fsdp_same cells set is a field of lmtrain's model config, with a value it takes."""
    import dataclasses

    from lmtrain.config import ModelConfig

    recipe = dict(zip(driver.BASELINE_RECIPE[::2], driver.BASELINE_RECIPE[1::2], strict=True))
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert {k.removeprefix("--model.") for k in recipe} <= fields, recipe
    cfg = ModelConfig.from_size("tiny", vocab_size=128, context_length=16, compile=True, fsdp_prefetch=False,
                                fsdp_reshard_after_forward="blocks", master_weights=False,
                                optimizer_state_dtype="float32", compile_fullgraph=True)
    assert (cfg.fsdp_reshard_after_forward, cfg.fsdp_prefetch, cfg.master_weights, cfg.compile_fullgraph) == (
        "blocks", False, False, True)


def test_table_scaling_baseline_and_recipe_ratios(driver) -> None:  # noqa: ANN001
    results = {
        "fsdp1": {"cell": "fsdp1", "devices": 1, "step_ms": 200.0, "tokens_per_s_per_gpu": 20480.0},
        "fsdp4": {"cell": "fsdp4", "devices": 4, "step_ms": 250.0, "tokens_per_s_per_gpu": 16384.0},
        "fsdp_same4": {"cell": "fsdp_same4", "devices": 4, "step_ms": 320.0, "tokens_per_s_per_gpu": 12800.0},
        "baseline4": {"cell": "baseline4", "devices": 4, "step_ms": 256.0, "tokens_per_s_per_gpu": 16000.0},
        "ddp2": {"cell": "ddp2", "devices": 2, "error": "exit 1; stderr ends: Traceback | boom"},
    }
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in driver.table(results).splitlines()[2:]}
    assert rows["fsdp4"][5] == "0.800"  # 16384 / 20480
    assert rows["fsdp4"][6] == "1.024"  # 16384 / 16000: framework and recipe together
    assert rows["fsdp_same4"][6] == "0.800"  # 12800 / 16000: the framework alone
    assert rows["fsdp4"][7] == "1.280"  # 16384 / 12800: the recipe's gain
    assert rows["fsdp1"][5] == "" and rows["baseline4"][6] == "" and rows["fsdp_same4"][7] == ""
    assert [rows[c][2] for c in ("fsdp4", "fsdp_same4", "baseline4")] == ["lmtrain config", "baseline's", "baseline"]
    assert rows["ddp2"][3].startswith("failed: exit 1; stderr ends: Traceback / boom")


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def _ended(pid: int) -> bool:
    """Whether ``pid`` has ended within 5 s (a zombie, ended and waiting for its parent to read its status, has)."""
    for _ in range(50):  # SIGKILL is delivered at once; the kernel may take a moment to end the process
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat[stat.rindex(")") + 2] == "Z":
            return True
        time.sleep(0.1)
    return False


_STUBBORN_CHILD = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "time.sleep(600)"]


def test_cell_out_of_time_is_stopped_with_a_child_in_its_own_session(driver, tmp_path: Path) -> None:  # noqa: ANN001
    """As torchrun starts its workers: the child has a session of its own and (worse than a worker) ignores
    SIGTERM; both are gone after the cell, whose row keeps the stderr."""
    pid_file = tmp_path / "child.pid"
    code = f"""
        import subprocess, sys, time
        child = subprocess.Popen({_STUBBORN_CHILD!r}, start_new_session=True)
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("Traceback: the rank's last words", file=sys.stderr, flush=True)
        time.sleep(600)
    """
    cell = driver.Cell("hang2", _python(code), 2, 16, driver.printed_step_ms)
    row = driver.run(cell, tmp_path, {}, timeout=3, grace_s=1)
    assert row["error"].startswith("stopped after 3 s") and "the rank's last words" in row["error"], row
    assert "Traceback: the rank's last words" in (tmp_path / "hang2.stderr.log").read_text()
    child = int(pid_file.read_text())
    assert _ended(child), f"process {child} of the stopped cell still runs"


def test_process_left_behind_by_a_finished_cell_is_stopped(driver, tmp_path: Path) -> None:  # noqa: ANN001
    """A cell that ends while a process it started (a rank, a compile worker) still runs: that one is stopped
    before the next cell starts, and the cell's step time still counts."""
    pid_file = tmp_path / "child.pid"
    code = f"""
        import subprocess
        child = subprocess.Popen({_STUBBORN_CHILD!r})
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print('{{"step_ms": 50.0}}')
    """
    row = driver.run(driver.Cell("ddp1", _python(code), 1, 16, driver.printed_step_ms), tmp_path, {}, timeout=60,
                     grace_s=1)
    assert row["step_ms"] == 50.0 and "error" not in row, row
    child = int(pid_file.read_text())
    assert _ended(child), f"process {child} left by the cell still runs"


@pytest.mark.parametrize(("code", "reader", "reason"), [
    ("print('no JSON here')", "printed", "printed no JSON line"),
    ("print('{\"cell\": \"baseline\"}')", "printed", "has no step_ms"),
    ("print('done')", "timer", "was not written"),
    ("import json, sys; open(sys.argv[1], 'w').write(json.dumps({}))", "timer", "has no timed step"),
    ("import json, sys; open(sys.argv[1], 'w').write(json.dumps({'step_ms': {'count': 0}}))", "timer",
     "has no timed step"),
    ("import sys; sys.exit('Traceback: out of memory')", "printed", "exit 1; stderr ends: Traceback: out of memory"),
])
def test_cell_without_a_step_time_is_an_error_row(driver, tmp_path: Path, code: str, reader: str,  # noqa: ANN001
                                                  reason: str) -> None:
    read = driver.printed_step_ms if reader == "printed" else driver.timer_step_ms("cell1")
    cell = driver.Cell("cell1", [sys.executable, "-c", code, str(tmp_path / "cell1.json")], 1, 16, read)
    row = driver.run(cell, tmp_path, {}, timeout=60, grace_s=1)
    assert "step_ms" not in row and reason in row["error"], row


def test_results_are_written_after_every_cell(driver, tmp_path: Path) -> None:  # noqa: ANN001
    """Each cell sees the rows of the cells before it in results.json; a failed cell is a row, not the end."""
    seen = tmp_path / "seen"
    copy = (f"import shutil; shutil.copy({str(tmp_path / 'results.json')!r}, {str(seen)!r} + '{{}}')")
    timed = driver.timer_step_ms
    cells = [
        driver.Cell("fsdp1", _python(f"""
            import json
            open({str(tmp_path / 'fsdp1.json')!r}, "w").write(json.dumps({{"step_ms": {{"median": 100.0}}}}))
        """), 1, 256, timed("fsdp1")),
        driver.Cell("baseline1", _python("print('crashed before its JSON line')"), 1, 256, driver.printed_step_ms),
        driver.Cell("fsdp2", _python(copy.format(2) + "; print('{\"step_ms\": 125.0}')"), 2, 256,
                    driver.printed_step_ms),
    ]
    results = driver.run_cells(cells, tmp_path, {}, cell_timeout=60, budget=600, grace_s=1)
    assert list(json.loads((tmp_path / "seen2").read_text())) == ["fsdp1", "baseline1"]
    assert results["fsdp1"]["tokens_per_s_per_gpu"] == pytest.approx(4 * 256 / 0.1)
    assert "printed no JSON line" in results["baseline1"]["error"]
    assert results["fsdp2"]["step_ms"] == 125.0
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert (tmp_path / "table.md").read_text() == driver.table(results) + "\n"


def test_cells_past_the_budget_are_error_rows(driver, tmp_path: Path) -> None:  # noqa: ANN001
    marker = tmp_path / "ran"
    cells = [driver.Cell(f"ddp{n}", _python(f"open({str(marker)!r}, 'w')"), n, 16, driver.printed_step_ms)
             for n in (1, 2)]
    results = driver.run_cells(cells, tmp_path, {}, cell_timeout=60, budget=0)
    assert [r["error"] for r in results.values()] == ["not run: --budget spent"] * 2 and not marker.exists()
    assert list(json.loads((tmp_path / "results.json").read_text())) == ["ddp1", "ddp2"]


def test_lsync_cells_put_lightnings_sigterm_check_back_and_scale_over_the_plain_one_gpu_cell(
        driver, tmp_path: Path) -> None:  # noqa: ANN001
    plain, lsync = (driver.plan(c, _args(driver), tmp_path) for c in ("fsdp2", "fsdp_lsync2"))
    added = [a for a in lsync.cmd if a not in plain.cmd and not a.endswith("fsdp_lsync2.json")]
    assert added == ["--trainer.callbacks+=lightning_sigterm_check.LightningSigtermCheck"]
    ddp = driver.plan("ddp_lsync2", _args(driver), tmp_path)
    assert "configs/xl_bf16_ddp.yaml" in ddp.cmd and added[0] in ddp.cmd and ddp.context == 128
    results = {"fsdp1": {"devices": 1, "step_ms": 100.0, "tokens_per_s_per_gpu": 1000.0},
               "fsdp_lsync2": {"devices": 2, "step_ms": 125.0, "tokens_per_s_per_gpu": 800.0}}
    row = [r for r in driver.table(results).splitlines() if r.startswith("| fsdp_lsync2 ")][0]
    assert [c.strip() for c in row.split("|")][6] == "0.800"


def test_lightning_sigterm_check_removes_the_stand_in(driver) -> None:  # noqa: ANN001
    from types import SimpleNamespace

    from conftest import load_script
    check = load_script("lightning_sigterm_check").LightningSigtermCheck()
    loop = SimpleNamespace(_broadcast_sigterm_tensor=lambda: None)
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=loop))
    check.on_train_batch_start(trainer, None, None, 0)
    assert "_broadcast_sigterm_tensor" not in vars(loop)
    check.on_train_batch_start(trainer, None, None, 1)  # nothing left to remove: no error


def test_fast1_cell_is_the_fast_config_on_one_gpu_and_fsdp_cells_are_set_against_it(driver, tmp_path: Path) -> None:  # noqa: ANN001, E501
    fast = driver.plan("fast1", _args(driver), tmp_path)
    cmd = fast.cmd
    assert cmd[cmd.index("--config") + 1] == "configs/2.7B_bf16_fast.yaml"
    assert cmd[cmd.index("--trainer.devices") + 1] == "1" and fast.context == 256
    assert "--trainer.strategy.data_parallel_size" not in cmd
    for bad in ("fast2", "fast4"):
        with pytest.raises(argparse.ArgumentTypeError, match="fast1"):
            driver.cell_name(bad)
    results = {"fast1": {"devices": 1, "step_ms": 100.0, "tokens_per_s_per_gpu": 40960.0},
               "fsdp4": {"devices": 4, "step_ms": 200.0, "tokens_per_s_per_gpu": 20480.0},
               "ddp2": {"devices": 2, "step_ms": 100.0, "tokens_per_s_per_gpu": 40960.0}}
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in driver.table(results).splitlines()[2:]}
    assert rows["fsdp4"][8] == "0.500" and rows["fast1"][8] == "" and rows["ddp2"][8] == ""
    assert rows["fast1"][5] == ""  # no scaling of the one-GPU cell over itself


def test_ddp_sidestream_cell_names_lightnings_strategy_with_lmtrains_arguments(driver, tmp_path: Path) -> None:  # noqa: ANN001, E501
    plain, side = (driver.plan(c, _args(driver), tmp_path) for c in ("ddp2", "ddp_sidestream2"))
    lightning = ["--trainer.strategy", "lightning.pytorch.strategies.DDPStrategy",
                 "--trainer.strategy.gradient_as_bucket_view", "true", "--trainer.strategy.bucket_cap_mb", "100",
                 "--trainer.strategy.static_graph", "true"]
    at = side.cmd.index("--trainer.strategy")
    assert side.cmd[at:at + len(lightning)] == lightning and "--trainer.strategy" not in plain.cmd
    assert [a for a in side.cmd if not a.endswith(".json")] == [a for a in plain.cmd[:at] if not a.endswith(
        ".json")] + lightning + [a for a in plain.cmd[at:] if not a.endswith(".json")]
    results = {"ddp1": {"devices": 1, "step_ms": 100.0, "tokens_per_s_per_gpu": 1000.0},
               "ddp_sidestream2": {"devices": 2, "step_ms": 110.0, "tokens_per_s_per_gpu": 900.0}}
    row = [r for r in driver.table(results).splitlines() if r.startswith("| ddp_sidestream2 ")][0]
    assert [c.strip() for c in row.split("|")][6] == "0.900"


def test_cell_stopped_after_writing_its_step_time_keeps_it(driver, tmp_path: Path) -> None:  # noqa: ANN001
    """A fit that wrote its timed steps and then took past the cell's time to end (several ranks tearing down):
    the step time counts, with a note that the cell was stopped; without the file it stays an error row."""
    code = f"""
        import json, time
        open({str(tmp_path / 'ddp4.json')!r}, "w").write(json.dumps({{"step_ms": {{"median": 130.0}}}}))
        time.sleep(600)
    """
    row = driver.run(driver.Cell("ddp4", _python(code), 4, 1024, driver.timer_step_ms("ddp4")), tmp_path, {},
                     timeout=3, grace_s=1)
    assert row["step_ms"] == 130.0 and row["tokens_per_s_per_gpu"] == pytest.approx(4 * 1024 / 0.13), row
    assert "error" not in row and row["note"].startswith("stopped after 3 s"), row


_STOPPED_RUN = """
import json, signal, sys, textwrap
from pathlib import Path
sys.path.insert(0, {tests!r})
from conftest import load_script

driver = load_script("fsdp_scaling")
out = Path({out!r})
signal.signal(signal.SIGTERM, driver._stop_on_sigterm)
writes = textwrap.dedent('''
    import json, time
    open({json_path!r}, "w").write(json.dumps({{"step_ms": {{"median": 200.0}}}}))
    print("timed steps written", flush=True)
    time.sleep(600)
''')
cells = [driver.Cell("fsdp1", [sys.executable, "-c", "import json; print(json.dumps({{'step_ms': 100.0}}))"], 1, 1024,
                     driver.printed_step_ms),
         driver.Cell("fsdp4", [sys.executable, "-c", writes], 4, 1024, driver.timer_step_ms("fsdp4")),
         driver.Cell("ddp4", [sys.executable, "-c", "open({marker!r}, 'w')"], 4, 1024, driver.printed_step_ms)]
try:
    driver.run_cells(cells, out, {{}}, cell_timeout=120, budget=600, grace_s=1)
except driver.Stopped:
    sys.exit(143)
"""


def test_sigterm_to_the_script_keeps_the_rows_so_far_and_the_running_cells_step_time(tmp_path: Path) -> None:
    """SIGTERM (a ``timeout`` around the script) while a cell runs after writing its step time: that cell's
    processes are stopped, its row keeps the step time, the rows before it stay, no later cell starts."""
    import signal
    import subprocess

    marker = tmp_path / "ddp4_ran"
    code = _STOPPED_RUN.format(tests=str(Path(__file__).parent), out=str(tmp_path),
                               json_path=str(tmp_path / "fsdp4.json"), marker=str(marker))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "fsdp4.stdout.log"
    for _ in range(300):  # until the second cell has written its step time
        if log.is_file() and "timed steps written" in log.read_text():
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, (stdout, stderr)
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results) == ["fsdp1", "fsdp4"] and results["fsdp1"]["step_ms"] == 100.0
    assert results["fsdp4"]["step_ms"] == 200.0 and "SIGTERM" in results["fsdp4"]["note"], results
    assert not marker.exists()
    assert "| fsdp4 " in (tmp_path / "table.md").read_text()
