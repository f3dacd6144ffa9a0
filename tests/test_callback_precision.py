"""PrecisionInspector through a real Trainer.fit on CPU: bf16 autocast dtypes, flags and reasons, fp32 run, numerics."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from tb import scalars, texts

from lmtrain.analysis.dtypes import path_pattern
from lmtrain.callbacks import PrecisionInspector
from lmtrain.callbacks.precision import DtypeRecorder
from lmtrain.data import LMDataModule
from lmtrain.errors import LmtrainError
from lmtrain.module import LMModule


class HookCount(Callback):
    """Forward hooks on the model's modules at the start and end of each training batch."""

    def __init__(self) -> None:
        self.counts: list[tuple[int, int]] = []
        self._start = 0

    @staticmethod
    def _count(module: nn.Module) -> int:
        return sum(len(m._forward_hooks) for m in module.modules())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self._start = self._count(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.counts.append((self._start, self._count(pl_module)))


def _fit(tmp_path: Path, precision: str, inspector: PrecisionInspector,
         compile: bool = False, optimizer_in_backward: bool = False) -> tuple[pl.Trainer, HookCount]:
    pl.seed_everything(0)
    model = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                     attention="naive", warmup_steps=1, optimizer_in_backward=optimizer_in_backward)
    if compile:  # dynamo with the eager backend: compiled code's hook behaviour, no C++ compiler needed
        model.configure_model()
        model.model.compile(backend="eager")
    data = LMDataModule(source="synthetic", batch_size=2, context_length=16, vocab_size=64, train_batches=10,
                        val_batches=1)
    probe = HookCount()  # after the inspector: sees its hooks at batch start, none at batch end
    trainer = pl.Trainer(max_steps=3, precision=precision, accelerator="cpu", devices=1,
                         logger=TensorBoardLogger(str(tmp_path), name="pi"), callbacks=[inspector, probe],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, data)
    return trainer, probe


def _module(report, path: str) -> dict:  # noqa: ANN001
    return next(m for m in report.modules if m["path"] == path)


def test_bf16_mixed_on_cpu(tmp_path: Path) -> None:
    cb = PrecisionInspector(step=1)
    trainer, probe = _fit(tmp_path, "bf16-mixed", cb)
    r = cb.result
    assert r is not None and r.autocast and r.autocast_dtype == "bfloat16" and r.compute_dtype == "bfloat16"
    assert r.device_type == "cpu" and r.precision == "bf16-mixed"
    # parameters stay fp32; linear layers compute and return bf16
    assert {p["dtype"] for p in r.parameters} == {"float32"}
    for path in ("model.blocks.0.attn.qkv", "model.blocks.1.mlp.w2", "model.lm_head"):
        assert _module(r, path)["output_dtypes"] == ["bfloat16"] and not _module(r, path)["flagged"]
    # RMSNorm returns fp32 here (its input is the fp32 residual stream): flagged, with the reason
    for path in ("model.blocks.0.attn_norm", "model.blocks.1.mlp_norm", "model.final_norm"):
        m = _module(r, path)
        assert m["output_dtypes"] == ["float32"] and m["flagged"]
        assert "RMSNorm computes in fp32 by design (lmtrain.model.RMSNorm)" in m["reason"]
        assert "widened from `model.embedding`" in m["reason"]
    emb = _module(r, "model.embedding")
    assert emb["flagged"] and "parameters are float32 under mixed precision" in emb["reason"]
    block = _module(r, "model.blocks.0")
    assert block["flagged"] and "keeps its input's dtype" in block["reason"]
    assert r.logits_module == "model" and r.logits_dtype == "bfloat16"
    assert r.loss_dtype == "float32"
    assert {g["dtype"] for g in r.grads} == {"float32"} and len(r.grads) == len(r.parameters)
    states = {(s["key"], s["dtype"]) for s in r.optimizer_state}
    assert states == {("exp_avg", "float32"), ("exp_avg_sq", "float32"), ("step", "float32")}
    # numerics against the fp32 forward: small but not zero under bf16, logged and finite
    assert 0 < r.numerics["logits_max_abs_err"] < 0.1 and 0 < r.numerics["logits_rel_err"] < 0.05
    logged = scalars(trainer.log_dir)
    for tag in ("precision/logits_max_abs_err", "precision/logits_rel_err", "precision/loss_abs_err",
                "precision/flagged_modules"):
        assert len(logged[tag]) == 1 and math.isfinite(logged[tag][0][1])
    assert logged["precision/flagged_modules"][0][1] == len(r.flagged)
    ours = [tag for tag in logged if tag.startswith("precision/")]
    assert all(f"``{tag}``" in PrecisionInspector.__doc__ for tag in ours)  # every logged tag is documented
    assert logged["precision/loss_abs_err"][0][1] < 0.05
    report = texts(trainer.log_dir)["precision/report"][0]
    assert "`model.blocks.{i}.attn_norm`" in report and "⚑" in report and "exp_avg_sq" in report
    data = json.loads((Path(trainer.log_dir) / "precision_step1.json").read_text())
    assert len(data["modules"]) == len(r.modules) and data["logits_dtype"] == "bfloat16"
    # hooks only during the inspected batch (1), and removed before its end
    assert [c[0] > 0 for c in probe.counts] == [False, True, False]
    assert all(end == 0 for _, end in probe.counts)
    assert cb.hooks_installed == 0


def test_fp32_everything_fp32(tmp_path: Path) -> None:
    cb = PrecisionInspector(step=0)
    trainer, _ = _fit(tmp_path, "32-true", cb)
    r = cb.result
    assert not r.autocast and r.compute_dtype == "float32"
    assert {d for m in r.modules for d in m["output_dtypes"]} == {"float32"}
    assert r.flagged == []
    assert r.logits_dtype == "float32" and r.loss_dtype == "float32"
    assert {g["dtype"] for g in r.grads} == {"float32"}
    assert {s["dtype"] for s in r.optimizer_state} == {"float32"}
    assert r.numerics["logits_max_abs_err"] == 0.0 and r.numerics["loss_abs_err"] == 0.0
    assert scalars(trainer.log_dir)["precision/flagged_modules"][0][1] == 0.0
    # validate after the fit runs setup/teardown("validate"): the fit's result stays
    trainer.validate(trainer.lightning_module, datamodule=trainer.datamodule, verbose=False)
    assert cb.result is r


def test_a_compiled_model_is_recorded_at_a_step_after_the_first(tmp_path: Path) -> None:
    # Steps 0 and 1 run the compiled code without hooks; dynamo does not guard on module hooks, so without the
    # eager stance the hooks added at step 2 would record nothing.
    cb = PrecisionInspector(step=2)
    trainer, _ = _fit(tmp_path, "32-true", cb, compile=True)
    r = cb.result
    assert trainer.lightning_module.model._compiled_call_impl is not None
    assert _module(r, "model.blocks.1.mlp.w2")["output_dtypes"] == ["float32"] and r.logits_dtype == "float32"
    assert r.numerics["logits_max_abs_err"] == 0.0  # the reference forward of the same (eager) step
    assert any("force_eager" in note for note in r.notes)
    assert "force_eager" in texts(trainer.log_dir)["precision/report"][0]
    assert torch._dynamo.eval_frame._stance.stance == "default"  # the stance ends with the step


def test_the_recorder_as_a_context_manager_sees_a_compiled_model_after_its_first_call() -> None:
    from lmtrain.config import ModelConfig
    from lmtrain.model import TransformerLM

    cfg = ModelConfig.from_size("tiny", vocab_size=64, context_length=16, d_model=32, num_layers=1, num_heads=2,
                                d_ff=64, attention="naive")
    model = TransformerLM(cfg)
    model.compile(backend="eager")
    tokens = torch.randint(0, 64, (2, 16))
    model(tokens)  # compiled without hooks: later submodule hooks are not guarded on
    with DtypeRecorder(model, "cpu") as rec:
        model(tokens)
    assert {"blocks.0.attn.qkv", "blocks.0.mlp.w2", "lm_head"} <= set(rec.calls)
    assert torch._dynamo.eval_frame._stance.stance == "default"


def test_step_not_reached_and_bad_step(tmp_path: Path) -> None:
    cb = PrecisionInspector(step=50)
    with pytest.warns(UserWarning, match="lies beyond the last step of max_steps"):
        _fit(tmp_path, "32-true", cb)
    assert cb.result is None and cb.hooks_installed == 0
    with pytest.raises(LmtrainError, match="PrecisionInspector.step"):
        _fit(tmp_path, "32-true", PrecisionInspector(step=-1))


class RaiseInForward(Callback):
    """Makes the forward of the last block raise in training batch 1, after the inspector's hooks went in."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if batch_idx == 1:
            def boom(module, args):  # noqa: ANN001, ANN202
                raise RuntimeError("boom")

            pl_module.model.blocks[-1].register_forward_pre_hook(boom)


def test_hooks_removed_when_the_inspected_step_raises(tmp_path: Path) -> None:
    cb = PrecisionInspector(step=1)
    pl.seed_everything(0)
    model = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                     warmup_steps=1)
    data = LMDataModule(source="synthetic", batch_size=2, context_length=16, vocab_size=64, train_batches=10)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, callbacks=[cb, RaiseInForward()],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(model, data)
    assert cb.hooks_installed == 0 and cb.result is None
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0
    assert torch._dynamo.eval_frame._stance.stance == "default"  # the inspected step's eager stance ended too


def test_recorder_reasons_for_autocast_fp32_ops() -> None:
    """A LayerNorm that autocast widens is explained as autocast's fp32 list (checked with a stand-in module)."""

    class Widen(nn.LayerNorm):  # behaves like CUDA autocast's layer_norm: fp32 out of a bf16 input
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x.float())

    Widen.__name__ = "LayerNorm"
    model = nn.Sequential(nn.Linear(4, 4, bias=False), Widen(4))
    with DtypeRecorder(model, "cpu") as rec, torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 4))
    entries = {e["path"]: e for e in rec.module_entries(torch.bfloat16)}
    assert entries["1"]["flagged"] and "layer_norm is on autocast's fp32 list" in entries["1"]["reason"]
    assert not entries["0"]["flagged"]
    assert rec.installed == 0  # the context manager removed the hooks


def test_path_pattern() -> None:
    assert path_pattern("model.blocks.12.attn.qkv.weight") == "model.blocks.{i}.attn.qkv.weight"
    assert path_pattern("0.weight") == "{i}.weight"
    assert path_pattern("lm_head") == "lm_head"


def test_master_weights_say_at_setup_that_there_is_no_fp32_reference(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """With ``model.master_weights`` the step computes with bf16 copies: the inspector says so once, at setup."""
    model = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64,
                     attention="naive", master_weights=True)
    trainer = pl.Trainer(max_steps=1, precision="bf16-mixed", accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path))
    notes = []
    for inspector, master_weights in ((PrecisionInspector(), True), (PrecisionInspector(), False),
                                      (PrecisionInspector(reference=False), True)):
        model.config = model.config.replace(master_weights=master_weights)
        caplog.clear()
        with caplog.at_level("INFO"):
            inspector.setup(trainer, model, "fit")
        notes.append([r.getMessage() for r in caplog.records if "no fp32 reference" in r.getMessage()])
    assert len(notes[0]) == 1 and notes[0][0].startswith("PrecisionInspector: no fp32 reference with "
                                                         "model.master_weights")
    assert notes[1] == [] and notes[2] == []  # no master weights, or no reference asked for: nothing to say


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_gradients_freed_by_the_in_backward_optimizer_are_still_recorded(
        tmp_path: Path, precision: str, caplog: pytest.LogCaptureFixture) -> None:
    """With ``model.optimizer_in_backward`` every .grad is gone after backward: each gradient's dtype is read
    before its update frees it, the same as without the option; setup says once what differs; no hook is left."""
    seen = {}
    for in_backward in (False, True):
        inspector = PrecisionInspector(step=1)
        with caplog.at_level("INFO"):
            caplog.clear()
            _fit(tmp_path / str(in_backward), precision, inspector, optimizer_in_backward=in_backward)
        said = [r.getMessage() for r in caplog.records if "optimizer_in_backward" in r.getMessage()]
        assert len(said) == (1 if in_backward else 0)
        seen[in_backward] = inspector.result.grads
        assert getattr(inspector, "_grad_hook", None) is None
    assert seen[True] == seen[False]
    assert {e["dtype"] for e in seen[True]} == {"float32"} and len(seen[True]) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("overlap", [False, True])
def test_gradients_of_the_in_backward_optimizer_on_a_gpu(tmp_path: Path, overlap: bool) -> None:
    """On a GPU, with the updates on the compute stream or on a side stream (``optimizer_overlap``), every
    gradient's dtype is read before its update frees it (bf16-mixed: fp32 gradients of fp32 weights)."""
    pl.seed_everything(0)
    model = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                     warmup_steps=1, optimizer_in_backward=True, optimizer_overlap=overlap)
    data = LMDataModule(source="synthetic", batch_size=2, context_length=16, vocab_size=64, train_batches=10,
                        val_batches=1)
    inspector = PrecisionInspector(step=1)
    trainer = pl.Trainer(max_steps=3, precision="bf16-mixed", accelerator="gpu", devices=1, logger=False,
                         callbacks=[inspector], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, data)
    assert inspector.result.grads and {e["dtype"] for e in inspector.result.grads} == {"float32"}
