"""``benchmarks/scripts/hook_cost.py``: the callbacks' host time per step, from Lightning's profiled hook actions."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
from conftest import load_script

from lmtrain import LMDataModule, LMModule
from lmtrain.callbacks import CudaSyncTimer, NVTXRanges


@pytest.fixture(scope="module")
def hook_cost():  # noqa: ANN201 (a module)
    return load_script("hook_cost")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_hook_time_is_summed_per_callback_and_step(hook_cost, tmp_path: Path) -> None:  # noqa: ANN001
    clock = FakeClock()
    prof = hook_cost.HookCost(tmp_path / "h.json", clock=clock)

    def hook(name: str, seconds: float) -> None:
        prof.start(name)
        clock.now += seconds
        prof.stop(name)

    hook("[Callback]Timer.on_fit_start", 5.0)  # before the first step: not counted
    for a, b in [(10e-6, 1e-6), (20e-6, 2e-6), (30e-6, 500e-6)]:
        prof.start("run_training_batch")
        hook("[Callback]Timer.on_before_backward", a)
        hook("[LightningModule]LMModule.training_step", 1.0)  # other actions are not timed
        hook("[Callback]Timer.on_after_backward", a)
        prof.stop("run_training_batch")
        hook("[Callback]{'Window': 3}.on_train_batch_end", b)  # state keys may hold dots and braces
    report = prof.report()
    assert report["Timer"] == {"median_us": pytest.approx(40.0), "max_us": pytest.approx(60.0), "steps": 3}
    assert report["{'Window': 3}"] == {"median_us": pytest.approx(2.0), "max_us": pytest.approx(500.0), "steps": 3}
    prof.teardown("fit")
    assert json.loads((tmp_path / "h.json").read_text()) == json.loads(json.dumps(report))


@pytest.mark.slow
def test_a_fit_reports_each_attached_callback(hook_cost, tmp_path: Path) -> None:  # noqa: ANN001
    pl.seed_everything(0)
    prof = hook_cost.HookCost(tmp_path / "hooks.json")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, profiler=prof,
                         callbacks=[CudaSyncTimer(warmup_steps=1), NVTXRanges()], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0)
    trainer.fit(LMModule(size="tiny", vocab_size=64, context_length=16, warmup_steps=1),
                LMDataModule(source="synthetic", batch_size=2, context_length=16, vocab_size=64, train_batches=8,
                             val_batches=1))
    report = json.loads((tmp_path / "hooks.json").read_text())
    assert set(report) == {"CudaSyncTimer", "NVTXRanges"}
    for figures in report.values():
        assert figures["steps"] == 6 and 0 < figures["median_us"] <= figures["max_us"]
