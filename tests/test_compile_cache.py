"""The compile cache (lmtrain.compile_cache): a second compiled fit loads its kernels from the folder the first
filled, and says so; the folder option is checked before anything is written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from refusals import one_line_error
from subprocs import own_job_env

from lmtrain.cli import main
from lmtrain.compile_cache import FOLDER_NAME, CompileCache, describe_outcome

#: A compiled model small enough that inductor's CPU kernels compile in seconds.
CONFIG = """seed_everything: 0
model: {size: tiny, num_layers: 1, d_model: 32, num_heads: 2, d_ff: 64, vocab_size: 64, context_length: 16,
        compile: true}
data: {source: synthetic, batch_size: 2, train_batches: 4, val_batches: 1}
trainer: {max_steps: 2, accelerator: cpu, limit_val_batches: 0, enable_checkpointing: false,
          enable_progress_bar: false, enable_model_summary: false}
"""


def _fit(cwd: Path, *args: str) -> str:
    env = own_job_env()
    # A warm per-user cache must not decide the outcome: only the folder under test holds kernels.
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-m", "lmtrain", "fit", "--config", "config.yaml", *args], cwd=cwd,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


@pytest.mark.slow
def test_second_compiled_fit_loads_from_the_cache_under_the_log_root(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(CONFIG)
    first = _fit(tmp_path)
    folder = tmp_path / "logs" / FOLDER_NAME
    assert f"compile cache: logs/{FOLDER_NAME} (empty: this run fills it)" in first
    assert "first step: " in first and "(compile cache: miss, " in first
    stored = [p for p in (folder / "inductor").rglob("*") if p.is_file()]
    assert any("fxgraph" in p.parts for p in stored) and any("aotautograd" in p.parts for p in stored)
    second = _fit(tmp_path)
    files = re.search(rf"compile cache: logs/{FOLDER_NAME} \((\d+) files from earlier runs\)", second)
    assert files is not None and int(files.group(1)) >= len(stored)
    line = next(ln for ln in second.splitlines() if ln.startswith("first step: "))
    assert re.fullmatch(r"first step: \d+\.\d s \(compile cache: hit, (\d+) of \1 compiled graphs loaded\)", line)


#: The fast configs' recipe (compile, CUDA graphs, master weights, compact state) at a size that compiles quickly.
GPU_CONFIG = """seed_everything: 0
model: {size: tiny, vocab_size: 256, context_length: 128, compile: true, cuda_graphs: true, master_weights: true,
        optimizer_state_dtype: bfloat16}
data: {source: synthetic, batch_size: 4, train_batches: 20, val_batches: 1}
trainer: {max_steps: 6, precision: bf16-mixed, limit_val_batches: 0, enable_checkpointing: false,
          enable_progress_bar: false}
"""


@pytest.mark.gpu
def test_second_compiled_gpu_fit_with_cuda_graphs_loads_its_kernels(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(GPU_CONFIG)
    first = _fit(tmp_path, "--compile_cache", "cache")
    assert "(compile cache: miss, " in first
    assert any(p.is_file() for p in (tmp_path / "cache" / "triton").rglob("*"))  # Triton's kernels are there too
    second = _fit(tmp_path, "--compile_cache", "cache")
    line = next(ln for ln in second.splitlines() if ln.startswith("first step: "))
    assert "(compile cache: hit, " in line, second[-3000:]


def test_outcome_of_the_lookups() -> None:
    zero = {"hit": 0, "miss": 0, "bypass": 0}
    assert describe_outcome(zero, zero) is None
    assert describe_outcome(zero, {"hit": 3, "miss": 0, "bypass": 0}) == "hit, 3 of 3 compiled graphs loaded"
    assert describe_outcome(zero, {"hit": 0, "miss": 3, "bypass": 0}) == \
        "miss, 3 graphs compiled: 3 compiled and stored"
    assert describe_outcome({"hit": 1, "miss": 0, "bypass": 0}, {"hit": 3, "miss": 1, "bypass": 1}) == \
        "partial, 2 of 4 compiled graphs loaded, 1 compiled and stored, 1 bypassed"


def test_setup_points_the_caches_at_the_folder_and_teardown_restores_them(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning.pytorch as pl

    from lmtrain.module import LMModule

    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    trainer = pl.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path, enable_progress_bar=False)
    cache = CompileCache()
    module = LMModule(size="tiny", vocab_size=64, context_length=16)
    module.trainer = trainer
    cache.setup(trainer, module, "fit")
    assert cache.path == (tmp_path / FOLDER_NAME).resolve()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache.path / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(cache.path / "triton")
    cache.teardown(trainer, module, "fit")
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ and os.environ["TRITON_CACHE_DIR"] == "/elsewhere"


@pytest.mark.parametrize("kind", ["file", "proc"])
def test_a_cache_folder_that_cannot_be_written_is_one_line(kind: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text(CONFIG)
    (tmp_path / "a_file").write_text("x")
    # /proc/1 takes no new folder, not even from root (who may write into any chmod'ed folder).
    folder = tmp_path / "a_file" / "cache" if kind == "file" else Path("/proc/1/lmtrain-cache")
    if kind == "proc" and not Path("/proc/1").is_dir():
        pytest.skip("no /proc here")
    before = sorted(tmp_path.rglob("*"))
    line = one_line_error(lambda: main(["fit", "--config", "config.yaml", "--compile_cache", str(folder)]), capsys)
    assert line.startswith("error: compile_cache: ") and " Fix: " in line
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize(("args", "added"), [([], True), (["--compile_cache", "off"], False),
                                             (["--model.compile", "false"], False)])
def test_the_command_line_adds_the_cache_when_the_model_compiles(args: list[str], added: bool, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from lmtrain.cli_config import compile_cache_callback, resolve_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text(CONFIG)
    resolved = resolve_args(["--config", "config.yaml", *args])
    folder = "off" if "off" in args else None
    callback = compile_cache_callback({"compile_cache": folder, "model": resolved.model})
    assert isinstance(callback, CompileCache) == added
