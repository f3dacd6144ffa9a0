"""LMModule: step modes, the learning-rate schedule, FLOPs per batch, precisions, checkpointing, compile."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from fitting import cpu_fit

from lmtrain.config import ModelConfig
from lmtrain.data import LMDataModule
from lmtrain.errors import LmtrainError
from lmtrain.flops import flops_per_step
from lmtrain.module import LMModule, lr_factor

VOCAB, CONTEXT, BATCH = 64, 16, 2


def small_module(**kwargs) -> LMModule:
    defaults = dict(size="tiny", vocab_size=VOCAB, context_length=CONTEXT, d_model=32, num_layers=2, num_heads=2,
                    d_ff=64, warmup_steps=2)
    return LMModule(**{**defaults, **kwargs})


class GradsSeen(pl.Callback):
    """Records, per batch, whether gradients existed after the backward pass and at the end of the batch."""

    def __init__(self) -> None:
        self.after_backward: list[bool] = []
        self.batch_end: list[bool] = []

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.after_backward.append(all(p.grad is not None for p in pl_module.parameters()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.batch_end.append(any(p.grad is not None for p in pl_module.parameters()))


def fit(module: LMModule, steps: int, callbacks: list[pl.Callback] | None = None, **trainer_kwargs) -> pl.Trainer:
    return cpu_fit(module, steps, batch=BATCH, context=CONTEXT, vocab=VOCAB, callbacks=callbacks, **trainer_kwargs)


def snapshot(module: LMModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same_parameters(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def built(module: LMModule) -> LMModule:
    torch.manual_seed(0)
    module.configure_model()
    return module


def test_forward_mode_computes_no_gradients_and_does_not_step() -> None:
    module = built(small_module(step_mode="forward"))
    before = snapshot(module)
    seen = GradsSeen()
    trainer = fit(module, steps=3, callbacks=[seen])
    assert seen.after_backward == []  # no backward pass at all
    assert seen.batch_end == [False] * 3  # max_steps ends the run although no optimizer step happens
    assert trainer.global_step == 0
    assert same_parameters(before, snapshot(module))


def test_forward_backward_mode_computes_then_clears_gradients() -> None:
    module = built(small_module(step_mode="forward_backward"))
    before = snapshot(module)
    seen = GradsSeen()
    fit(module, steps=3, callbacks=[seen])
    assert seen.after_backward == [True] * 3
    assert seen.batch_end == [False] * 3
    assert same_parameters(before, snapshot(module))


def test_train_mode_changes_parameters() -> None:
    module = built(small_module(step_mode="train"))
    before = snapshot(module)
    seen = GradsSeen()
    trainer = fit(module, steps=3, callbacks=[seen])
    assert trainer.global_step == 3
    assert seen.after_backward == [True] * 3
    after = snapshot(module)
    assert all(not torch.equal(before[k], after[k]) for k in before)  # every weight and gain moved
    # Gradients are freed right after each optimizer step, so no forward pass holds stale ones.
    assert seen.batch_end == [False] * 3


def test_gradient_accumulation_keeps_gradients_until_the_step() -> None:
    module = built(small_module(step_mode="train"))
    seen = GradsSeen()
    trainer = fit(module, steps=2, callbacks=[seen], accumulate_grad_batches=2)
    assert trainer.global_step == 2
    assert seen.batch_end == [True, False, True, False]  # kept between micro-batches, freed after each step


def test_lr_factor_warmup_then_cosine() -> None:
    warmup, total, floor = 4, 14, 0.1
    assert [lr_factor(s, warmup, total, floor) for s in range(warmup)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, warmup, total, floor) == 1.0
    assert lr_factor(9, warmup, total, floor) == pytest.approx(floor + (1 - floor) * 0.5)  # halfway down
    three_tenths = floor + (1 - floor) * 0.5 * (1 + math.cos(0.3 * math.pi))  # 3 of 10 decay steps done
    assert lr_factor(7, warmup, total, floor) == pytest.approx(three_tenths)
    assert lr_factor(14, warmup, total, floor) == floor
    assert lr_factor(100, warmup, total, floor) == floor
    assert lr_factor(0, 0, 10, floor) == 1.0  # no warmup: start at the peak


def test_schedule_is_applied_per_step() -> None:
    module = built(small_module(lr=1e-2, warmup_steps=2, min_lr_ratio=0.1))
    trainer = fit(module, steps=5)
    (optimizer,) = trainer.optimizers
    # decay_steps None: the cosine ends at the trainer's max_steps; the scheduler has stepped 5 times.
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * lr_factor(5, 2, 5, 0.1))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)


def test_weight_decay_only_on_matrices() -> None:
    module = built(small_module(weight_decay=0.1))
    optimizer = module.configure_optimizers()["optimizer"]
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.ndim == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.ndim == 1 for p in no_decay["params"])
    assert optimizer.defaults["fused"] is False  # CPU parameters: the fused kernel is CUDA-only


@pytest.mark.parametrize("mode", ["train", "forward", "forward_backward"])
def test_flops_per_batch_equals_flops_per_step(mode: str) -> None:
    module = built(small_module(step_mode=mode))
    assert module.flops_per_batch is None
    module.loss(torch.randint(0, VOCAB, (3, CONTEXT + 1)))
    assert module.flops_per_batch == flops_per_step(module.config, 3, CONTEXT, mode=mode)


def test_bf16_mixed_on_cpu_trains_a_step() -> None:
    module = built(small_module())
    before = snapshot(module)
    trainer = fit(module, steps=1, precision="bf16-mixed")
    assert trainer.global_step == 1
    assert all(p.dtype == torch.float32 for p in module.parameters())  # mixed: fp32 weights
    assert not same_parameters(before, snapshot(module))
    assert math.isfinite(trainer.callback_metrics["train/loss"].item())


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    batch = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1))
    grads = []
    for checkpointing in (False, True):
        module = built(small_module(activation_checkpointing=checkpointing))
        module.loss(batch).backward()
        grads.append({n: p.grad for n, p in module.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=0)


def test_compile_matches_eager() -> None:
    pytest.importorskip("torch._inductor")
    batch = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1))
    eager = built(small_module())
    compiled = built(small_module(compile=True))  # same seed: same initial weights
    assert compiled.model._compiled_call_impl is not None  # compiled in place (nn.Module.compile)
    torch.testing.assert_close(compiled.loss(batch), eager.loss(batch), rtol=1e-5, atol=1e-5)
    # The state dict is the eager model's: a checkpoint loads with or without compile.
    assert list(compiled.state_dict()) == list(eager.state_dict())
    other = built(small_module())
    other.load_state_dict(compiled.state_dict())
    torch.testing.assert_close(other.loss(batch), eager.loss(batch), rtol=1e-5, atol=1e-5)


def test_validate_then_fit_on_the_same_module() -> None:
    """validate() leaves the metric's state as inference tensors; fit's validation must still update it."""
    module = small_module()
    data = LMDataModule(batch_size=BATCH, context_length=CONTEXT, vocab_size=VOCAB, train_batches=4, val_batches=2)
    kwargs = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)
    first = pl.Trainer(**kwargs).validate(module, data, verbose=False)[0]["val/loss"]
    trainer = pl.Trainer(max_steps=4, val_check_interval=2, **kwargs)
    trainer.fit(module, data)
    after = float(trainer.callback_metrics["val/loss"])
    assert math.isfinite(first) and math.isfinite(after) and after != first


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(step_mode="backward"), "model.step_mode"),
        (dict(lr=0.0), "model.lr"),
        (dict(min_lr_ratio=1.5), "model.lr"),
        (dict(size="huge"), "model.size"),
        (dict(num_heads=5), "model.num_heads"),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(LmtrainError) as info:
        small_module(**kwargs)
    assert info.value.field == field


def test_gpu_only_backend_refused_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(LmtrainError) as info:
        small_module(attention="flash_triton")
    assert info.value.field == "model.attention" and "sdpa" in info.value.fix


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_mixed_on_cuda_uses_fused_adamw() -> None:
    module = small_module()
    trainer = pl.Trainer(accelerator="cuda", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         precision="bf16-mixed")
    data = LMDataModule(batch_size=BATCH, context_length=CONTEXT, vocab_size=VOCAB, train_batches=5, val_batches=1)
    trainer.fit(module, data)
    (optimizer,) = trainer.optimizers
    assert optimizer.defaults["fused"] is True
    assert trainer.global_step == 2
    assert math.isfinite(trainer.callback_metrics["train/loss"].item())


class LogCalls(pl.Callback):
    """Records, per batch, whether the progress bar and the logger's metrics hold the loss."""

    def __init__(self) -> None:
        self.bar: list[int] = []
        self.logged: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.bar.append(batch_idx if "loss" in trainer.progress_bar_metrics else -1)
        self.logged.append(batch_idx if "train/loss" in trainer.callback_metrics else -1)


@pytest.mark.parametrize("bar", [True, False])
def test_loss_goes_to_the_logger_and_to_the_progress_bar_only_when_shown(bar: bool,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    module = small_module()
    calls: list[tuple[str, bool]] = []
    original = LMModule.log

    def log(self, name, value, *args, **kwargs):  # noqa: ANN001, ANN202
        calls.append((name, bool(kwargs.get("prog_bar", False))))
        return original(self, name, value, *args, **kwargs)

    monkeypatch.setattr(LMModule, "log", log)
    seen = LogCalls()
    fit(module, 5, [seen], enable_progress_bar=bar)
    assert [c for c in calls if c[0] == "train/loss"] == [("train/loss", False)] * 5  # logger only, no bar
    assert [c for c in calls if c[0] == "loss"] == ([("loss", True)] * 5 if bar else [])
    assert seen.logged == list(range(5))
    assert seen.bar == (list(range(5)) if bar else [-1] * 5)


@pytest.mark.gpu
def test_progress_bar_loss_does_not_synchronise_on_cuda() -> None:
    """With the bar shown, steps run without a host-device synchronisation (sync debug mode "error")."""

    class NoSync(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            if batch_idx == 2:
                torch.cuda.set_sync_debug_mode("error")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            if batch_idx == 5:
                torch.cuda.set_sync_debug_mode("default")

    module = small_module()
    try:
        trainer = fit(module, 7, [NoSync()], accelerator="cuda", enable_progress_bar=True, log_every_n_steps=100)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    shown = trainer.progress_bar_metrics["loss"]
    assert isinstance(shown, float) and math.isfinite(shown) and shown > 0
    assert module._bar_loss is not None and module._bar_loss.device.type == "cpu"


def test_learning_rate_is_logged_every_step(tmp_path) -> None:  # noqa: ANN001
    from lightning.pytorch.loggers import TensorBoardLogger
    from tb import scalars

    module = small_module(lr=1e-2, warmup_steps=2, min_lr_ratio=0.1)
    logger = TensorBoardLogger(tmp_path, name="lmtrain", default_hp_metric=False)
    fit(module, 5, logger=logger, log_every_n_steps=1)
    logged = scalars(logger.log_dir)
    # The rate each step's update used: the schedule at steps 0..4 (cosine to max_steps=5).
    expected = [1e-2 * lr_factor(step, 2, 5, 0.1) for step in range(5)]
    assert [step for step, _ in logged["train/lr"]] == list(range(5))
    assert [value for _, value in logged["train/lr"]] == pytest.approx(expected, rel=1e-6)
    assert "hp_metric" not in logged


def test_data_module_takes_its_shapes_from_the_model(tmp_path) -> None:  # noqa: ANN001
    """A Python script needs no vocab_size/context_length on the data module (the CLI links them)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    module = small_module()
    data = LMDataModule(batch_size=BATCH, train_batches=3, val_batches=1)
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=TensorBoardLogger(tmp_path, name="lmtrain"),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)  # logging the hyperparameters used to fail: the keys were in both
    assert trainer.global_step == 2
    assert (data.vocab_size, data.context_length) == (VOCAB, CONTEXT)


def test_validate_warns_once_when_the_weights_are_untrained() -> None:
    data = LMDataModule(batch_size=BATCH, train_batches=3, val_batches=1)
    kwargs = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)
    module = small_module()
    with pytest.warns(UserWarning, match="validate is measuring untrained weights") as record:
        pl.Trainer(**kwargs).validate(module, data, verbose=False)
    assert len([w for w in record if "untrained" in str(w.message)]) == 1
    pl.Trainer(max_steps=1, **kwargs).fit(module, data)
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*untrained.*")
        pl.Trainer(**kwargs).validate(module, data, verbose=False)  # trained now: no warning
        loaded = small_module()
        loaded.configure_model()
        loaded.load_state_dict(module.state_dict())
        pl.Trainer(**kwargs).test(loaded, data, verbose=False)  # weights loaded by hand: no warning


def test_compile_mode_reaches_torch_compile_and_bad_modes_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: seen.append(kwargs))
    built(small_module(compile=True))
    built(small_module(compile=True, compile_mode="max-autotune-no-cudagraphs"))
    assert seen == [{}, {"mode": "max-autotune-no-cudagraphs"}]
    for kwargs, words in ((dict(compile=True, compile_mode="reduce-overhead"), "model.cuda_graphs: true"),
                          (dict(compile=True, compile_mode="max-autotune"), "model.cuda_graphs: true"),
                          (dict(compile=True, compile_mode="fastest"), "unknown mode 'fastest'"),
                          (dict(compile_mode="max-autotune-no-cudagraphs"), "set model.compile: true")):
        with pytest.raises(LmtrainError) as info:
            small_module(**kwargs)
        assert info.value.field == "model.compile_mode" and words in str(info.value)


def test_flash_kernels_record_names_the_served_kernels_and_settings() -> None:
    """A flash_triton fit records which kernels serve its attention shape, and with which settings."""
    from lmtrain.module import flash_kernels_record

    cfg = ModelConfig.from_size("2.7B", context_length=512, attention="flash_triton")
    record = flash_kernels_record(cfg, "sm_90", "bf16-mixed")
    (plan,) = record["plans"].values()
    assert list(record["plans"]) == ["N=512,d=80"]
    assert plan["kernels"] and all(name.startswith("_flash_") for name in plan["kernels"])
    assert record["settings"]["gluon"] == "auto" and record["device"].startswith("sm_90")
