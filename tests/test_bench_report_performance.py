"""`python -m lmtrain bench report --records DIR`: the current-numbers page from the newest record of each kind."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lmtrain.bench.performance import REGENERATE, load_records, newest, write_performance
from lmtrain.cli import main

ENV = {"python": "3.12.3", "torch": "2.11.0+cu130", "lightning": "2.6.6", "CUDA (torch build)": "13.0",
       "triton": "3.6.0", "driver": "580.1"}


def attention_record(folder: Path, name: str, fwd: float, extra_meta: dict | None = None) -> Path:
    """A ``bench attention`` record: flash_triton and cuDNN at head dim 64, 1024 keys."""
    rows = [{"backend": backend, "dtype": "bf16", "causal": True, "batch": 128, "heads": 16, "seq_len": 1024,
             "head_dim": 64, "status": "ok", "fwd_ms": ms, "fwd_bwd_ms": 4 * ms}
            for backend, ms in (("flash_triton", fwd), ("sdpa_cudnn", 1.0))]
    meta = {"device": "NVIDIA H100 80GB HBM3", **ENV, **(extra_meta or {}),
            "command": f"python -m lmtrain bench attention --grid lm --out {name}.csv"}
    path = folder / f"{name}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    return path


def model_record(folder: Path, name: str, rows: list[dict], command: str) -> Path:
    path = folder / f"{name}.json"
    path.write_text(json.dumps({"meta": {"commands": [command], "launcher": "fork", "environment": ENV},
                                "rows": rows}))
    return path


def cell(attention: str, step_ms: float, **options: object) -> dict:
    return {"size": "2.7B", "context": 512, "batch_size": 4, "precision": "bf16-mixed", "attention": attention,
            "compile": "off", "mode": "train", "status": "ok", "step_ms_median": step_ms, "tokens_per_s": 12000.0,
            "mfu": 0.25, "peak_gib": 55.49, "device": "NVIDIA H100 80GB HBM3", **options}


def test_page_states_facts_and_current_numbers(tmp_path: Path) -> None:
    records = tmp_path / "benchmarks"
    records.mkdir()
    attention_record(records, "2026-01-01-H100-old-attention", fwd=2.0)
    attention_record(records, "2026-01-02-H100-new-attention", fwd=0.8,
                     extra_meta={"commit": "abc1234", "kernels": {"forward": "gluon", "backward": "fused"}})
    (records / "2026-01-02-H100-new.md").write_text("Results: `2026-01-02-H100-new-attention.json`.\n")
    model_record(records, "2026-01-03-H100-2.7B-512", [cell("sdpa", 170.36), cell("flash_triton", 169.22)],
                 "python -m lmtrain bench model --sizes 2.7B --contexts 512 --attention sdpa,flash_triton")
    model_record(records, "2026-01-03-H100-speed", [cell("sdpa", 170.0), {**cell("sdpa", 97.15, compile="on",
                 cuda_graphs=True, master_weights=True, optimizer_state_dtype="bfloat16")}],
                 "python -m lmtrain bench model --sizes 2.7B --compile off,on")
    out = tmp_path / "docs" / "performance.md"
    assert main(["bench", "report", "--records", str(records), "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[:7] == ["# Performance", "", lines[2], "", "```", REGENERATE, "```"]
    assert "old-attention" not in out.read_text()  # only the newest record of a kind
    expected = [
        "## Attention: flash_triton against cuDNN",
        "- record: [2026-01-02-H100-new-attention.json](../benchmarks/2026-01-02-H100-new-attention.json), "
        "described in [2026-01-02-H100-new.md](../benchmarks/2026-01-02-H100-new.md)",
        "- date: 2026-01-02",
        "- commit: abc1234",
        "- device: NVIDIA H100 80GB HBM3",
        "- versions: python 3.12.3, torch 2.11.0+cu130, lightning 2.6.6, CUDA (torch build) 13.0, triton 3.6.0, "
        "driver 580.1",
        "- kernel settings: forward=gluon, backward=fused",
        "python -m lmtrain bench attention --grid lm --out 2026-01-02-H100-new-attention.csv",
        "| 64       | 1024 | 128 x 16      | 0.800      | 1.000            | 1.25x   | 3.200      | 4.000"
        "            | 1.25x   |",
        "## Model step: 2.7B, context 512, batch 4",
        "- commit: not recorded",
        "- kernel settings: not recorded",
        "| sdpa         | bf16-mixed | train | 170.36  | 12,000   | 25.0% | 55.49    | ok     |",
        "| flash_triton | bf16-mixed | train | 169.22  | 12,000   | 25.0% | 55.49    | ok     |",
        "## Step speed: 2.7B",
        "| 512     | 4     | sdpa      | on      | graphs, master weights, bfloat16 moments | 97.15   | 12,000   "
        "| 25.0% | 55.49    | ok     |",
    ]
    for line in expected:
        assert line in lines, line
    # sections in a fixed order: attention, model steps, speed
    assert lines.index(expected[0]) < lines.index(expected[9]) < lines.index(expected[14])


def test_same_date_newest_is_the_one_git_added_last(tmp_path: Path) -> None:
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    # added second, fewer rows and an earlier name: still the newest, by the time git added it
    attention_record(tmp_path, "2026-01-01-H100-z-attention", fwd=2.0)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "first", "--date", "2026-01-01T10:00:00"], check=True,
                   env={"GIT_COMMITTER_DATE": "2026-01-01T10:00:00", "PATH": "/usr/bin:/bin"})
    attention_record(tmp_path, "2026-01-01-H100-a-attention", fwd=0.5)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "second"], check=True,
                   env={"GIT_COMMITTER_DATE": "2026-01-01T11:00:00", "PATH": "/usr/bin:/bin"})
    best = newest(load_records(tmp_path))
    assert best[("attention",)].path.name == "2026-01-01-H100-a-attention.json"


def test_without_git_same_date_prefers_more_rows(tmp_path: Path) -> None:
    model_record(tmp_path, "2026-01-01-H100-b", [cell("sdpa", 1.0)], "python -m lmtrain bench model")
    model_record(tmp_path, "2026-01-01-H100-a", [cell("sdpa", 2.0), cell("flash_triton", 2.0)],
                 "python -m lmtrain bench model")
    model_record(tmp_path, "2026-01-01-H100-study", [cell("sdpa", 3.0)], "python -m lmtrain bench model --study timing")
    (tmp_path / "2026-01-01-probe.json").write_text(json.dumps({"cells": []}))  # not a bench record: ignored
    records = load_records(tmp_path)
    assert {r.path.name for r in records} == {"2026-01-01-H100-a.json", "2026-01-01-H100-b.json"}
    assert newest(records)[("model", "2.7B", 512, 4)].path.name == "2026-01-01-H100-a.json"


def test_no_records_and_a_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = write_performance(tmp_path, tmp_path / "performance.md")
    assert "No records with a known kind were found." in out.read_text().splitlines()
    assert main(["bench", "report", "--records", str(tmp_path / "nope"), "--out", str(tmp_path / "p.md")]) == 2
    assert "--records" in capsys.readouterr().err and not (tmp_path / "p.md").exists()


def test_flash_dispatcher_record_gives_the_kernel_settings(tmp_path: Path) -> None:
    """A bench attention record carries the dispatcher's describe() as meta.flash_kernels: the page shows its
    settings and, per shape, the implementation of the forward, dQ and dK/dV."""
    flash = {"settings": {"gluon": "auto", "tma": True}, "triton": "3.6",
             "plans": {"N=1024,d=64": {"fwd": "gluon", "dq": "tma", "dkdv": "gluon", "kernels": ["_flash_gluon_fwd"]}}}
    attention_record(tmp_path, "2026-11-27-H100-attention", 0.8, {"flash_kernels": flash})
    (record,) = load_records(tmp_path)
    assert record.kernels() == "gluon=auto, tma=True, plans (fwd/dq/dkdv)=N=1024,d=64: gluon/tma/gluon"
