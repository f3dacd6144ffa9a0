"""The option schema (``lmtrain.config``): one field per option, seen by the command line, the bench cells and the
memory planner alike."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, make_dataclass
from pathlib import Path

import pytest
from refusals import refused

from lmtrain.bench import model as bench_model
from lmtrain.cli_config import resolve_args
from lmtrain.config import (
    Float8Options,
    MemoryOptions,
    ModelConfig,
    OptimizerOptions,
    ShapeOptions,
    SpeedOptions,
    doc_of,
    option,
    step_fields,
)
from lmtrain.errors import LmtrainError
from lmtrain.memory_plan import estimate_memory
from lmtrain.module import LMModule

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
GROUPS = (ShapeOptions, OptimizerOptions, MemoryOptions, SpeedOptions, Float8Options)


def _extended() -> type[ModelConfig]:
    """ModelConfig with one boolean option more, declared as one field of a group derived from SpeedOptions."""
    fancy = make_dataclass("FancySpeed", [("fancy_kernels", bool, option(False, "serve the matrix products with the "
                                                                          "fancy kernels.", short="fancy"))],
                           bases=(SpeedOptions,), frozen=True)
    return make_dataclass("FancyConfig", [], bases=(ModelConfig, fancy), frozen=True)


def test_a_new_boolean_option_is_one_field(capsys: pytest.CaptureFixture[str]) -> None:
    config_class = _extended()
    module_class = LMModule.with_config(config_class)
    # The command line: parsed, checked, and listed with its help.
    resolved = resolve_args(["--config", TINY, "--model.fancy_kernels", "true"], module_class=module_class)
    assert resolved.model["fancy_kernels"] is True and resolved.model_config().fancy_kernels is True
    assert resolve_args(["--config", TINY], module_class=module_class).model_config().fancy_kernels is False
    with pytest.raises(LmtrainError) as info:
        config_class.from_size("tiny", fancy_kernels="yes")
    assert info.value.field == "model.fancy_kernels"
    with pytest.raises(SystemExit):
        resolve_args(["--help"], module_class=module_class)
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--model.fancy_kernels {true,false} serve the matrix products with the fancy kernels." in help_text
    module = module_class(size="tiny", vocab_size=64, fancy_kernels=True)
    assert module.config.fancy_kernels is True and module.hparams["fancy_kernels"] is True
    # The bench cell: a field, a flag, in the key and the name only when set.
    cell_class = bench_model.cell_class(config_class)
    axes = ("tiny", 64, 2, "32-true", "sdpa", False, "train", 1, 2)
    plain, fancy = cell_class(*axes), cell_class(*axes, fancy_kernels=True)
    assert "fancy_kernels" not in json.loads(plain.key()) and json.loads(fancy.key())["fancy_kernels"] is True
    assert fancy.slug == plain.slug + "_fancy" and fancy.options() == {"fancy_kernels": True}
    parser = argparse.ArgumentParser()
    bench_model.add_option_arguments(parser, config_class)
    assert parser.parse_args(["--fancy-kernels", "off,on"]).fancy_kernels == ["off", "on"]
    # The planner: the cell's config reaches it with the option among its inputs.
    config = bench_model.cell_config(fancy)
    assert type(config) is config_class and config.fancy_kernels is True
    assert estimate_memory(config, 2, 64, device_type="cpu").details["options"]["fancy_kernels"] is True


def test_every_field_has_help_and_belongs_to_one_group() -> None:
    owner = {f.name: g for g in GROUPS for f in fields(g)}
    assert {f.name for f in fields(ModelConfig)} == set(owner)
    assert sum(len(fields(g)) for g in GROUPS) == len(fields(ModelConfig))  # no field declared twice
    for f in fields(ModelConfig):
        assert doc_of(f).strip(), f"{f.name} has no help"
    # The step options (cells, planner) are the memory, speed and float8 groups' fields.
    step_groups = (MemoryOptions, SpeedOptions, Float8Options)
    assert {f.name for f in step_fields()} == {f.name for g in step_groups for f in fields(g)}


def test_the_command_line_and_the_module_take_exactly_the_schema() -> None:
    resolved = resolve_args(["--config", TINY])
    assert set(resolved.model) == {"size"} | {f.name for f in fields(ModelConfig)}
    with pytest.raises(TypeError, match="unexpected keyword argument 'n_embd'"):
        LMModule(size="tiny", n_embd=64)


@pytest.mark.parametrize("options, field, other", [
    (dict(optimizer_overlap=True), "model.optimizer_overlap", "model.optimizer_in_backward"),
    (dict(master_weights=True, optimizer_in_backward=True), "model.master_weights", "model.optimizer_in_backward"),
    (dict(optimizer_in_backward=True, step_mode="forward"), "model.optimizer_in_backward", "step_mode"),
    (dict(cuda_graphs=True, step_mode="forward_backward"), "model.cuda_graphs", "step_mode"),
    (dict(cuda_graphs=True, activation_checkpointing="offload"), "model.cuda_graphs",
     "model.activation_checkpointing"),
    (dict(compile_mode="max-autotune-no-cudagraphs"), "model.compile_mode", "model.compile"),
    (dict(optimizer_state_dtype="bfloat16"), "model.optimizer_state_dtype", "model.master_weights"),
    (dict(float8_head=True), "model.float8_head", "model.float8"),
    (dict(float8="tensorwise", float8_head=True, loss_chunk_tokens=64), "model.float8_head",
     "model.loss_chunk_tokens"),
])
def test_combinations_that_cannot_work_are_refused_at_parse_time(options: dict, field: str, other: str) -> None:
    args = ["--config", TINY]
    for key, value in options.items():
        args += [f"--model.{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    with pytest.raises(LmtrainError) as info:
        resolve_args(args).model_config()
    assert info.value.field == field and other in str(info.value) and "\n" not in str(info.value)


def test_the_command_line_refuses_a_combination_before_writing_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    line = refused(["fit", "--config", TINY, "--model.cuda_graphs", "true", "--model.step_mode", "forward"],
                   "model.cuda_graphs", capsys, tmp_path)
    assert "step_mode" in line
    assert list(tmp_path.iterdir()) == []


def test_a_percent_sign_in_an_options_help_reaches_the_bench_flags_as_text() -> None:
    """argparse formats help texts with %: the bench flags escape them, so a doc may say "2% faster"."""
    import argparse

    from lmtrain.bench.model import add_option_arguments

    fancy = make_dataclass("PercentSpeed", [("fast_path", bool, option(False, "2% faster on graphed steps."))],
                           bases=(SpeedOptions,), frozen=True)
    config_class = make_dataclass("PercentConfig", [], bases=(ModelConfig, fancy), frozen=True)
    parser = argparse.ArgumentParser(formatter_class=lambda prog: argparse.HelpFormatter(prog, width=100_000))
    add_option_arguments(parser, config_class)
    assert "2% faster on graphed steps. (model.fast_path)" in parser.format_help()
