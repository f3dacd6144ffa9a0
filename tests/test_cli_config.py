"""One configuration path: every command resolves a YAML config and overrides through the ``fit`` parser."""

from __future__ import annotations

import argparse
import ast
import inspect
from dataclasses import fields, replace
from pathlib import Path

import pytest
import yaml

from lmtrain.bench import callbacks, overhead
from lmtrain.bench import model as bench_model
from lmtrain.cli import main
from lmtrain.cli_config import resolve_args, resolve_config
from lmtrain.config import ModelConfig
from lmtrain.errors import LmtrainError
from lmtrain.estimate import resolve as estimate_resolve
from lmtrain.module import LMModule

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
OVERRIDES = ["--model.context_length", "64", "--data.batch_size", "2", "--model.norm_eps", "1e-6"]


def test_every_command_resolves_the_same_arguments(capsys: pytest.CaptureFixture) -> None:
    reference = resolve_args(["--config", TINY, *OVERRIDES])
    assert reference.model["context_length"] == reference.data["context_length"] == 64  # the link
    assert reference.data["batch_size"] == 2 and reference.model["norm_eps"] == 1e-6

    # fit: what --print_config shows is what the loader returns
    with pytest.raises(SystemExit):
        main(["fit", "--config", TINY, *OVERRIDES, "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"] == yaml.safe_load(yaml.safe_dump(reference.model))
    assert printed["trainer"]["precision"] == reference.trainer["precision"]
    assert printed["trainer"]["max_steps"] == reference.trainer["max_steps"] == 300

    # estimate
    resolved, mode = estimate_resolve(argparse.Namespace(mode=None, gpu_memory_gib=80.0,
                                                         config_args=["--config", TINY, *OVERRIDES]))
    assert (resolved.model, resolved.data, resolved.trainer, mode) == (reference.model, reference.data,
                                                                        reference.trainer, "train")

    # bench overhead: the same, without the trainer's callbacks
    model, data, trainer = overhead.load_config(argparse.Namespace(config=TINY, context_length=64, attention=None,
                                                                   batch_size=2))
    assert model == {**reference.model, "norm_eps": ModelConfig.norm_eps}  # its flags do not set norm_eps
    expected_trainer = {k: v for k, v in reference.trainer.items() if k != "callbacks"}
    assert (data, trainer) == (reference.data, {**expected_trainer, "precision": "32-true"})

    # bench callbacks
    model, data, precision, source = callbacks.load_setup(argparse.Namespace(
        config=TINY, size=None, context_length=64, batch_size=2, precision=None, steps=4))
    assert model == {**reference.model, "norm_eps": ModelConfig.norm_eps}
    assert (data, precision, source) == (reference.data, "32-true", TINY)

    # bench model: a cell given as a YAML path
    cell = bench_model.Cell(TINY, 64, 2, "32-true", "sdpa", False, "train", 1, 2)
    assert bench_model.module_kwargs(cell) == {**reference.model, "norm_eps": ModelConfig.norm_eps}
    resolved = resolve_args(["--config", TINY, "--model.context_length", "64"])
    assert bench_model.cell_config(cell) == resolved.model_config()


def test_mapping_overrides_and_precision_names() -> None:
    resolved = resolve_config(None, {"model.size": "tiny", "trainer.precision": "bf16", "data.batch_size": None})
    assert resolved.model["size"] == "tiny" and resolved.precision == "bf16-mixed"
    assert resolved.data["batch_size"] == 4  # None: not overridden, the data module's default
    assert resolve_config().precision == "32-true"  # Lightning's default
    # no placeholder hp_metric scalar in TensorBoard
    assert resolved.trainer["logger"]["init_args"]["default_hp_metric"] is False


def test_resolution_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    resolve_config(TINY, ["--trainer.max_steps", "3"])
    assert list(tmp_path.iterdir()) == []


def test_resolution_errors_name_the_field() -> None:
    with pytest.raises(LmtrainError) as info:
        resolve_config(TINY, ["--model.lrr", "1"])
    assert info.value.field == "model.lrr" and "--model.lr" in info.value.fix
    with pytest.raises(LmtrainError) as info:
        resolve_config(TINY, ["--trainer.precision", "17"])
    assert info.value.field == "trainer.precision" and "bf16-mixed" in info.value.fix


def test_lmmodule_defaults_are_modelconfigs() -> None:
    params = inspect.signature(LMModule.__init__).parameters
    from_size = {"d_model", "num_layers", "num_heads", "d_ff"}  # None: taken from the named size
    for f in fields(ModelConfig):
        assert f.name in params, f"LMModule has no parameter {f.name}"
        expected = None if f.name in from_size else f.default
        assert params[f.name].default == expected, f.name
    module = LMModule(size="tiny", vocab_size=256, norm_eps=1e-6)
    assert module.config == ModelConfig.from_size("tiny", vocab_size=256, norm_eps=1e-6)


def _import_graph() -> dict[str, set[str]]:
    """lmtrain module -> the lmtrain modules it imports (anywhere in the file, lazy imports included).

    A package and its own submodules are one unit here (``lmtrain.kernels`` re-exporting its submodules is
    not a circle between modules).
    """
    package = ROOT / "lmtrain"
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            targets |= {n for n in names if n in modules and n != "lmtrain"}
        graph[name] = {t for t in targets if not (t.startswith(name + ".") or name.startswith(t + "."))
                       and t != name}
    return graph


def test_no_import_circle_in_lmtrain() -> None:
    graph = _import_graph()
    assert graph["lmtrain.bench.report"] >= {"lmtrain.bench.model", "lmtrain.bench.studies"}  # lazy and eager
    visiting, done, cycles = set(), set(), []

    def visit(node: str, path: list[str]) -> None:
        visiting.add(node)
        for nxt in sorted(graph[node]):
            if nxt in visiting:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, [*path, nxt])
        visiting.discard(node)
        done.add(node)

    for start in sorted(graph):
        if start not in done:
            visit(start, [start])
    assert cycles == []


TRAINER_SECTIONS = [
    [],
    ["--trainer.precision", "bf16", "--trainer.accumulate_grad_batches", "4", "--trainer.gradient_clip_val", "0.5"],
    ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"],
    ["--trainer.accelerator", "cpu", "--trainer.devices", "2"],  # strategy auto on two processes: DDP
]


@pytest.mark.parametrize("args", TRAINER_SECTIONS, ids=["defaults", "bf16-accumulate-clip", "ddp", "auto-on-2"])
def test_parsed_trainer_settings_are_those_of_the_trainer_it_builds(args: list[str]) -> None:
    """What the command line checks the options against before the trainer exists is what a fit's own check reads
    of the trainer that Lightning builds from the same section (the device: on a machine without a GPU)."""
    import lightning.pytorch as pl
    import torch

    from lmtrain.cli_config import parsed_trainer_settings
    from lmtrain.module import trainer_settings

    trainer = resolve_args(["--config", TINY, *args]).trainer
    built = pl.Trainer(**{key: trainer[key] for key in ("accelerator", "devices", "num_nodes", "strategy", "precision",
                                                        "accumulate_grad_batches", "gradient_clip_val")},
                       logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    parsed = parsed_trainer_settings(trainer)
    if parsed.device is None and torch.cuda.is_available():  # which GPU is known once the trainer exists
        parsed = replace(parsed, device=str(built.strategy.root_device))
    assert parsed == trainer_settings(built)


def test_validate_and_test_are_not_refused_for_options_of_the_training_step() -> None:
    """``check_settings`` at parse time of validate/test (``training=False``) leaves out the rules of the training
    step: a master-weights model evaluates in 32-true."""
    from lmtrain.config import TrainerSettings

    config = ModelConfig.from_size("tiny", master_weights=True)
    LMModule.check_settings(config, TrainerSettings(precision="32-true", accumulate_grad_batches=2), training=False)
    with pytest.raises(LmtrainError) as info:
        LMModule.check_settings(config, TrainerSettings(precision="32-true"))
    assert info.value.field == "model.master_weights"
