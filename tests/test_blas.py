"""model.blas_workspace (lmtrain.blas): the environment it sets, what it leaves alone, and deterministic mode."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lmtrain import blas
from lmtrain.module import LMModule

VARS = tuple(blas.NO_WORKSPACE)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in VARS:
        monkeypatch.delenv(name, raising=False)  # restored after the test, whatever apply_blas_workspace sets
    monkeypatch.setattr(blas, "_set_here", False)
    return monkeypatch


def test_none_gives_cublas_no_workspace(clean_env: pytest.MonkeyPatch) -> None:
    assert blas.apply_blas_workspace("none") is None
    assert {name: os.environ[name] for name in VARS} == {"CUBLASLT_WORKSPACE_SIZE": "0",
                                                          "CUBLAS_WORKSPACE_CONFIG": ":0:0"}


def test_default_changes_nothing(clean_env: pytest.MonkeyPatch) -> None:
    assert blas.apply_blas_workspace("default") is None
    assert not any(name in os.environ for name in VARS)


def test_a_variable_the_environment_sets_wins_and_is_named(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    note = blas.apply_blas_workspace("none")
    assert note is not None and "CUBLAS_WORKSPACE_CONFIG=:4096:8" in note and "CUBLASLT" not in note
    # neither is set: half a setting is not the user's, nor lmtrain's
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and "CUBLASLT_WORKSPACE_SIZE" not in os.environ


def test_deterministic_modes_own_setting_is_kept_without_a_word(clean_env: pytest.MonkeyPatch) -> None:
    """Trainer(deterministic=True) has Lightning set :4096:8 before the module is built: kept, and no advice to
    unset what deterministic mode requires."""
    clean_env.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert blas.apply_blas_workspace("none") is None
    finally:
        torch.use_deterministic_algorithms(was)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and "CUBLASLT_WORKSPACE_SIZE" not in os.environ


def test_default_takes_back_only_what_lmtrain_set(clean_env: pytest.MonkeyPatch) -> None:
    blas.apply_blas_workspace("none")
    assert blas.apply_blas_workspace("default") is None
    assert not any(name in os.environ for name in VARS)
    for name, value in blas.NO_WORKSPACE.items():  # the same values, set by the user
        clean_env.setenv(name, value)
    assert blas.apply_blas_workspace("default") is None
    assert all(os.environ[name] == value for name, value in blas.NO_WORKSPACE.items())


def test_an_unknown_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown blas_workspace 'small'"):
        blas.apply_blas_workspace("small")


def test_deterministic_mode_gets_the_workspace_it_requires(clean_env: pytest.MonkeyPatch) -> None:
    blas.apply_blas_workspace("none")
    assert blas.deterministic_workspace() is None  # deterministic algorithms off: nothing to do
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        note = blas.deterministic_workspace()
    finally:
        torch.use_deterministic_algorithms(was)
    assert note is not None and "deterministic" in note and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_auto_gives_no_workspace_under_cuda_graphs() -> None:
    """Measured: a graphed step gains (no host launches its products; float8's cuBLASLt products too), an eager
    host-bound one loses."""
    assert blas.resolve_blas_workspace("auto", cuda_graphs=True) == "none"
    assert blas.resolve_blas_workspace("auto", cuda_graphs=False) == "default"
    for forced in ("none", "default"):
        for graphs in (True, False):
            assert blas.resolve_blas_workspace(forced, cuda_graphs=graphs) == forced


def test_apply_resolves_auto_itself(clean_env: pytest.MonkeyPatch) -> None:
    assert blas.apply_blas_workspace("auto", cuda_graphs=False) is None and not any(n in os.environ for n in VARS)
    blas.apply_blas_workspace("auto", cuda_graphs=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":0:0"


def test_building_the_module_applies_the_option(clean_env: pytest.MonkeyPatch) -> None:
    module = LMModule("tiny")  # the default, auto: eager here, so PyTorch's workspace
    assert module.config.blas_workspace == "auto" and not any(name in os.environ for name in VARS)
    LMModule("tiny", cuda_graphs=True)  # auto under CUDA graphs: no workspace
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":0:0" and os.environ["CUBLASLT_WORKSPACE_SIZE"] == "0"


def test_a_fit_records_what_the_option_resolved_to(tmp_path, clean_env: pytest.MonkeyPatch) -> None:
    """auto on an eager CPU fit resolves to PyTorch's workspace, and the run's hyperparameters say so."""
    import lightning.pytorch as pl
    import yaml
    from lightning.pytorch.loggers import TensorBoardLogger

    from lmtrain.data import LMDataModule

    module = LMModule("tiny", vocab_size=256, context_length=16, num_layers=1)
    data = LMDataModule(source="synthetic", batch_size=2, context_length=16, vocab_size=256, train_batches=4)
    logger = TensorBoardLogger(tmp_path, name="tb")
    pl.Trainer(max_steps=1, accelerator="cpu", logger=logger, enable_progress_bar=False, enable_model_summary=False,
               enable_checkpointing=False, limit_val_batches=0).fit(module, data)
    hparams = yaml.unsafe_load((Path(logger.log_dir) / "hparams.yaml").read_text())  # tuples of the options
    assert hparams["blas_workspace"] == "auto" and hparams["blas_workspace_applied"] == "default"
