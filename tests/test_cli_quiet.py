"""A normal run says nothing false or irrelevant: no product tips, no deprecations from Lightning's own code, no
warning that a checkpoint's betas list "replaces" the same betas as a tuple."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities import rank_zero_info

from lmtrain.checkpoints import check_checkpoint_model
from lmtrain.cli_config import lightning_notices_off


def test_tips_and_leafspec_deprecation_are_dropped_only_inside(caplog: pytest.LogCaptureFixture) -> None:
    from torch.utils._pytree import LeafSpec

    caplog.set_level(logging.INFO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with lightning_notices_off():
            rank_zero_info("💡 Tip: install something.")
            rank_zero_info("a real message")
            LeafSpec()
    assert [r.getMessage() for r in caplog.records] == ["a real message"]
    assert not [w for w in caught if "LeafSpec" in str(w.message)]
    caplog.clear()
    rank_zero_info("💡 Tip: install something.")  # outside: Lightning's behaviour is untouched
    assert [r.getMessage() for r in caplog.records] == ["💡 Tip: install something."]


@pytest.mark.parametrize(("saved", "requested"), [((0.9, 0.95), [0.9, 0.95]), ([0.9, 0.95], (0.9, 0.95))])
def test_betas_as_list_or_tuple_are_the_same(saved: object, requested: object, tmp_path: Path) -> None:
    hparams = {"size": "tiny", "vocab_size": 64, "context_length": 16, "betas": saved, "lr": 0.003}
    path = tmp_path / "last.ckpt"
    torch.save({"hyper_parameters": hparams, "global_step": 1}, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_checkpoint_model(path, {**hparams, "betas": requested})
    assert not [w for w in caught if "replace" in str(w.message)]
    with pytest.warns(UserWarning, match=r"lr=0.003 \(requested 0.001\)"):  # a real difference is still reported
        check_checkpoint_model(path, {**hparams, "betas": requested, "lr": 0.001})
