"""`python -m lmtrain bench model`: sweeps of tiny cells on CPU, each in a forked process."""

from __future__ import annotations

import csv
import json
import re
import statistics
from pathlib import Path
from typing import Any

import bench_faults
import lightning.pytorch as pl
import pytest

from lmtrain.bench import model as bench
from lmtrain.bench import tables
from lmtrain.cli import main
from lmtrain.errors import LmtrainError

TINY = "configs/tiny.yaml"


class StubTimer(pl.Callback):
    """CudaSyncTimer's result API with fixed times: every measured step takes 10 ms (forward 4, backward 5)."""

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps
        self.step_times: list[dict[str, float]] = []
        self.warmup_times: list[float] = []
        self._seen = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._seen < self.warmup_steps:
            self.warmup_times.append(100.0)
        else:
            row = {"step": self._seen, "forward_ms": 4.0, "step_ms": 10.0}
            if pl_module.step_mode != "forward":
                row["backward_ms"] = 5.0
            self.step_times.append(row)
        self._seen += 1

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for key in ("forward_ms", "backward_ms", "step_ms"):
            values = [r[key] for r in self.step_times if key in r]
            if values:
                out[key] = {"mean": statistics.fmean(values), "std": 0.0, "median": values[0], "min": min(values),
                            "max": max(values), "count": float(len(values))}
        return out


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def stub_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "_make_timer", lambda warmup: StubTimer(warmup))


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Slugs of the cells actually launched (in the parent, before the fork)."""
    seen: list[str] = []
    original = bench.launch_cell

    def counting(cell: bench.Cell, *args: Any, **kwargs: Any) -> dict[str, Any]:
        seen.append(cell.slug)
        return original(cell, *args, **kwargs)

    monkeypatch.setattr(bench, "launch_cell", counting)
    return seen


def sweep(out: Path, *extra: str) -> int:
    return main(["bench", "model", "--sizes", TINY, "--batch-size", "2", "--warmup", "1", "--steps", "2",
                 "--out", str(out), "--logdir", "none", *extra])


def table_rows(text: str) -> tuple[list[str], list[list[str]]]:
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    split = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    return split[0], split[2:]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_sweep_table_shape_and_values(tmp_path: Path, stub_timer: None, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.csv"
    assert sweep(out, "--contexts", "16,32", "--mode", "forward,forward_backward") == 0
    header, rows = table_rows(capsys.readouterr().out)
    assert header == tables.MARKDOWN_COLUMNS
    assert len(rows) == 4 and all(len(r) == len(header) for r in rows)
    by = {(r[2], r[7]): dict(zip(header, r, strict=True)) for r in rows}
    assert by[("32", "forward")]["step ms"] == "10.00 ± 0.00"
    assert by[("32", "forward")]["backward ms"] == "-"
    assert by[("16", "forward_backward")]["backward ms"] == "5.00 ± 0.00"
    assert by[("16", "forward_backward")]["tokens/s"] == "3,200"  # 2 x 16 tokens in 10 ms
    assert by[("16", "forward")]["params"] == "1,115,264" and by[("16", "forward")]["status"] == "ok"
    assert float(by[("32", "forward")]["estimate GiB"]) >= 0
    csv_rows = read_csv(out)
    assert list(csv_rows[0]) == bench.CSV_COLUMNS and len(csv_rows) == 4
    assert {r["first_step_ms"] for r in csv_rows} == {"100.0"}
    assert len(json.loads(out.with_suffix(".json").read_text())["rows"]) == 4


def test_failures_are_recorded_and_the_sweep_goes_on(tmp_path: Path, stub_timer: None, launches: list[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    bench_faults.use(monkeypatch, bench, "CELL_TARGET", "sweep_cell",
                     "context=16,mode=forward:oom;context=24:crash;context=32,mode=train:exit")
    out = tmp_path / "r.csv"
    assert sweep(out, "--contexts", "16,24,32", "--mode", "forward,train") == 0
    status = {(int(r["context"]), r["mode"]): (r["status"], r["error"]) for r in read_csv(out)}
    assert len(status) == 6 and len(launches) == 6
    assert status[(16, "forward")][0] == "OOM" and "out of memory" in status[(16, "forward")][1]
    assert status[(24, "forward")] == ("error", "RuntimeError: injected crash")
    assert status[(32, "train")][0] == "error" and "exited with status 3" in status[(32, "train")][1]
    assert status[(16, "train")][0] == status[(32, "forward")][0] == "ok"

    # Resume: nothing left to run; --retry-failed reruns error cells only (OOM stays OOM).
    launches.clear()
    assert sweep(out, "--contexts", "16,24,32", "--mode", "forward,train") == 0
    assert launches == []
    monkeypatch.delenv(bench_faults.FAIL_ENV)
    assert sweep(out, "--contexts", "16,24,32", "--mode", "forward,train", "--retry-failed") == 0
    assert sorted(launches) == sorted(bench.Cell(TINY, t, 2, "32-true", "sdpa", False, m, 1, 2).slug
                                      for t, m in [(24, "forward"), (24, "train"), (32, "train")])
    status = {(int(r["context"]), r["mode"]): r["status"] for r in read_csv(out)}
    assert status[(16, "forward")] == "OOM" and list(status.values()).count("ok") == 5


def test_resume_runs_only_new_cells_and_stop_after_oom(tmp_path: Path, stub_timer: None, launches: list[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "r.csv"
    assert sweep(out, "--contexts", "16", "--mode", "forward") == 0
    assert len(launches) == 1
    bench_faults.use(monkeypatch, bench, "CELL_TARGET", "sweep_cell", "context=24:oom")
    assert sweep(out, "--contexts", "16,24,32", "--mode", "forward", "--stop-after-oom") == 0
    assert len(launches) == 2  # 24 ran out of memory, 32 was skipped without a process
    rows = {int(r["context"]): r for r in read_csv(out)}
    assert rows[32]["status"] == "OOM" and rows[32]["error"].startswith("skipped")
    # the results file keeps every command that added cells, in order, and the environment they ran in
    meta = bench.load_meta(out)
    assert [c.split("--contexts ")[1].split()[0] for c in meta["commands"]] == ["16", "16,24,32"]
    assert meta["environment"]["torch"] == __import__("torch").__version__
    assert sweep(out, "--contexts", "16", "--mode", "forward") == 0  # nothing to run: the file is unchanged
    assert bench.load_meta(out) == meta


def test_timeout_is_recorded(tmp_path: Path, stub_timer: None, monkeypatch: pytest.MonkeyPatch) -> None:
    bench_faults.use(monkeypatch, bench, "CELL_TARGET", "sweep_cell", "context=16:hang")
    out = tmp_path / "r.csv"
    assert sweep(out, "--contexts", "16", "--mode", "forward", "--timeout", "2") == 0
    assert read_csv(out)[0]["status"] == "timeout"


def test_real_timer_and_tensorboard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tb import scalars

    out = tmp_path / "r.csv"
    assert main(["bench", "model", "--sizes", TINY, "--contexts", "16", "--batch-size", "2", "--mode", "train",
                 "--warmup", "1", "--steps", "2", "--out", str(out), "--logdir", str(tmp_path / "tb")]) == 0
    row = read_csv(out)[0]
    assert row["status"] == "ok", row["error"]
    assert float(row["step_ms_mean"]) > 0 and float(row["optimizer_ms_mean"]) > 0
    logs = list((tmp_path / "tb").glob("*"))
    assert len(logs) == 1
    assert len(scalars(str(logs[0])).get("time/step_ms", [])) == 2
    cell_logs = list(tmp_path.glob("r_cells/*.log"))
    assert len(cell_logs) == 1 and "Tip:" not in cell_logs[0].read_text()  # no product tips in a cell's log


def test_study_presets_and_overrides() -> None:
    import argparse

    from lmtrain.bench.studies import STUDIES

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    # A study is the product of its preset's lists (the flags' defaults for the rest), each cell once.
    timing = STUDIES["timing"].preset
    cells, per_study, _ = bench.plan_cells(parser.parse_args(["--study", "timing"]))
    assert {(c.size, c.context, c.mode, c.precision) for c in cells} == {
        (s, t, m, p) for s in timing["sizes"] for t in timing["contexts"] for m in timing["mode"]
        for p in timing["precision"]}
    assert len(cells) == len(set(cells)) == len(timing["sizes"]) * len(timing["contexts"]) * len(timing["mode"])
    # Explicit flags replace the preset's values; studies share their common cells.
    cells, per_study, _ = bench.plan_cells(parser.parse_args(["--study", "timing", "--study", "precision",
                                                              "--sizes", "small", "--contexts", "128"]))
    for name in ("timing", "precision"):
        assert {(c.size, c.context) for c in per_study[name]} == {("small", 128)}
        assert {c.mode for c in per_study[name]} == set(STUDIES[name].preset["mode"])
        assert {c.precision for c in per_study[name]} == set(STUDIES[name].preset.get("precision", ["32-true"]))
    assert cells == list(dict.fromkeys([*per_study["timing"], *per_study["precision"]]))
    assert len(cells) < len(per_study["timing"]) + len(per_study["precision"])  # a shared cell runs once
    _, per_study, stop = bench.plan_cells(parser.parse_args(["--study", "attention-backends"]))
    backends = STUDIES["attention-backends"].preset
    assert stop and {c.attention for c in per_study["attention-backends"]} == set(backends["attention"])
    assert main(["bench", "model", "--sizes", "huge"]) == 2


def test_ctrl_c_keeps_finished_cells(tmp_path: Path, stub_timer: None, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    original = bench.launch_cell

    def interrupted_on_second(cell: bench.Cell, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if cell.context == 24:
            raise KeyboardInterrupt
        return original(cell, *args, **kwargs)

    monkeypatch.setattr(bench, "launch_cell", interrupted_on_second)
    out = tmp_path / "r.csv"
    assert sweep(out, "--contexts", "16,24", "--mode", "forward") == 130
    assert [(r["context"], r["status"]) for r in read_csv(out)] == [("16", "ok")]
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("interrupted: stopped by Ctrl-C") and str(out) in err[-1]


def test_memory_options_reach_the_cells_and_old_keys_still_match() -> None:
    """The long-context study crosses the memory options; a cell without them keeps its former key."""
    import argparse

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    cells, _, stop = bench.plan_cells(parser.parse_args(["--study", "long-context"]))
    assert stop
    assert {c.activation_checkpointing for c in cells} == {"full", "selective", "offload"}
    assert {c.optimizer_in_backward for c in cells} == {False, True}
    assert {c.loss_chunk_tokens for c in cells} == {0, 4096}
    cell = next(c for c in cells if c.activation_checkpointing == "offload" and c.optimizer_in_backward
                and c.loss_chunk_tokens == 4096)
    kwargs = bench.module_kwargs(cell)
    assert (kwargs["activation_checkpointing"], kwargs["optimizer_in_backward"], kwargs["loss_chunk_tokens"]) == (
        "offload", True, 4096)
    assert cell.slug.endswith("_acoffload_ib_chunk4096")
    plain = bench.Cell("small", 512, 4, "bf16-mixed", "sdpa", False, "train", 1, 3)
    assert "activation_checkpointing" not in json.loads(plain.key())  # results written before the options match
    with pytest.raises(LmtrainError, match="--activation-checkpointing"):
        bench.cells_from_values({**bench.DEFAULTS, "activation_checkpointing": ["most"]})


def test_long_context_table_keeps_the_planners_record() -> None:
    """The long-context study's table judges each plan against the usable memory and sums up the planner."""
    from lmtrain.bench.studies import STUDIES
    from lmtrain.memory_plan import usable_bytes

    def row(context: int, plan: float, status: str, peak: float | None = None, ib: bool = True) -> dict:
        r = {"context": context, "attention": "sdpa", "activation_checkpointing": "full", "optimizer_in_backward": ib,
             "loss_chunk_tokens": 4096, "estimate_gib": plan, "status": status, "peak_gib": peak}
        if peak is not None:
            r.update(estimate_error_pct=100 * (plan - peak) / peak, step_ms_median=1000.0, tokens_per_s=8192.0,
                     device_memory_gib=80.0)
        return r

    capacity = usable_bytes(80 * 1024**3) / 1024**3  # 75.0 GiB
    assert abs(capacity - 75.0) < 1e-9
    rows = [row(2048, 40.0, "ok", 39.0), row(4096, 50.0, "ok", 44.0), row(8192, 70.0, "OOM"),
            row(16384, 90.0, "OOM", ib=False)]
    text = re.sub(" +", " ", STUDIES["long-context"].render(rows))
    assert "| +2.6% | yes | ok |" in text and "| +13.6% | yes | ok |" in text and "| no | OOM" in text
    assert "over the 2 cells that ran: +2.6% .. +13.6%" in text
    assert "1 cells outside +-10%: 4096 sdpa full in-backward chunk 4096" in text
    assert "Usable memory 75.00 GiB" in text
    assert "\"fits\" for 3 cells: 1 of them did not run: 8192 sdpa full in-backward chunk 4096 (OOM)" in text
    assert "\"does not fit\" for 1: none of them ran" in text
    good = re.sub(" +", " ", STUDIES["long-context"].render([row(2048, 40.0, "ok", 39.0),
                                                            row(16384, 90.0, "ok", 88.0, ib=False)]))
    assert "every one within +-10%." in good and "every one ran." in good
    assert "1 ran anyway (the plan is conservative there): 16384 sdpa full no in-backward chunk 4096" in good


def test_resumed_rows_get_the_current_plan(tmp_path: Path) -> None:
    """Stored measurements stay; their plan columns are the current planner's (the plan is analytic)."""
    cell = bench.Cell("small", 64, 2, "bf16-mixed", "sdpa", False, "train", 1, 2, loss_chunk_tokens=0)
    stale = {**bench.base_row(cell), "estimate_gib": 1.0, "estimate_needed_gib": 1.0, "status": "ok",
             "peak_gib": 2.0}
    out = tmp_path / "r.csv"
    bench.save_results(out, [bench.finish_row(stale)], {"commands": ["earlier"]})
    assert bench.load_results(out)[0]["estimate_error_pct"] == -50.0
    [row] = bench.run_sweep([cell], out)  # nothing left to run
    fresh = bench.base_row(cell)
    assert row["estimate_gib"] == fresh["estimate_gib"] != 1.0 and row["peak_gib"] == 2.0
    assert row["estimate_needed_gib"] >= row["estimate_gib"]
    assert row["estimate_error_pct"] == pytest.approx(100 * (fresh["estimate_gib"] - 2.0) / 2.0)
    assert bench.load_results(out)[0]["estimate_gib"] == fresh["estimate_gib"]
    assert bench.load_meta(out)["commands"] == ["earlier"]


def test_skip_unfit_records_cells_the_plan_rules_out_and_a_later_run_runs_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from lmtrain.memory_plan import GIB, usable_bytes

    launched: list[int] = []

    def fake_launch(cell: bench.Cell, *args: Any, **kwargs: Any) -> dict[str, Any]:
        launched.append(cell.context)
        return {"status": "ok", "peak_gib": 0.5, "wall_s": 0.0}

    monkeypatch.setattr(bench, "launch_cell", fake_launch)
    small, big = (bench.base_row(bench.Cell(TINY, t, 2, "32-true", "sdpa", False, "train", 1, 2))
                  ["estimate_needed_gib"] for t in (16, 4096))
    # A device whose usable part lies between the two plans (usable = 0.95 total - 1 GiB).
    gib = round(((small + big) / 2 + 1) / 0.95, 4)
    assert small < usable_bytes(int(gib * GIB)) / GIB < big
    out = tmp_path / "r.csv"
    assert sweep(out, "--contexts", "16,4096", "--mode", "train", "--precision", "32-true",
                 "--skip-unfit", str(gib)) == 0
    assert launched == [16]
    rows = {int(r["context"]): r for r in read_csv(out)}
    assert rows[4096]["status"] == "skipped" and rows[4096]["error"].startswith("plan: needs")
    assert f"GiB usable of {gib:g} GiB (--skip-unfit)" in rows[4096]["error"]
    capsys.readouterr()
    # the same budget again: the skipped cell stays skipped; a budget that fits it now runs it (it kept the old
    # skip without a word)
    assert sweep(out, "--contexts", "16,4096", "--mode", "train", "--precision", "32-true",
                 "--skip-unfit", str(gib)) == 0
    assert launched == [16]
    assert sweep(out, "--contexts", "16,4096", "--mode", "train", "--precision", "32-true",
                 "--skip-unfit", str(round((big + 1) / 0.95 * 2, 3))) == 0
    assert launched == [16, 4096]
    assert {r["status"] for r in read_csv(out)} == {"ok"}
    other = tmp_path / "s.csv"
    assert sweep(other, "--contexts", "16,4096", "--mode", "train", "--precision", "32-true",
                 "--skip-unfit", str(gib)) == 0
    assert sweep(other, "--contexts", "16,4096", "--mode", "train", "--precision", "32-true") == 0  # no flag
    assert launched == [16, 4096, 16, 4096]
    assert {r["status"] for r in read_csv(other)} == {"ok"}


def test_every_step_option_reaches_the_table_and_the_csv_columns() -> None:
    from lmtrain.bench.tables import options_text
    from lmtrain.config import step_fields

    options = [f.name for f in step_fields() if f.name not in bench.AXIS_FIELDS.values()]
    assert [c for c in bench.CSV_COLUMNS if c in options] == options
    cell = bench.Cell("tiny", 64, 2, "32-true", "sdpa", False, "train", 1, 2, activation_checkpointing="full",
                      checkpoint_layers=2)
    row = bench.base_row(cell)
    assert options_text(row) == "checkpointing full, checkpoint layers 2"
    assert cell.slug.endswith("_acfull_cl2")


def test_row_of_a_config_yaml_shows_the_options_that_ran() -> None:
    """A cell named by a config YAML runs with the YAML's options; its row says so instead of the flag defaults."""
    cell = bench.Cell("configs/small_bf16_fast.yaml", 512, 4, "bf16-mixed", "sdpa", True, "train", 3, 10)
    row = bench.base_row(cell)
    assert cell.cuda_graphs is False and cell.master_weights is False  # the cell's own (default) values
    assert row["cuda_graphs"] is True and row["master_weights"] is True
    assert row["optimizer_state_dtype"] == "bfloat16"
    assert row["size"] == "small_bf16_fast"
