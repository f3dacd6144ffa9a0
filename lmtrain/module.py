"""LMModule: the LightningModule that trains a TransformerLM with AdamW, warmup and cosine decay."""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.utilities import rank_zero_warn

from lmtrain.attention import needs_gpu
from lmtrain.config import SIZES, ModelConfig
from lmtrain.errors import LmtrainError
from lmtrain.flops import STEP_MODES, flops_per_step
from lmtrain.kernels import triton_interpreted
from lmtrain.model import TransformerLM

StepMode = Literal["train", "forward", "forward_backward"]
#: ModelConfig fields that fix the weights (their shapes or what they compute). A checkpoint must agree on
#: all of them; context_length, attention, activation_checkpointing and compile may change between runs.
ARCHITECTURE_FIELDS: tuple[str, ...] = ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "rope_theta")


class LMModule(pl.LightningModule):
    """A GPT-style LM (``lmtrain.model.TransformerLM``) trained with AdamW.

    The model is built in ``configure_model``, inside the trainer's device and precision context, so a
    2.7B model is created directly on the GPU (and in bf16 under ``bf16-true``). Outside a trainer,
    call ``configure_model()`` yourself.

    Args:
        size: named size (``tiny``, ``small``, ``medium``, ``large``, ``xl``, ``2.7B``) giving d_model,
            d_ff, num_layers and num_heads; each of those four can be overridden below.
        vocab_size: token ids in [0, vocab_size).
        context_length: longest sequence (tokens per training window).
        d_model: residual width (None: from ``size``).
        num_layers: transformer blocks (None: from ``size``).
        num_heads: attention heads (None: from ``size``).
        d_ff: SwiGLU inner width (None: from ``size``).
        rope_theta: RoPE base.
        attention: attention backend: ``naive``, ``sdpa``, ``flash_pytorch`` or ``flash_triton``.
        activation_checkpointing: recompute each block in the backward pass to save memory.
        lr: peak learning rate, reached after ``warmup_steps``.
        min_lr_ratio: the cosine schedule decays to ``lr * min_lr_ratio``.
        warmup_steps: linear warmup from 0 to ``lr``.
        decay_steps: end of the cosine decay (None: the trainer's total number of steps).
        weight_decay: AdamW decoupled weight decay, applied to matrices only (not to norm gains).
        betas: AdamW betas.
        eps: AdamW epsilon.
        fused_adamw: use the fused CUDA AdamW kernel when the parameters are on a GPU.
        compile: compile the model with ``torch.compile``, in place (``nn.Module.compile``: checkpoint keys
            stay those of the eager model).
        step_mode: ``train`` (forward, backward, AdamW step), ``forward_backward`` (no optimizer
            step) or ``forward`` (no gradients at all), for benchmarks that time part of a step with
            the same loop.
    """

    def __init__(
        self,
        size: str = "small",
        vocab_size: int = 10_000,
        context_length: int = 512,
        d_model: int | None = None,
        num_layers: int | None = None,
        num_heads: int | None = None,
        d_ff: int | None = None,
        rope_theta: float = 10_000.0,
        attention: str = "sdpa",
        activation_checkpointing: bool = False,
        lr: float = 3e-4,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 100,
        decay_steps: int | None = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        fused_adamw: bool = True,
        compile: bool = False,
        step_mode: StepMode = "train",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = ModelConfig.from_size(
            size, vocab_size=vocab_size, context_length=context_length, d_model=d_model, num_layers=num_layers,
            num_heads=num_heads, d_ff=d_ff, rope_theta=rope_theta, attention=attention,
            activation_checkpointing=activation_checkpointing,
        )
        if step_mode not in STEP_MODES:
            raise LmtrainError("model.step_mode", f"unknown step mode {step_mode!r}.", f"use one of {STEP_MODES}.")
        if lr <= 0 or not 0 <= min_lr_ratio <= 1 or warmup_steps < 0:
            raise LmtrainError("model.lr", f"bad schedule lr={lr}, min_lr_ratio={min_lr_ratio}, "
                               f"warmup_steps={warmup_steps}.",
                               "use lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0.")
        # Checked here, not in configure_model: the trainer has written its log folder by then.
        if needs_gpu(self.config.attention) and not torch.cuda.is_available() and not triton_interpreted():
            raise LmtrainError("model.attention", f"backend {self.config.attention!r} runs Triton kernels and "
                               "needs a CUDA GPU, and none is visible.",
                               "use model.attention: sdpa (or naive / flash_pytorch) on this machine.")
        self.step_mode = step_mode
        # Forward-only and forward+backward steps must not step the optimizer: optimise by hand.
        self.automatic_optimization = step_mode == "train"
        self.model: TransformerLM | torch.nn.Module | None = None
        self.val_loss = torchmetrics.MeanMetric()
        self._tokens_per_batch: tuple[int, int] | None = None
        # Progress-bar loss on a CUDA device: (host copy, event) in flight, and the newest copy known complete.
        self._bar_copy: tuple[torch.Tensor, torch.cuda.Event] | None = None
        self._bar_loss: torch.Tensor | None = None
        self._batches_without_step = 0
        # Whether the weights came from training or a checkpoint; validate/test warn when neither.
        self._weights_known = False
        self.register_load_state_dict_post_hook(LMModule._mark_weights_loaded)

    # -- model --------------------------------------------------------------------------------

    def configure_model(self) -> None:
        if self.model is not None:
            return
        model = TransformerLM(self.config)
        if self.hparams.compile:
            # In place (nn.Module.compile): the module stays a TransformerLM and its state_dict keys stay
            # those of the eager model, so checkpoints load with or without compile.
            model.compile()
        self.model = model

    @property
    def flops_per_batch(self) -> float | None:
        """Model FLOPs of one step on the last batch seen (``lmtrain.flops``); None before the first."""
        if self._tokens_per_batch is None:
            return None
        return flops_per_step(self.config, *self._tokens_per_batch, mode=self.step_mode)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (fp32) of a batch of windows (B, T + 1)."""
        inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T) each
        self._tokens_per_batch = tuple(inputs.shape)
        logits = self.model(inputs)  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    # -- steps --------------------------------------------------------------------------------

    def _log_train_loss(self, loss: torch.Tensor) -> None:
        """``train/loss`` for the logger; ``loss`` for the progress bar without a host-device synchronisation.

        Lightning keeps logged tensors on the device and reads them (one synchronisation) only on logging
        steps (``trainer.log_every_n_steps``). A progress-bar value, by contrast, is turned into a Python
        number every step: a CUDA tensor there makes the host wait for the GPU each step, the GPU's queue
        runs dry, and the next step's first kernels wait for the host (on an H100, 2.7B bf16: +2-5% per
        step, and every callback's host work showing up one-for-one in the step time). So on a CUDA device
        the bar gets a host copy of the loss: each step starts an asynchronous copy into pinned memory and
        the bar shows the newest copy that has completed (usually the previous step's loss). No bar, no
        copy.
        """
        self.log("train/loss", loss)
        trainer = self._trainer
        if trainer is None or getattr(trainer, "progress_bar_callback", None) is None:
            return
        if loss.device.type != "cuda":
            self.log("loss", loss, prog_bar=True, logger=False)
            return
        if self._bar_copy is not None and self._bar_copy[1].query():
            self._bar_loss, self._bar_copy = self._bar_copy[0], None
        if self._bar_copy is None:
            host = torch.empty((), dtype=loss.dtype, pin_memory=True)
            host.copy_(loss.detach(), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._bar_copy = (host, event)
        if self._bar_loss is not None:
            self.log("loss", self._bar_loss, prog_bar=True, logger=False)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        if self.step_mode == "forward":
            with torch.no_grad():
                loss = self.loss(batch)
            self._log_train_loss(loss)
            return None
        loss = self.loss(batch)
        self._log_train_loss(loss)
        if self.automatic_optimization:
            # The rate this step's update uses. A CPU tensor: logging it costs no host-device copy.
            self.log("train/lr", torch.tensor(self.trainer.optimizers[0].param_groups[0]["lr"]))
        if self.step_mode == "forward_backward":
            self.manual_backward(loss)
            for p in self.parameters():
                p.grad = None
            return loss.detach()
        return loss

    def on_train_batch_end(self, outputs: Any, batch: torch.Tensor, batch_idx: int) -> None:
        self._weights_known = True
        # Without optimizer steps Lightning's global_step stays 0 and trainer.max_steps would never end a
        # forward or forward_backward run: count the batches instead.
        if self.automatic_optimization:
            return
        self._batches_without_step += 1
        max_steps = self.trainer.max_steps
        if max_steps is not None and max_steps >= 0 and self._batches_without_step >= max_steps:
            self.trainer.should_stop = True

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # Free the gradients as soon as the step has used them. Lightning zeroes them only inside the next
        # step's closure, after its forward pass, so the forward would otherwise hold a full set of stale
        # gradients at the activation peak (12.7 GiB more for the 2.7B model than a plain loop).
        optimizer.zero_grad(set_to_none=True)

    def on_fit_start(self) -> None:
        # A trainer.validate() before fit leaves the metric's state as inference tensors (validate runs
        # under torch.inference_mode); fit validates under no_grad, where updating them in place fails.
        # reset() outside inference mode replaces them with normal tensors.
        self.val_loss.reset()

    def on_validation_start(self) -> None:
        self._warn_if_untrained("validate")

    def on_test_start(self) -> None:
        self._warn_if_untrained("test")

    def _warn_if_untrained(self, stage: str) -> None:
        """One warning when validate/test would measure freshly initialised weights."""
        trainer = self._trainer
        if trainer is None or trainer.state.fn != stage or self._weights_known or trainer.ckpt_path is not None:
            return
        rank_zero_warn(f"{stage} is measuring untrained weights: no checkpoint was given and this model has not "
                       f"been trained. Pass --ckpt_path last (the newest run's last.ckpt) or a checkpoint file "
                       f"(in Python: trainer.{stage}(model, data, ckpt_path=...)).")

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.val_loss.update(self.loss(batch))

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.log_dict({"val/loss": loss, "val/perplexity": torch.exp(loss)}, prog_bar=True)
        self.val_loss.reset()

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.val_loss.update(self.loss(batch))

    def on_test_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.log_dict({"test/loss": loss, "test/perplexity": torch.exp(loss)})
        self.val_loss.reset()

    # -- checkpoints --------------------------------------------------------------------------

    @staticmethod
    def _mark_weights_loaded(module: torch.nn.Module, incompatible_keys: Any) -> None:
        module._weights_known = True

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint of another architecture with one line, before its weights are loaded.

        Raises:
            LmtrainError: the checkpoint's model differs in a field of ``ARCHITECTURE_FIELDS`` (the error
                names each field with both values and says how to request the checkpoint's model).
        """
        check_architecture(checkpoint.get("hyper_parameters") or {}, dict(self.hparams), self.config)
        if self.model is not None and "state_dict" in checkpoint:
            # LMModule.load_from_checkpoint(path, **overrides) writes the overrides into the checkpoint's
            # hyperparameters before this hook runs, so compare the weights' shapes too.
            check_shapes(checkpoint["state_dict"], self.state_dict())
        self._weights_known = True

    # -- optimizer ----------------------------------------------------------------------------

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        on_cuda = all(p.is_cuda for p in self.parameters())  # fused AdamW is CUDA-only; CPU uses foreach
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps, fused=bool(hp.fused_adamw and on_cuda),
        )
        total = hp.decay_steps or self._total_steps()
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, hp.warmup_steps, int(total), hp.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def _total_steps(self) -> int:
        """The trainer's total optimizer steps; without a finite bound, the schedule ends after warmup."""
        if self._trainer is None:
            return max(1, self.hparams.warmup_steps)
        total = self.trainer.estimated_stepping_batches
        return int(total) if math.isfinite(total) else max(1, self.hparams.warmup_steps)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate: linear warmup, then cosine decay to ``min_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= total_steps:
        return min_ratio
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def check_architecture(saved: dict[str, Any], requested: dict[str, Any], config: ModelConfig) -> None:
    """Compare a checkpoint's hyperparameters with the requested model's resolved configuration.

    Args:
        saved: the checkpoint's ``hyper_parameters`` (an LMModule's ``__init__`` arguments).
        requested: the requested module's hyperparameters.
        config: the requested module's resolved ``ModelConfig``.

    Raises:
        LmtrainError: a field of ``ARCHITECTURE_FIELDS`` differs.
    """
    if saved.get("size") not in SIZES:
        return  # not an LMModule checkpoint's hyperparameters: Lightning's state-dict check still applies
    overrides = {k: saved.get(k) for k in ARCHITECTURE_FIELDS + ("context_length",) if k in saved}
    theirs = ModelConfig.from_size(saved["size"], **overrides)
    differing = [k for k in ARCHITECTURE_FIELDS if getattr(theirs, k) != getattr(config, k)]
    if not differing:
        return
    problem = "the checkpoint holds another model: " + ", ".join(
        f"{k} {getattr(theirs, k)} in the checkpoint, {getattr(config, k)} requested" for k in differing) + "."
    # The fix names the checkpoint's own options (size first: it sets four fields at once).
    options = [k for k in ("size",) + ARCHITECTURE_FIELDS if saved.get(k) != requested.get(k)]
    values = {k: saved["size"] if k == "size" else getattr(theirs, k) for k in options}  # resolved, never null
    fix = ("request the checkpoint's model (" + " ".join(f"--model.{k} {v}" for k, v in values.items())
           + "), or start a new run without --ckpt_path.")
    raise LmtrainError(", ".join(f"model.{k}" for k in differing), problem, fix)


def check_shapes(saved: dict[str, torch.Tensor], requested: dict[str, torch.Tensor]) -> None:
    """Compare a checkpoint's weight shapes with the requested model's.

    Raises:
        LmtrainError: a weight is missing on either side or has another shape.
    """
    differing = [k for k in saved.keys() | requested.keys()
                 if k not in saved or k not in requested or tuple(saved[k].shape) != tuple(requested[k].shape)]
    if not differing:
        return
    first = sorted(differing)[0]
    shapes = [tuple(d[first].shape) if first in d else "absent" for d in (saved, requested)]
    raise LmtrainError("model", f"the checkpoint holds another model: {len(differing)} weights differ, e.g. {first} "
                       f"{shapes[0]} in the checkpoint, {shapes[1]} requested.",
                       "build the model with the checkpoint's own hyperparameters (no overrides of size, "
                       "vocab_size, d_model, num_layers, num_heads or d_ff).")

