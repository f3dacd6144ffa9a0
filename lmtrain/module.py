"""LMModule: the LightningModule that trains a TransformerLM with AdamW, warmup and cosine decay."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.utilities import rank_zero_warn

from lmtrain.attention import needs_gpu
from lmtrain.config import COMPILE_MODES, DEFAULT_SIZE, SIZES, CheckpointingPolicy, ModelConfig, compile_kwargs
from lmtrain.errors import LmtrainError
from lmtrain.flops import STEP_MODES, flops_per_step
from lmtrain.graphs import GraphedOptimizer, WholeStepGraph, eager_requested, lr_as_tensors
from lmtrain.kernels import triton_interpreted
from lmtrain.model import TransformerLM
from lmtrain.optim import OPTIMIZER_STATE_DTYPES, MasterWeightAdamW, linear_weights, weight_decay_groups

StepMode = Literal["train", "forward", "forward_backward"]
#: ModelConfig fields that fix the weights (their shapes or what they compute). A checkpoint must agree on
#: all of them; context_length, attention, activation_checkpointing, compile and compile_mode may change between runs.
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
        num_heads: attention heads; must divide d_model into an even head dimension (None: from ``size``).
        d_ff: SwiGLU inner width (None: from ``size``).
        rope_theta: RoPE base frequency.
        attention: attention backend, a name registered in ``lmtrain.attention``: naive (materialised scores),
            sdpa (PyTorch's fused kernels), flash_pytorch (tiled reference), flash_triton (Triton kernels, GPU).
        activation_checkpointing: what each block keeps for the backward pass: ``none``, ``full`` (recompute the
            block), ``selective`` (keep matrix-product and attention outputs, recompute the elementwise work) or
            ``offload`` (``full`` with the block input in pinned host memory); ``true``/``false`` mean
            ``full``/``none``. See ``ModelConfig`` and ``docs/long_context.md``.
        norm_eps: epsilon added inside RMSNorm's square root.
        checkpoint_layers: how many blocks, from the first, ``activation_checkpointing`` applies to; the last
            blocks keep everything (None: every block). See ``ModelConfig``.
        checkpoint_rest: what the blocks past ``checkpoint_layers`` keep: ``none`` or ``selective``.
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
        compile_mode: ``torch.compile``'s mode with ``compile``: ``default``, or ``max-autotune-no-cudagraphs``
            (inductor benchmarks Triton matrix-product templates against cuBLAS for each shape and keeps the
            fastest; the first steps take minutes longer). The modes that add CUDA graphs (``reduce-overhead``,
            ``max-autotune``) are refused: ``cuda_graphs`` captures the whole step, the optimizer included.
        step_mode: ``train`` (forward, backward, AdamW step), ``forward_backward`` (no optimizer
            step) or ``forward`` (no gradients at all), for benchmarks that time part of a step with
            the same loop.
        optimizer_in_backward: update each parameter with its own AdamW inside the backward pass, as soon as its
            gradient is complete, and free the gradient at once (:class:`InBackwardAdamW`): no full set of
            gradients ever exists. Same updates, schedule and weight-decay groups as the ordinary step. Refused
            (``LmtrainError``) with ``trainer.accumulate_grad_batches > 1``, ``trainer.gradient_clip_val``,
            ``trainer.precision: 16-mixed``, step modes other than ``train`` and DDP on several ranks (the update
            would come before the gradient's all-reduce). Under FSDP2 each update follows its gradient's
            reduce-scatter (FSDP2 runs the hook on the reduced shard).
        optimizer_overlap: with ``optimizer_in_backward``, run those updates on a second CUDA stream (overlapping
            the backward pass); no effect on a CPU.
        loss_chunk_tokens: output head and cross-entropy over this many tokens at a time (0: all at once), so the
            (tokens x vocabulary) logits never exist whole; same loss and gradients.
        cuda_graphs: capture the whole training step (forward, backward, optimizer update) as one CUDA graph
            after ``cuda_graph_warmup`` eager steps and replay it for every later step (``lmtrain.graphs``,
            ``docs/speed.md``): one launch per step instead of one per kernel. Needs a CUDA device, step mode
            ``train``, batches of one shape (another shape runs eagerly) and no host work inside the step: refused
            (``LmtrainError``) with gradient accumulation, ``trainer.gradient_clip_val``, ``16-mixed``, several
            devices and ``activation_checkpointing: offload``. The optimizer is AdamW with ``capturable=True`` and
            the learning rate a device tensor; checkpoints are those of an eager run. Callbacks see a replayed step
            as one phase, ``cuda graph``: ``CudaSyncTimer`` times the whole step only, and a callback that needs
            the step's module hooks (``PrecisionInspector``; ``NVTXRanges`` at depth ``block`` and deeper) gets
            an eager step in its window.
        cuda_graph_warmup: eager steps of each fit before the capture (compilation, autotuning, optimizer state).
        master_weights: keep the weights of the linear layers (blocks and output head) in bf16, the values autocast
            would cast them to, with their fp32 master copies in the optimizer (``lmtrain.optim.MasterWeightAdamW``):
            the forward pass casts no weight, gradients stay bf16 (the values the fp32 gradients would hold), and
            a fused kernel (eight weights per launch) updates master and moments and writes the bf16 weight. The
            same arithmetic as ``bf16-mixed`` with fp32 weights, with 12 fewer bytes of memory traffic per parameter
            and step. Needs ``trainer.precision: bf16-mixed``; refused with gradient accumulation (it would sum in
            bf16), gradient clipping, ``optimizer_in_backward``, FSDP2 and several ranks. The model's own weights
            in a checkpoint are then bf16; the fp32 masters are in the optimizer state (a resumed fit continues
            exactly).
        optimizer_state_dtype: the optimizer state of those bf16 weights under ``master_weights``: ``float32``
            (default: fp32 masters and moments; the update is AdamW's) or ``bfloat16``, the compact state: each
            fp32 master stored split into the bf16 weight and its low 16 bits (exact), the moments in bf16, rounded
            stochastically so that they stay unbiased. 10 fewer bytes of memory traffic per parameter and step
            (18 instead of 28) and 6 fewer bytes of memory per parameter, at the cost of a small random
            perturbation of each moment (``docs/speed.md``). The embedding and norm gains keep an fp32 state.
            Needs ``master_weights: true``.
    """

    #: How ``cuda_graphs`` captures and replays a step (``lmtrain.graphs``); tests put the CPU stand-in here.
    graph_class: type[WholeStepGraph] = WholeStepGraph

    def __init__(
        self,
        size: str = DEFAULT_SIZE,
        vocab_size: int = ModelConfig.vocab_size,
        context_length: int = ModelConfig.context_length,
        d_model: int | None = None,
        num_layers: int | None = None,
        num_heads: int | None = None,
        d_ff: int | None = None,
        rope_theta: float = ModelConfig.rope_theta,
        attention: str = ModelConfig.attention,
        activation_checkpointing: CheckpointingPolicy | bool = ModelConfig.activation_checkpointing,
        norm_eps: float = ModelConfig.norm_eps,
        checkpoint_layers: int | None = ModelConfig.checkpoint_layers,
        checkpoint_rest: str = ModelConfig.checkpoint_rest,
        lr: float = 3e-4,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 100,
        decay_steps: int | None = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        fused_adamw: bool = True,
        compile: bool = False,
        compile_mode: str = "default",
        step_mode: StepMode = "train",
        optimizer_in_backward: bool = ModelConfig.optimizer_in_backward,
        optimizer_overlap: bool = ModelConfig.optimizer_overlap,
        loss_chunk_tokens: int = ModelConfig.loss_chunk_tokens,
        cuda_graphs: bool = False,
        cuda_graph_warmup: int = 3,
        master_weights: bool = False,
        optimizer_state_dtype: str = "float32",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # The model's fields (and their defaults) are ModelConfig's: one source for both.
        self.config = ModelConfig.from_module_kwargs(self.hparams)
        if step_mode not in STEP_MODES:
            raise LmtrainError("model.step_mode", f"unknown step mode {step_mode!r}.", f"use one of {STEP_MODES}.")
        if self.config.optimizer_in_backward and step_mode != "train":
            raise LmtrainError("model.optimizer_in_backward", f"updates parameters inside the backward pass, but "
                               f"step_mode={step_mode!r} takes no optimizer step.",
                               "set model.optimizer_in_backward: false for forward or forward_backward timing.")
        if lr <= 0 or not 0 <= min_lr_ratio <= 1 or warmup_steps < 0:
            raise LmtrainError("model.lr", f"bad schedule lr={lr}, min_lr_ratio={min_lr_ratio}, "
                               f"warmup_steps={warmup_steps}.",
                               "use lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0.")
        # Checked here, not in configure_model: the trainer has written its log folder by then.
        if needs_gpu(self.config.attention) and not torch.cuda.is_available() and not triton_interpreted():
            raise LmtrainError("model.attention", f"backend {self.config.attention!r} runs Triton kernels and "
                               "needs a CUDA GPU, and none is visible.",
                               "use model.attention: sdpa (or naive / flash_pytorch) on this machine.")
        check_compile_mode(compile_mode, compile)
        if cuda_graphs and step_mode != "train":
            raise LmtrainError("model.cuda_graphs", f"captures a whole training step, but step_mode={step_mode!r}.",
                               "use step_mode: train with cuda_graphs, or set cuda_graphs: false.")
        if isinstance(cuda_graph_warmup, bool) or not isinstance(cuda_graph_warmup, int) or cuda_graph_warmup < 1:
            raise LmtrainError("model.cuda_graph_warmup", f"must be a whole number >= 1, got {cuda_graph_warmup!r}.",
                               "use 3 (compilation, autotuning and the optimizer state need eager steps first).")
        # master_weights and optimizer_state_dtype are ModelConfig fields too: checked there (self.config).
        self.step_mode = step_mode
        self.cuda_graphs = bool(cuda_graphs)
        # Forward-only and forward+backward steps must not step the optimizer, and a graphed step runs the whole
        # step itself: optimise by hand.
        self.automatic_optimization = step_mode == "train" and not self.cuda_graphs
        self.model: TransformerLM | torch.nn.Module | None = None
        self.val_loss = torchmetrics.MeanMetric()
        self._tokens_per_batch: tuple[int, int] | None = None
        # Progress-bar loss on a CUDA device: (host copy, event) in flight, and the newest copy known complete.
        self._bar_copy: tuple[torch.Tensor, torch.cuda.Event] | None = None
        self._bar_loss: torch.Tensor | None = None
        self._batches_without_step = 0
        self._in_backward: InBackwardAdamW | None = None
        # CUDA graph of the whole step (cuda_graphs): eager steps run since the last capture reset, the step
        # index of the capture.
        self._graph: WholeStepGraph | None = None
        self._eager_steps = 0
        self._capture_step: int | None = None
        # Whether the weights came from training or a checkpoint; validate/test warn when neither.
        self._weights_known = False
        self.register_load_state_dict_post_hook(LMModule._mark_weights_loaded)

    # -- model --------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """Build the model; under ``ModelParallelStrategy`` (a device mesh is set), shard it with FSDP2."""
        if self.model is not None:
            return
        if self.device_mesh is not None:
            self.model = _build_sharded_model(self)
            return
        model = TransformerLM(self.config)
        if self.hparams.compile:
            # In place (nn.Module.compile): the module stays a TransformerLM and its state_dict keys stay
            # those of the eager model, so checkpoints load with or without compile.
            model.compile(**compile_kwargs(self.hparams.compile_mode))
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
        """Mean next-token cross-entropy (fp32) of a batch of windows (B, T + 1).

        With ``loss_chunk_tokens`` set, through the model's forward with targets (``TransformerLM.forward``),
        which chunks the output head and the loss; otherwise the model returns the logits (its output is what
        ``PrecisionInspector`` reports as the logits) and the loss is taken here.
        """
        inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T) each
        self._tokens_per_batch = tuple(inputs.shape)
        if self.config.loss_chunk_tokens or self.hparams.compile:
            # Through the model's forward: chunked, or compiled together with the model (fused into its kernels).
            return self.model(inputs, targets)
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
        if self.cuda_graphs:
            return self._graphed_training_step(batch)
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

    # -- CUDA graph of the whole step (cuda_graphs) -------------------------------------------------

    def replays_graph(self, step: int) -> bool:
        """Step ``step`` of this fit runs as a CUDA graph replay (the capture step included).

        Asked by the callbacks (``lmtrain.callbacks._common.StepPhases``) at each batch start, before the step
        runs; the step itself decides the same way. False without ``cuda_graphs``, during the eager warm-up and
        for steps in which a callback asks for an eager step (``needs_eager_step``).
        """
        if not self.cuda_graphs or self._eager_steps < self.hparams.cuda_graph_warmup:
            return False
        return self._trainer is None or not eager_requested(self.trainer, step)

    def in_window(self, step: int) -> bool:
        """Under ``cuda_graphs``, step ``step`` is an eager warm-up step or the step that captured the graph.

        ``CudaSyncTimer`` keeps such steps out of its statistics (and reports them apart), so that its summary
        describes the replayed steps only.
        """
        return self.cuda_graphs and (self._capture_step is None or step <= self._capture_step)

    def _graphed_training_step(self, batch: torch.Tensor) -> torch.Tensor:
        """One training step under ``cuda_graphs``: eager (warm-up, requested, odd shape) or a graph replay."""
        optimizer = self.optimizers()
        schedule = self.lr_schedulers()
        graphed: GraphedOptimizer = optimizer.optimizer
        step = self.trainer.global_step
        self.log("train/lr", torch.tensor(self._scheduled_lr(schedule)))
        if self._graph is None:
            self._graph = self.graph_class()
        graph = self._graph
        wanted = self.replays_graph(step)
        replay = wanted and (not graph.ready or graph.matches(batch))
        if wanted and not replay:
            rank_zero_warn(f"model.cuda_graphs: a batch of shape {tuple(batch.shape)} differs from the captured "
                           f"{tuple(graph.static_batch.shape)}; such batches run eagerly.")
        if replay:
            if not graph.ready:
                self._capture(graph, graphed.inner, batch)
            self._tokens_per_batch = (batch.shape[0], batch.shape[1] - 1)
            graphed.replaying = True
            try:
                optimizer.step(closure=lambda: graph.replay(batch))
            finally:
                graphed.replaying = False
            graphed.inner.zero_grad(set_to_none=True)  # as after an eager step (a host-side no-op after a replay)
            loss = graph.static_loss.clone()  # the next replay overwrites the static output
        else:
            if isinstance(graphed.inner, InBackwardAdamW):
                loss = optimizer.step(closure=lambda: self._eager_forward_backward(batch))
            else:
                loss = self._eager_forward_backward(batch)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self._eager_steps += 1
            loss = loss.detach()
        schedule.step()
        self._log_train_loss(loss)
        return loss

    def _eager_forward_backward(self, batch: torch.Tensor) -> torch.Tensor:
        loss = self.loss(batch)
        self.manual_backward(loss)
        return loss

    def _capture(self, graph: WholeStepGraph, inner: torch.optim.Optimizer, batch: torch.Tensor) -> None:
        """Capture the whole step: forward, backward and ``inner``'s update (inside the backward pass for an
        in-backward optimizer), with autocast's weight cache off (each cast is a kernel of the graph)."""

        def forward_backward(b: torch.Tensor) -> torch.Tensor:
            loss = self.loss(b)
            loss.backward()
            return loss

        def whole_step(b: torch.Tensor) -> torch.Tensor:
            # Host work: at the capture, the backward pass then writes fresh gradient buffers (no accumulation),
            # which is what every replay does.
            inner.zero_grad(set_to_none=True)
            if isinstance(inner, InBackwardAdamW):
                return inner.step(closure=lambda: forward_backward(b))
            loss = forward_backward(b)
            inner.step()
            return loss

        def prepare(b: torch.Tensor) -> None:  # a forward and backward pass without an update
            forward_backward(b)
            inner.zero_grad(set_to_none=True)

        inner.zero_grad(set_to_none=True)
        device = batch.device.type
        context = (torch.autocast(device, dtype=torch.get_autocast_dtype(device), cache_enabled=False)
                   if torch.is_autocast_enabled(device) else contextlib.nullcontext())
        with context:
            graph.capture(whole_step, batch, prepare=prepare)
        # The graph keeps its gradient buffers in its own pool; eager steps start from no gradients.
        inner.zero_grad(set_to_none=True)
        self._capture_step = self.trainer.global_step

    def _scheduled_lr(self, schedule: Any) -> float:
        """The rate this step's update uses, from the schedule on the host (the groups' ``lr`` is a device
        tensor under ``cuda_graphs``: reading it would wait for the GPU)."""
        hp = self.hparams
        return float(hp.lr * schedule.lr_lambdas[0](schedule.last_epoch))

    def on_train_start(self) -> None:
        # A fit captures its own graph (after its own warm-up: compilation and autotuning happen per process).
        if self.cuda_graphs:
            self._graph, self._eager_steps, self._capture_step = None, 0, None

    def on_train_batch_end(self, outputs: Any, batch: torch.Tensor, batch_idx: int) -> None:
        self._weights_known = True
        # Without optimizer steps Lightning's global_step stays 0 and trainer.max_steps would never end a
        # forward or forward_backward run: count the batches instead.
        if self.step_mode == "train":
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

    def configure_callbacks(self) -> list[pl.Callback]:
        # The earliest hook of a fit, before Lightning checks the loop configuration (with cuda_graphs the module
        # optimises by hand, and Lightning's own refusal would not name the option): check the trainer here.
        if self._trainer is not None and self.trainer.state.fn == "fit":
            self.check_trainer(self.trainer)
        return []

    def check_trainer(self, trainer: pl.Trainer) -> None:
        """Refuse trainer settings this module's options cannot work with (one ``LmtrainError``, field and fix).

        Called from ``configure_callbacks`` at the start of every fit, before Lightning's own configuration checks;
        a command line can call it before ``fit`` to stop before anything is written.
        """
        if self.cuda_graphs:
            self._check_graph_trainer(trainer)
        if self.hparams.master_weights:
            self._check_master_weights_trainer(trainer)
        if not self.config.optimizer_in_backward:
            return
        field, why = "model.optimizer_in_backward", "updates each parameter as soon as its gradient exists, so"
        if trainer.accumulate_grad_batches > 1:
            raise LmtrainError(field, f"{why} gradients cannot accumulate over trainer.accumulate_grad_batches="
                               f"{trainer.accumulate_grad_batches} batches.",
                               "set trainer.accumulate_grad_batches: 1 (raise data.batch_size instead) or "
                               "model.optimizer_in_backward: false.")
        if trainer.gradient_clip_val:
            raise LmtrainError(field, f"{why} no global gradient norm exists to clip by "
                               f"(trainer.gradient_clip_val={trainer.gradient_clip_val}).",
                               "unset trainer.gradient_clip_val or set model.optimizer_in_backward: false.")
        if str(trainer.precision) == "16-mixed":
            raise LmtrainError(field, f"{why} it would update from loss-scaled fp16 gradients before the "
                               "scaler could unscale or skip them (trainer.precision=16-mixed).",
                               "use trainer.precision: bf16-mixed (no loss scaling) or "
                               "model.optimizer_in_backward: false.")
        if getattr(trainer, "world_size", 1) > 1 and strategy_kind_of(trainer) != "fsdp":
            raise LmtrainError(field, f"{why} under DDP (any strategy but FSDP2) each rank would update from its "
                               f"own gradient, before the all-reduce has averaged it over the {trainer.world_size} "
                               "ranks: the replicas would drift apart.",
                               "use FSDP2 (trainer.strategy: lightning.pytorch.strategies.ModelParallelStrategy, "
                               "which runs the update after each gradient's reduce-scatter) or "
                               "model.optimizer_in_backward: false.")

    def _check_master_weights_trainer(self, trainer: pl.Trainer) -> None:
        field, off = "model.master_weights", "or set model.master_weights: false."
        if str(trainer.precision) != "bf16-mixed":
            raise LmtrainError(field, f"stores the weights autocast's bf16 copies would hold, so it needs "
                               f"trainer.precision: bf16-mixed (this run: {trainer.precision}).",
                               "use trainer.precision: bf16-mixed " + off)
        if self.device_mesh is not None or strategy_kind_of(trainer) == "fsdp":
            # The mesh is set only once the strategy has set up; the strategy itself is known from the start.
            raise LmtrainError(field, "is not available under FSDP2 (ModelParallelStrategy), which keeps its own "
                               "master weights (MixedPrecisionPolicy).", "leave it false with this strategy.")
        if getattr(trainer, "world_size", 1) > 1:
            raise LmtrainError(field, "is for one device: its optimizer turns the linear weights bf16 in place "
                               "after DDP has wrapped the model and bucketed them as fp32, and DDP then stops at the "
                               f"first step, finding them unused (this run: {trainer.world_size} ranks).",
                               "train on one device, or use FSDP2 with bf16-mixed (bf16 compute, fp32 master "
                               "shards) " + off)
        if trainer.accumulate_grad_batches > 1:
            raise LmtrainError(field, "keeps gradients in bf16, so accumulating them over trainer."
                               f"accumulate_grad_batches={trainer.accumulate_grad_batches} batches would sum in bf16.",
                               "set trainer.accumulate_grad_batches: 1 (raise data.batch_size instead) " + off)
        if trainer.gradient_clip_val:
            raise LmtrainError(field, "keeps gradients in bf16, where the clipping norm would be computed "
                               f"(trainer.gradient_clip_val={trainer.gradient_clip_val}).",
                               "unset trainer.gradient_clip_val " + off)

    def _check_graph_trainer(self, trainer: pl.Trainer) -> None:
        field, why = "model.cuda_graphs", "replays the whole step as one graph, so"
        off = "or set model.cuda_graphs: false."
        device = trainer.strategy.root_device
        if self.graph_class.needs_cuda and device.type != "cuda":
            raise LmtrainError(field, f"needs a CUDA device; this run trains on {device.type}.",
                               "train on a GPU (trainer.accelerator: gpu) " + off)
        if getattr(trainer, "world_size", 1) > 1:
            raise LmtrainError(field, f"captures the step of one device; this run has {trainer.world_size} "
                               "devices (their gradient communication is not captured).",
                               "use trainer.devices: 1 " + off)
        if trainer.accumulate_grad_batches > 1:
            raise LmtrainError(field, f"{why} gradients cannot accumulate over trainer.accumulate_grad_batches="
                               f"{trainer.accumulate_grad_batches} batches.",
                               "set trainer.accumulate_grad_batches: 1 (raise data.batch_size instead) " + off)
        if trainer.gradient_clip_val:
            raise LmtrainError(field, f"{why} clipping by the gradient norm (trainer.gradient_clip_val="
                               f"{trainer.gradient_clip_val}) would happen after the update, outside the graph.",
                               "unset trainer.gradient_clip_val " + off)
        if str(trainer.precision) == "16-mixed":
            raise LmtrainError(field, f"{why} the loss scaler's host-side checks (trainer.precision=16-mixed) "
                               "cannot run inside it.", "use trainer.precision: bf16-mixed " + off)
        if "offload" in (self.config.activation_checkpointing, self.config.checkpoint_rest):
            raise LmtrainError(field, f"{why} it cannot copy saved tensors to freshly pinned host memory "
                               "(activation_checkpointing: offload).", "use full or selective checkpointing " + off)

    def teardown(self, stage: str) -> None:
        # The in-backward optimizer's hooks live on the parameters: remove them with the fit that made them.
        if stage == "fit" and self._in_backward is not None:
            self._in_backward.remove_hooks()
            self._in_backward = None

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
        on_cuda = all(p.is_cuda for p in self.parameters())  # fused AdamW is CUDA-only; CPU uses foreach
        groups = weight_decay_groups(self, hp.weight_decay)
        fused = bool(hp.fused_adamw and on_cuda)
        # A captured step keeps AdamW's step count on the device and reads the rate from a device tensor.
        capturable = self.cuda_graphs and on_cuda
        if self.config.optimizer_in_backward:
            if self._in_backward is not None:  # configured again: the old hooks must not update as well
                self._in_backward.remove_hooks()
            optimizer = InBackwardAdamW(groups, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps, fused=fused,
                                        overlap=self.config.optimizer_overlap, capturable=capturable)
            self._in_backward = optimizer
        elif hp.master_weights:
            # The weights autocast casts: every linear layer's (the embedding table and the norm gains stay fp32).
            optimizer = MasterWeightAdamW(groups, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps,
                                          bf16_params=linear_weights(self.model),
                                          fused=None if hp.fused_adamw else False, capturable=capturable,
                                          state_dtype=OPTIMIZER_STATE_DTYPES[hp.optimizer_state_dtype])
        else:
            optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps, fused=fused,
                                          capturable=capturable)
        if capturable:
            lr_as_tensors(optimizer, self.device)
        if self.cuda_graphs:
            optimizer = GraphedOptimizer(optimizer)
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


def strategy_kind_of(trainer: pl.Trainer) -> str:
    """``ddp``, ``fsdp`` or ``single`` for the trainer's strategy (``lmtrain.memory_plan.strategy_kind``);
    ``other`` for a strategy the memory plan does not know."""
    from lmtrain.memory_plan import strategy_kind

    try:
        return strategy_kind(trainer.strategy)
    except ValueError:
        return "other"


class InBackwardAdamW(torch.optim.Optimizer):
    """AdamW applied inside the backward pass, one parameter at a time, as each gradient is complete.

    Every parameter gets its own ``torch.optim.AdamW`` (the same hyperparameters as its group) and a
    ``register_post_accumulate_grad_hook``: when the backward pass has accumulated the parameter's gradient,
    :meth:`_apply_update` steps that AdamW and frees the gradient at once, so a step holds at most the
    gradients the backward pass is producing, never a full set. Updates happen only inside :meth:`step`,
    whose closure runs the backward pass; a backward pass outside it (a gradient check, say) leaves ``.grad``
    as usual.

    To Lightning this is the step's optimizer: its param groups carry ``lr`` and ``weight_decay`` (a
    ``LambdaLR`` schedules them, an LR monitor reads them), and each update copies its group's current ``lr``
    into the parameter's AdamW, so the schedule is the ordinary one's. ``state`` shares the per-parameter
    AdamW states (``exp_avg``, ``exp_avg_sq``, ``step``), so ``state_dict``/``load_state_dict`` save and
    restore them like ``torch.optim.AdamW``'s.

    With ``overlap`` on a CUDA device the updates run on a second stream, ordered after the gradient they
    read by an event, and the step's end makes the compute stream wait for that stream, so they overlap with
    the rest of the backward pass; elsewhere ``overlap`` changes nothing.

    Args:
        param_groups: groups as for ``torch.optim.AdamW`` (``params``, ``weight_decay``).
        lr: peak learning rate (the schedule scales the groups' ``lr``).
        betas: AdamW betas.
        eps: AdamW epsilon.
        fused: use the fused CUDA AdamW kernel per parameter.
        overlap: run the updates on a second CUDA stream.
        capturable: AdamW with ``capturable=True`` (step counts on the device), for a step captured as a CUDA
            graph; the groups' ``lr`` may then be device tensors.
    """

    def __init__(self, param_groups: list[dict[str, Any]], lr: float, betas: tuple[float, float], eps: float,
                 fused: bool = False, overlap: bool = False, capturable: bool = False) -> None:
        super().__init__(param_groups, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=0.0))
        self._fused = fused
        self._group_of: dict[torch.Tensor, dict[str, Any]] = {}
        self._adamw: dict[torch.Tensor, torch.optim.AdamW] = {}
        for group in self.param_groups:
            for p in group["params"]:
                self._group_of[p] = group
                self._adamw[p] = torch.optim.AdamW([p], lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                                   weight_decay=group["weight_decay"], fused=fused,
                                                   capturable=capturable)
        self._share_state()
        self._stepping = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._adamw]
        cuda = overlap and any(p.is_cuda for p in self._adamw)
        self._stream = torch.cuda.Stream(device=next(iter(self._adamw)).device) if cuda else None
        # Gradients the side stream reads while a CUDA graph is being captured, kept until the step's end
        # (record_stream cannot mark a tensor during a capture).
        self._held: list[torch.Tensor] = []

    def _share_state(self) -> None:
        # AdamW fills its state dict in place on the first step, so one dict object serves both optimizers.
        for p, adamw in self._adamw.items():
            adamw.state[p] = self.state[p]

    def _on_grad(self, param: torch.Tensor) -> None:
        if self._stepping:
            self._apply_update(param)

    def _apply_update(self, param: torch.Tensor) -> None:
        """One AdamW update of ``param`` from its accumulated gradient, then free the gradient.

        The one place an update happens: the in-backward hook calls it on the current stream, or, with
        ``overlap``, on the side stream after an event recorded where the gradient was produced.
        """
        adamw = self._adamw[param]
        adamw.param_groups[0]["lr"] = self._group_of[param]["lr"]
        if self._stream is None:
            adamw.step()
            param.grad = None
            return
        ready = torch.cuda.current_stream(param.device).record_event()
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            adamw.step()
        # The compute stream may reuse the gradient's memory only after the side stream has read it.
        if torch.cuda.is_current_stream_capturing():
            self._held.append(param.grad)
        else:
            param.grad.record_stream(self._stream)
        param.grad = None

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``closure`` (forward and backward pass); parameters are updated while its backward pass runs."""
        if closure is None:
            raise RuntimeError("InBackwardAdamW.step needs a closure that runs the backward pass: the updates "
                               "happen inside it.")
        self._stepping = True
        try:
            loss = closure()
        finally:
            self._stepping = False
        if self._stream is not None:
            # The next forward pass reads the updated parameters.
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
            self._held.clear()  # after the join: the side stream is done with them
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # load_state_dict replaced self.state's dicts and the param groups' dicts: the schedule now sets ``lr``
        # in the new groups, which each update must read.
        self._share_state()
        self._group_of = {p: group for group in self.param_groups for p in group["params"]}

    def remove_hooks(self) -> None:
        """Detach from the parameters (no more in-backward updates)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
def _build_sharded_model(module: LMModule) -> torch.nn.Module:
    """The model of ``module``, built on its device and sharded over ``module.device_mesh`` with FSDP2.

    ``ModelParallelStrategy`` does not place the tensors that ``configure_model`` creates (its init context
    sets no device), so the model is built on the rank's device explicitly: the same device and seed as a
    single-device or DDP run, hence the same initial weights. Activation checkpointing and compile are
    applied per block by ``lmtrain.distributed.shard_model``, so the model itself is built without its own
    checkpointing (that would checkpoint each block twice).
    """
    from lmtrain.distributed import check_fsdp_precision, shard_model

    precision = str(module.trainer.precision)
    check_fsdp_precision(precision)  # before building: a 2.7B model takes a while to initialise
    policy = module.config.activation_checkpointing
    if module.config.checkpoint_layers is not None:  # (and so checkpoint_rest)
        raise LmtrainError("model.checkpoint_layers", "is not available under FSDP2 (ModelParallelStrategy), which "
                           "checkpoints every sharded block.", "leave model.checkpoint_layers null with this strategy.")
    if policy not in ("none", "full"):
        raise LmtrainError("model.activation_checkpointing",
                           f"policy {policy!r} is not available under FSDP2 (ModelParallelStrategy); each sharded "
                           "block is checkpointed whole.",
                           "use model.activation_checkpointing: full (or none) with this strategy.")
    with torch.device(module.trainer.strategy.root_device):
        model = TransformerLM(replace(module.config, activation_checkpointing="none"))
    return shard_model(model, module.device_mesh, precision, activation_checkpointing=policy == "full",
                       compile=bool(module.hparams.compile), compile_mode=module.hparams.compile_mode)


def check_compile_mode(mode: str, compile: bool) -> None:
    """Refuse an unknown ``compile_mode``, one that adds CUDA graphs, or one given without ``compile``."""
    if mode in ("reduce-overhead", "max-autotune"):
        raise LmtrainError("model.compile_mode", f"{mode!r} adds torch.compile's own CUDA graphs of the forward and "
                           "backward passes.", "use model.cuda_graphs: true (the whole step, optimizer included, as "
                           "one graph) with model.compile_mode: default or max-autotune-no-cudagraphs.")
    if mode not in COMPILE_MODES:
        raise LmtrainError("model.compile_mode", f"unknown mode {mode!r}.", f"use one of {', '.join(COMPILE_MODES)}.")
    if mode != "default" and not compile:
        raise LmtrainError("model.compile_mode", f"{mode!r} is torch.compile's mode, but model.compile is false.",
                           "set model.compile: true, or leave model.compile_mode: default.")


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

