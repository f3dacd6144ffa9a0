"""The command line: every shipped config parses, a short fit logs to TensorBoard, bad input stops cleanly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from tb import scalars

from lmtrain.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
TINY = ROOT / "configs" / "tiny.yaml"
STUDY_CONFIGS = [f"{size}_{precision}" for size in ("small", "medium", "large", "xl", "2.7B")
                for precision in ("fp32", "bf16")]


def test_every_size_and_precision_is_shipped() -> None:
    names = {p.stem for p in CONFIGS}
    assert set(STUDY_CONFIGS) | {"tiny"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_parses_through_the_cli(path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(path), "--print_config"])
    assert info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    source = yaml.safe_load(path.read_text())
    for section in ("model", "data", "trainer"):
        for key, value in (source.get(section) or {}).items():
            if key != "callbacks":
                assert printed[section][key] == value, f"{section}.{key}"
    # The data's shapes are linked to the model's: derived, so not options of their own.
    assert "context_length" not in printed["data"] and "vocab_size" not in printed["data"]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_config_field_is_commented(path: Path) -> None:
    for number, line in enumerate(path.read_text().splitlines(), 1):
        code = line.split("#", 1)[0].rstrip()
        if not code.strip() or code.endswith(":") or re.match(r"\s*-?\s*class_path:", code):
            continue  # comment, blank, section header, or a class named by its import path
        assert "#" in line, f"{path.name}:{number} has no comment: {line!r}"


@pytest.mark.parametrize("name", STUDY_CONFIGS)
def test_size_config_is_the_course_benchmark_setup(name: str) -> None:
    config = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    size, precision = name.split("_")
    assert config["model"]["size"] == size
    assert config["model"]["vocab_size"] == 10_000
    assert config["model"]["context_length"] == 512
    assert config["model"]["attention"] == "sdpa"
    assert config["data"]["source"] == "synthetic"
    assert config["data"]["batch_size"] == 4
    assert config["trainer"]["precision"] == {"fp32": "32-true", "bf16": "bf16-mixed"}[precision]
    # Checkpoints are cheap for small (1.44 GiB) and kept there; medium and larger leave them off.
    assert config["trainer"]["enable_checkpointing"] is (size == "small")


def test_override_reaches_model_and_data(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs" / "2.7B_bf16.yaml"), "--model.context_length", "1024",
              "--trainer.max_steps", "20", "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["context_length"] == 1024
    assert printed["trainer"]["max_steps"] == 20


def test_fit_tiny_logs_train_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    status = main([
        "fit", "--config", str(TINY), "--trainer.max_steps", "4", "--trainer.log_every_n_steps", "1",
        "--trainer.val_check_interval", "2", "--data.val_batches", "2", "--data.max_bytes", "60000",
        "--data.batch_size", "4", "--model.context_length", "32", "--trainer.enable_progress_bar", "false",
    ])
    assert status == 0
    (run_dir,) = (tmp_path / "logs" / "lmtrain").iterdir()
    logged = scalars(run_dir)
    assert [step for step, _ in logged["train/loss"]] == [0, 1, 2, 3]
    assert all(0 < loss < 10 for _, loss in logged["train/loss"])
    assert len(logged["val/loss"]) == 2  # validation after steps 2 and 4
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["context_length"] == 32 and saved["trainer"]["max_steps"] == 4
    # The link gave the data module the model's context length.
    hparams = yaml.safe_load((run_dir / "hparams.yaml").read_text())
    assert hparams["context_length"] == 32 and hparams["batch_size"] == 4


# -- bad input: exit 2, one error line naming the field and the fix, no traceback, nothing written ---------


BAD_CASES = ("unknown_size", "heads_not_dividing", "unknown_attention", "missing_data_file", "id_not_below_vocab",
             "gpu_only_backend")


def _bad_cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (arguments after the tiny config, the field the error must name)."""
    big_ids = tmp / "big_ids.npy"
    np.save(big_ids, np.arange(2000, dtype=np.int32) % 300)  # ids up to 299 with vocab_size 256
    return {
        "unknown_size": (["--model.size", "huge"], "model.size"),
        "heads_not_dividing": (["--model.num_heads", "3"], "model.num_heads"),
        "unknown_attention": (["--model.attention", "flash_magic"], "model.attention"),
        "missing_data_file": (["--data.source", "tokens", "--data.path", str(tmp / "missing.npy")], "data.path"),
        "id_not_below_vocab": (["--data.source", "tokens", "--data.path", str(big_ids)], "data.path"),
        "gpu_only_backend": (["--model.attention", "flash_triton"], "model.attention"),
    }


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path, str]]:
    """Every bad-input run at once (each is a fresh interpreter: mostly import time)."""
    tmp = tmp_path_factory.mktemp("bad")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    cases = _bad_cases(tmp)
    assert tuple(cases) == BAD_CASES
    started = {}
    for name, (args, field) in cases.items():
        cwd = tmp / name
        cwd.mkdir()
        command = [sys.executable, "-m", "lmtrain", "fit", "--config", str(TINY), "--trainer.max_steps", "2", *args]
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        started[name] = (process, command, cwd, field)
    results = {}
    for name, (process, command, cwd, field) in started.items():
        out, err = process.communicate(timeout=300)
        results[name] = (subprocess.CompletedProcess(command, process.returncode, out, err), cwd, field)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_stops_cleanly(case: str, bad_runs: dict) -> None:
    result, cwd, field = bad_runs[case]
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr  # the whole stderr: no seed or device line, no warning before it
    assert re.fullmatch(rf"error: {re.escape(field)}: .+ Fix: .+", lines[0]), lines[0]
    assert list(cwd.iterdir()) == []  # no logs/, no lightning_logs/, nothing half-written


# -- bad arguments: the parser's errors, one line first, exit 2, nothing written -------------------------------

PARSER_CASES = ("missing_config", "malformed_yaml", "unknown_option", "unknown_yaml_key", "unknown_callback",
                "bad_precision", "misspelt_option", "fp16_on_cpu", "zero_steps", "predict", "unknown_command",
                "bench_abbreviation", "unknown_benchmark")


@pytest.fixture(scope="module")
def parser_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    files = tmp_path_factory.mktemp("files")
    malformed = files / "malformed.yaml"
    malformed.write_text("model:\n  size: tiny\n  vocab_size: [1, 2\ndata:\n  batch_size: 2\n")
    unknown_key = files / "unknown_key.yaml"
    unknown_key.write_text(TINY.read_text().replace("  lr: 3.0e-3", "  lrr: 3.0e-3"))
    fit = ["fit", "--config", str(TINY)]
    cases = {
        "missing_config": ["fit", "--config", str(files / "nope.yaml")],
        "malformed_yaml": ["fit", "--config", str(malformed)],
        "unknown_option": [*fit, "--model.foo", "1"],
        "unknown_yaml_key": ["fit", "--config", str(unknown_key)],
        "unknown_callback": [*fit, "--trainer.callbacks+=lmtrain.callbacks.Nope"],
        "bad_precision": [*fit, "--trainer.precision", "17"],
        "misspelt_option": [*fit, "--trainer.max_step", "5"],
        "fp16_on_cpu": [*fit, "--trainer.precision", "16-mixed"],
        "zero_steps": [*fit, "--trainer.max_steps", "0"],
        "predict": ["predict", "--config", str(TINY)],
        "unknown_command": ["train"],
        "bench_abbreviation": ["bench", "model", "--size", "tiny"],  # --sizes, abbreviated
        "unknown_benchmark": ["bench", "speed"],
    }
    assert tuple(cases) == PARSER_CASES
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    work = tmp_path_factory.mktemp("cwd")
    started = {}
    for name, args in cases.items():
        cwd = work / name
        cwd.mkdir()
        process = subprocess.Popen([sys.executable, "-m", "lmtrain", *args], cwd=cwd, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started[name] = (process, args, cwd)
    results = {}
    for name, (process, args, cwd) in started.items():
        out, err = process.communicate(timeout=300)
        results[name] = (subprocess.CompletedProcess(args, process.returncode, out, err), cwd)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", PARSER_CASES)
def test_parser_errors_are_one_line_first(case: str, parser_runs: dict) -> None:
    result, cwd = parser_runs[case]
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and " Fix: " in lines[0], result.stderr
    assert list(cwd.iterdir()) == []  # no logs/, no lightning_logs/


@pytest.mark.slow
def test_parser_errors_name_what_is_wrong(parser_runs: dict) -> None:
    first = {name: result.stderr.splitlines()[0] for name, (result, _) in parser_runs.items()}
    assert first["missing_config"].startswith("error: --config: ") and "nope.yaml" in first["missing_config"]
    assert re.match(r"error: --config: \S*malformed\.yaml, line \d+, column \d+: ", first["malformed_yaml"])
    assert first["unknown_option"].startswith("error: model.foo: ")
    assert first["unknown_yaml_key"].startswith("error: model.lrr: ") and "model.lr?" in first["unknown_yaml_key"]
    assert first["unknown_callback"].startswith("error: trainer.callbacks: ") and "Nope" in first["unknown_callback"]
    assert first["bad_precision"].startswith("error: trainer.precision: '17' ")
    # not prefix-matched to --trainer.max_steps
    assert first["misspelt_option"].startswith("error: trainer.max_step: ") and "max_steps?" in first["misspelt_option"]
    assert first["fp16_on_cpu"].startswith("error: trainer.precision: 16-mixed needs a CUDA GPU")
    assert first["zero_steps"].startswith("error: trainer.max_steps: ")
    assert first["predict"].startswith("error: command: there is no command 'predict'")
    assert first["bench_abbreviation"].startswith("error: --size: ")
    assert first["unknown_benchmark"].startswith("error: bench: ")


def test_help_lists_every_command_and_version(capsys: pytest.CaptureFixture) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m lmtrain ") and "__main__" not in out
    commands = [line.split()[0] for line in out.split("commands:")[1].split("options:")[0].splitlines() if line.strip()]
    assert commands == ["fit", "validate", "test", "bench", "estimate", "analyze", "prepare", "generate"]
    assert "predict" not in out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == "lmtrain 0.1.0"
    assert main(["bench", "--help"]) == 0
    listed = capsys.readouterr().out
    names = ("model", "attention", "precision", "report", "overhead", "callbacks")
    assert all(f"  {name} " in listed for name in names)
