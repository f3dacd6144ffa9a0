"""A first day's runs say nothing meaningless: no Kineto ``USDT`` markers from the profiling callbacks, no Lightning
notice that ``weights_only`` was not set when fit saves, resumes or validate loads a checkpoint."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from subprocs import own_job_env

from lmtrain.callbacks import KernelShare
from lmtrain.callbacks._profiler import kineto_markers_dropped
from lmtrain.cli_config import run_lightning
from lmtrain.data import LMDataModule
from lmtrain.module import LMModule

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
#: configs/tiny.yaml made small: a few seconds per fit.
SHORT = ["--config", TINY, "--model.context_length", "32", "--data.max_bytes", "60000", "--data.batch_size", "2",
         "--data.val_batches", "1", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false"]


def test_kineto_markers_are_dropped_and_other_lines_kept(capfd: pytest.CaptureFixture) -> None:
    with kineto_markers_dropped():
        os.write(2, b"USDT:2026-11-27 22:59:33 6466:6466 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real error\n")
        print("a Python warning", file=sys.stderr)
    os.write(2, b"USDT: outside the block\n")
    # (pytest's capture takes Python's writes apart from the descriptor's: compare the lines, not their order)
    assert sorted(capfd.readouterr().err.splitlines()) == ["USDT: outside the block", "a Python warning",
                                                           "a real error"]


def test_kernel_share_window_prints_no_markers(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    pl.seed_everything(0, verbose=False)
    model = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64)
    data = LMDataModule(source="synthetic", batch_size=2, context_length=16, vocab_size=64, train_batches=8,
                        val_batches=1)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=TensorBoardLogger(str(tmp_path)),
                         callbacks=[KernelShare(wait=1, warmup=1, active=1)], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    with pytest.warns(UserWarning, match="KernelShare: no CUDA device"):
        trainer.fit(model, data)
    out, err = capfd.readouterr()
    assert trainer.global_step == 4
    assert "USDT" not in out + err and "profiler_start" not in out + err


@pytest.mark.slow
def test_all_five_callbacks_on_the_command_line_print_no_markers(tmp_path: Path) -> None:
    add = "--trainer.callbacks+=lmtrain.callbacks."
    callbacks = [f"{add}CudaSyncTimer", f"{add}NVTXRanges", f"{add}MemorySnapshot", f"{add}KernelShare",
                 "--trainer.callbacks.wait", "1", "--trainer.callbacks.active", "2", f"{add}PrecisionInspector"]
    result = subprocess.run([sys.executable, "-m", "lmtrain", "fit", *SHORT, "--trainer.max_steps", "6", *callbacks],
                            cwd=tmp_path, env=own_job_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert list((tmp_path / "logs" / "lmtrain" / "version_0").glob("events.out.tfevents.*"))  # the window ran
    assert "USDT" not in output and "profiler_start" not in output


@pytest.mark.slow
def test_no_weights_only_notice_on_save_resume_or_validate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture,
                                                           capfd: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO)
    assert run_lightning(["fit", *SHORT, "--trainer.max_steps", "3"]) == 0
    assert run_lightning(["fit", *SHORT, "--trainer.max_steps", "5", "--ckpt_path", "last"]) == 0
    assert run_lightning(["validate", *SHORT, "--ckpt_path", "last"]) == 0
    assert (tmp_path / "logs" / "lmtrain" / "version_0" / "checkpoints" / "last.ckpt").is_file()
    logged = "\n".join(r.getMessage() for r in caplog.records)
    out, err = capfd.readouterr()
    assert "Restoring states from the checkpoint path" in logged + out + err  # the resume and the validation ran
    assert "weights_only" not in logged + out + err


def test_analyze_without_out_writes_nothing_beside_its_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lmtrain.cli import main

    trace = tmp_path / "trace.json.gz"
    trace.write_bytes((ROOT / "tests" / "data" / "kernel_trace_cpu_tiny.json.gz").read_bytes())
    assert main(["analyze", "kernels", str(trace)]) == 0
    assert "Where the CPU time goes" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["trace.json.gz"]


@pytest.mark.slow
def test_five_callbacks_on_cpu_say_once_what_they_skip(tmp_path: Path) -> None:
    """Each callback says what it cannot do on a CPU in its own words, once; no CUDA warning of torch's gets out."""
    import warnings

    from lmtrain.callbacks import CudaSyncTimer, MemorySnapshot, NVTXRanges, PrecisionInspector

    five = [CudaSyncTimer(print_summary=False), NVTXRanges(), MemorySnapshot(), KernelShare(wait=1, active=1),
            PrecisionInspector()]
    pl.seed_everything(0, verbose=False)
    model = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64)
    data = LMDataModule(source="synthetic", batch_size=2, context_length=16, vocab_size=64, train_batches=12,
                        val_batches=1)
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", devices=1, logger=TensorBoardLogger(str(tmp_path)),
                         callbacks=five, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    names = tuple(f"{type(cb).__name__}:" for cb in five)
    about_cuda = [str(w.message) for w in caught if "cuda" in str(w.message).lower()]
    assert about_cuda and all(text.startswith(names) for text in about_cuda), about_cuda
    assert len(about_cuda) == len(set(about_cuda))  # each said once
