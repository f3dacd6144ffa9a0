"""`bench attention` on the CPU: the sweep's outputs (CSV, JSON, table, progress) and its OOM handling."""

from __future__ import annotations

import argparse
import csv
import json
import time

import pytest
import torch

from lmtrain.bench import attention as bench
from lmtrain.bench import clock as bench_clock

BACKENDS = ["naive", "flash_pytorch", "sdpa_math", "flash_triton"]


def _args(tmp_path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args([
        "--allow-cpu", "--dtype", "fp32", "--head-dims", "16", "--seq-lens", "32", "48", "--batch-size", "2",
        "--heads", "2", "--backends", *BACKENDS, "--warmup", "1", "--rep", "2", "--out", str(tmp_path / "attn.csv"),
        *extra,
    ])


def _rows(tmp_path) -> list[dict]:
    with (tmp_path / "attn.csv").open() as f:
        return list(csv.DictReader(f))


def test_cpu_sweep_writes_csv_json_table_and_progress(tmp_path, capsys):
    args = _args(tmp_path)
    args.command_line = "python -m lmtrain bench attention --allow-cpu"  # as the CLI sets it
    assert bench.run(args) == 0
    rows = _rows(tmp_path)
    assert [(r["backend"], int(r["seq_len"])) for r in rows] == [(b, n) for n in (32, 48) for b in BACKENDS]
    assert list(rows[0]) == list(bench.CSV_FIELDS)
    for r in rows:
        assert (r["batch"], r["heads"], r["head_dim"], r["dtype"], r["causal"]) == ("2", "2", "16", "fp32", "True")
        if r["backend"] == "flash_triton":  # no CUDA here
            assert r["status"] == "n/a" and "CUDA" in r["reason"] and r["fwd_ms"] == ""
        else:
            assert r["status"] == "ok", r
            flops = bench.attention_flops(2, 2, int(r["seq_len"]), int(r["seq_len"]), 16, causal=True)
            for kind, factor in (("fwd", 1.0), ("bwd", 2.5), ("fwd_bwd", 3.5)):
                ms = float(r[f"{kind}_ms"])
                assert ms > 0
                assert float(r[f"{kind}_tflops"]) == pytest.approx(factor * flops / (ms * 1e-3) / 1e12)
            assert float(r["fwd_host_us"]) > 0 and float(r["fwd_bwd_host_us"]) > 0
    data = json.loads((tmp_path / "attn.json").read_text())
    assert data["meta"]["torch"] == torch.__version__
    assert data["meta"]["command"] == "python -m lmtrain bench attention --allow-cpu"
    assert [r["backend"] for r in data["rows"]] == [r["backend"] for r in rows]
    kernels = data["meta"]["flash_kernels"]  # the settings and the kernels of each flash_triton shape
    assert kernels["settings"]["gluon"] == "auto" and kernels["device"] == "cpu"
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split("|")[1].strip() == "backend" and len(out.splitlines()) == 2 + len(rows)
    assert sum(line.startswith("[") for line in err.splitlines()) == len(rows)


def test_oom_cell_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    real_backend = bench._backend

    def backend(name, device, seq_len, max_pytorch_n):
        if name == "naive" and seq_len == 32:
            def out_of_memory(q, k, v, causal):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

            return out_of_memory
        return real_backend(name, device, seq_len, max_pytorch_n)

    monkeypatch.setattr(bench, "_backend", backend)
    assert bench.run(_args(tmp_path)) == 0
    status = {(r["backend"], int(r["seq_len"])): r for r in _rows(tmp_path)}
    assert status[("naive", 32)]["status"] == "OOM" and status[("naive", 32)]["fwd_ms"] == ""
    assert "out of memory" in status[("naive", 32)]["reason"]
    assert status[("naive", 48)]["status"] == "ok"
    assert status[("flash_pytorch", 32)]["status"] == "ok"


def test_flash_pytorch_is_skipped_above_its_limit(tmp_path):
    assert bench.run(_args(tmp_path, "--flash-pytorch-max-n", "40", "--backends", "flash_pytorch")) == 0
    rows = _rows(tmp_path)
    assert [r["status"] for r in rows] == ["ok", "n/a"] and "max-n" in rows[1]["reason"]


def test_refuses_to_run_on_cpu_without_allow_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = _args(tmp_path)
    args.allow_cpu = False
    assert bench.run(args) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "attn.csv").exists()


def test_grids_and_flop_model():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    cells = bench.plan_cells(parser.parse_args(["--backends", "flash_triton"]))
    assert [(c.head_dim, c.seq_len) for c in cells] == [(d, n) for d in (16, 32, 64, 128)
                                                       for n in (256, 1024, 4096, 8192, 16384)]
    assert {(c.batch, c.heads, c.dtype, c.causal) for c in cells} == {(8, 1, "bf16", True)}
    lm = bench.plan_cells(parser.parse_args(["--grid", "lm", "--backends", "flash_triton"]))
    assert {c.batch * c.heads * c.seq_len for c in lm} == {2**21} and {c.head_dim for c in lm} == {64, 80, 128}
    assert bench.attention_flops(8, 1, 1024, 1024, 64, causal=False) == 4 * 8 * 1024 * 1024 * 64
    assert bench.attention_flops(8, 1, 1024, 1024, 64, causal=True) == 2 * 8 * 1024 * 1024 * 64


def test_host_time_is_per_call_over_bursts(monkeypatch):
    """A fake clock that advances 5 us per call: the median per call is exactly 5 us; setup and lead calls are not
    timed (setup advances the clock by 1 s)."""
    clock = [100.0]
    monkeypatch.setattr(bench_clock.time, "perf_counter", lambda: clock[0])
    calls = []

    def setup():
        clock[0] += 1.0  # a slow setup outside the timed region
        return len(calls)

    def timed(state):
        calls.append(state)
        clock[0] += 5e-6

    us = bench._median_host_us(setup, timed, rep=3, device=torch.device("cpu"))
    assert us == pytest.approx(5.0)
    assert len(calls) == 3 * (bench.HOST_LEAD + bench.HOST_BURST)


def test_launch_grid_is_the_small_models_attention():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    cells = bench.plan_cells(parser.parse_args(["--grid", "launch", "--backends", "flash_triton", "sdpa_cudnn"]))
    assert {(c.batch, c.heads, c.head_dim) for c in cells} == {(1, 12, 64)}
    assert [(c.seq_len, c.backend) for c in cells][:2] == [(128, "flash_triton"), (128, "sdpa_cudnn")]


def test_cpu_smoke_run_skips_long_sequences_and_caps_repetitions(tmp_path, monkeypatch):
    """On the CPU, N above CPU_MAX_N is not timed and each measurement takes at most CPU_REP timed runs."""
    monkeypatch.setattr(bench, "CPU_MAX_N", 40)
    args = _args(tmp_path, "--backends", "sdpa", "--rep", "50", "--warmup", "9")
    assert bench.run(args) == 0
    assert (args.warmup, args.rep, args.warmup_ms) == (bench.CPU_WARMUP, bench.CPU_REP, 0.0)
    status = {int(r["seq_len"]): (r["status"], r["reason"]) for r in _rows(tmp_path)}
    assert status[32] == ("ok", "")
    assert status[48][0] == "n/a" and "CPU smoke run" in status[48][1]


def test_sustained_runs_cover_the_warmup_time():
    """``--warmup-ms`` adds the runs that fill it at the measured time per run, none without it, and a bounded
    number for runs of microseconds."""
    assert bench.sustained_runs(0, 35.0) == 0
    assert bench.sustained_runs(1000, 35.0) == 29
    assert bench.sustained_runs(1000, 1000.0) == 1
    assert bench.sustained_runs(1000, 0.0) == bench.MAX_SUSTAINED_RUNS


@pytest.mark.parametrize("warmup_ms,extra", [(0.0, 0), (50.0, 7)])
def test_median_ms_runs_the_sustained_warmup_before_the_timed_runs(monkeypatch, warmup_ms, extra):
    """``_median_ms``: ``warmup`` untimed runs, then (with ``warmup_ms``) ``sustained_runs`` more, then ``rep``
    timed ones, each after its setup; the median is over the timed runs only."""
    monkeypatch.setattr(bench, "sustained_runs", lambda ms, run_ms: extra if ms else 0)
    calls = []
    durations = iter([0.0] * (2 + extra) + [0.004, 0.001, 0.002])

    def timed(state):
        calls.append(state)
        time.sleep(next(durations))

    ms = bench._median_ms(lambda: len(calls), timed, 2, 3, torch.device("cpu"), warmup_ms)
    assert calls == list(range(2 + extra + 3))  # every run after its own setup
    assert ms >= 2.0  # the middle of the timed runs (sleeps of 4, 1 and 2 ms), not a warm-up run (no sleep)


def _shape_args(rounds: int, warmup_ms: float = 7.0) -> argparse.Namespace:
    return argparse.Namespace(rounds=rounds, warmup=1, rep=2, warmup_ms=warmup_ms, flash_pytorch_max_n=1024)


def test_backends_of_a_shape_take_turns_over_rounds(monkeypatch):
    """``measure_shape``: one set of inputs for every backend; each round times every backend, the order rotated by
    one per round, only the round's first measurement after the sustained warm-up; each figure is the median over
    the rounds; a backend failing in a later round is recorded as an error while the others go on."""
    backends = ["naive", "sdpa_math", "flash_pytorch"]
    cells = [bench.Cell(b, "fp32", True, 1, 2, 32, 16) for b in backends]
    other = bench.Cell("naive", "fp32", True, 1, 2, 48, 16)
    assert bench.shape_groups([*cells, other]) == [cells, [other]]
    calls_seen, inputs_seen = [], []
    values = {"naive": [3.0, 1.0, 2.0], "sdpa_math": [5.0, 6.0, 4.0], "flash_pytorch": [9.0, 8.0, 7.0]}

    def fake_round(calls, device, warmup, rep, warmup_ms=0.0):
        name = next(c.backend for c, k in owners if k is calls)
        calls_seen.append((name, warmup_ms))
        inputs_seen.append(calls.inputs)
        if name == "flash_pytorch" and len([n for n, _ in calls_seen if n == name]) == 2:
            raise RuntimeError("boom in round 2")
        ms = values[name][len([n for n, _ in calls_seen if n == name]) - 1]
        return ms, 2 * ms, 3 * ms

    owners = []
    real_calls = bench.Calls

    def recording_calls(fn, inputs, causal):
        made = real_calls(fn, inputs, causal)
        owners.append((pending[0], made))
        return made

    pending = [None]
    real_backend = bench._backend

    def backend(name, device, seq_len, max_n):
        pending[0] = next(c for c in cells if c.backend == name)
        return real_backend(name, device, seq_len, max_n)

    monkeypatch.setattr(bench, "Calls", recording_calls)
    monkeypatch.setattr(bench, "_backend", backend)
    monkeypatch.setattr(bench, "time_round", fake_round)
    lines = []
    bench.measure_shape(cells, torch.device("cpu"), _shape_args(3), log=lines.append)
    assert [n for n, _ in calls_seen] == ["naive", "sdpa_math", "flash_pytorch", "sdpa_math", "flash_pytorch",
                                          "naive", "naive", "sdpa_math"]  # flash_pytorch failed in round 2
    assert [w for _, w in calls_seen] == [7.0, 0.0, 0.0, 7.0, 0.0, 0.0, 7.0, 0.0]
    assert all(i is inputs_seen[0] for i in inputs_seen)  # one set of inputs for the shape
    naive, math_, flash = cells
    assert (naive.fwd_ms, naive.bwd_ms, naive.fwd_bwd_ms) == (2.0, 4.0, 6.0)  # medians of 3, 1, 2
    assert (math_.fwd_ms, math_.bwd_ms, math_.fwd_bwd_ms) == (5.0, 10.0, 15.0)
    assert naive.extra["rounds"] == [(3.0, 6.0, 9.0), (1.0, 2.0, 3.0), (2.0, 4.0, 6.0)]
    assert naive.status == math_.status == "ok" and naive.peak_gib is None  # no CUDA memory figures on the CPU
    assert flash.status == "error" and "boom in round 2" in flash.reason and flash.fwd_ms is None
    assert naive.fwd_host_us > 0 and math_.fwd_bwd_host_us > 0
    assert len(lines) == 8 and lines[0].startswith("  round 1/3 naive: fwd 3.000")
    assert lines[4] == "  round 2/3 flash_pytorch: error RuntimeError: boom in round 2"


def test_rounds_reach_the_json_and_a_cpu_run_takes_one(tmp_path, monkeypatch):
    """Every round's times are in the JSON rows; on the CPU ``--rounds`` is capped at ``CPU_ROUNDS``."""
    args = _args(tmp_path, "--backends", "naive", "sdpa_math", "--seq-lens", "32", "--rounds", "4")
    assert bench.run(args) == 0
    assert args.rounds == bench.CPU_ROUNDS == 1
    monkeypatch.setattr(bench, "CPU_ROUNDS", 2)
    args = _args(tmp_path, "--backends", "naive", "sdpa_math", "--seq-lens", "32", "--rounds", "4")
    assert bench.run(args) == 0
    rows = json.loads((tmp_path / "attn.json").read_text())["rows"]
    assert [r["backend"] for r in rows] == ["naive", "sdpa_math"]
    for r in rows:
        assert len(r["rounds"]) == 2 and all(len(t) == 3 and min(t) > 0 for t in r["rounds"])
        assert r["fwd_ms"] == pytest.approx(sorted(t[0] for t in r["rounds"])[0] / 2
                                            + sorted(t[0] for t in r["rounds"])[1] / 2)


def test_host_bursts_are_capped_for_long_calls():
    """All ``rep`` bursts for short calls; for long ones as many as fit ``HOST_BUDGET_MS`` of GPU time, at least 3."""
    calls = bench.HOST_LEAD + bench.HOST_BURST
    assert bench.host_bursts(30, 0.05) == 30
    assert bench.host_bursts(30, bench.HOST_BUDGET_MS / calls / 10) == 10
    assert bench.host_bursts(30, 57.0) == 3
    assert bench.host_bursts(2, 57.0) == 2


def test_rounds_must_be_at_least_one(capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args(["--rounds", "2"]).rounds == 2
    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--rounds", bad])
        assert "--rounds" in capsys.readouterr().err


def test_flash_flags_set_the_settings_for_the_sweep_only(tmp_path, monkeypatch):
    from lmtrain.errors import LmtrainError
    from lmtrain.kernels.flash import FlashSettings, current

    args = _args(tmp_path, "--flash-gluon", "off", "--no-flash-autotune", "--flash-gluon-dkdv-config", "2,64,3")
    assert bench.flash_settings(args) == FlashSettings(gluon="off", autotune=False, gluon_dkdv_config="2,64,3")
    seen = []
    monkeypatch.setattr(bench, "_sweep", lambda a: seen.append(current()) or 0)
    before = current()
    assert bench.run(args) == 0
    assert seen == [bench.flash_settings(args)] and current() == before
    with pytest.raises(LmtrainError, match="flash.gluon"):
        bench.run(_args(tmp_path, "--flash-gluon", "sometimes"))
    assert not (tmp_path / "attn.csv").exists()

