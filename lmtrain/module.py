"""LMModule: the LightningModule that trains a TransformerLM with AdamW, warmup and cosine decay.

Its options are the fields of ``lmtrain.config.ModelConfig`` (the option schema), not parameters declared here:
``LMModule(size, **options)`` takes any field by name, and its signature and docstring are built from the schema
(:func:`schema_init`), so LightningCLI (``python -m lmtrain fit --help``, ``--model.<field>``, ``model:`` in a YAML)
shows and checks every field with its help. The in-backward optimizer is ``lmtrain.optim.InBackwardAdamW``, the
graphed step ``lmtrain.graphs.GraphedStep``, FSDP2 sharding ``lmtrain.distributed.build_sharded_model``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from lmtrain.attention import backend_info, needs_gpu
from lmtrain.blas import apply_blas_workspace, deterministic_workspace, resolve_blas_workspace
from lmtrain.checkpoints import ARCHITECTURE_FIELDS, check_architecture, check_resumed_master_weights, check_shapes
from lmtrain.config import DEFAULT_SIZE, ModelConfig, TrainerSettings, cli_parameters, compile_kwargs
from lmtrain.distributed import check_fsdp_precision, check_strategy_options
from lmtrain.errors import LmtrainError
from lmtrain.float8 import check_float8_run, convert_model
from lmtrain.flops import compute_dtype, float8_flops_per_step, flops_by_category, flops_per_step
from lmtrain.graphs import GraphedOptimizer, GraphedStep, WholeStepGraph, check_graph_run, lr_as_tensors
from lmtrain.kernels import triton_interpreted
from lmtrain.model import TransformerLM
from lmtrain.optim import (
    OPTIMIZER_STATE_DTYPES,
    InBackwardAdamW,
    MasterWeightAdamW,
    bf16_with_masters,
    check_in_backward_run,
    check_master_weights_run,
    linear_weights,
    weight_decay_groups,
)

#: Checkpoint key of the learning-rate schedule's length (``{"decay_steps": N}``), kept on resume.
SCHEDULE_KEY = "lmtrain_lr_schedule"

__all__ = ["ARCHITECTURE_FIELDS", "InBackwardAdamW", "LMModule", "lr_factor", "schema_init"]


def schema_init(config_class: type[ModelConfig]) -> Any:
    """An ``__init__(self, size, **options)`` for an ``LMModule`` class whose options are ``config_class``'s fields.

    Its ``__signature__`` lists ``size`` and every field as keyword parameters with the field's type and default,
    and its docstring's ``Args`` holds each field's help: what LightningCLI reads to build ``--model.<field>`` and
    its ``--help``. Unknown keywords raise ``TypeError`` as for any Python function.
    """
    params = cli_parameters(config_class)

    def __init__(self: LMModule, size: str = DEFAULT_SIZE, **options: Any) -> None:
        self._setup(size, options)

    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    __init__.__signature__ = inspect.Signature([self_param, *(p for p, _ in params)])  # type: ignore[attr-defined]
    args = "\n".join(f"    {p.name}: {doc}" for p, doc in params)
    __init__.__doc__ = f"Build the module from the options of ``{config_class.__name__}``.\n\nArgs:\n{args}\n"
    return __init__


class LMModule(pl.LightningModule):
    """A GPT-style LM (``lmtrain.model.TransformerLM``) trained with AdamW, warmup and cosine decay.

    The model is built in ``configure_model``, inside the trainer's device and precision context, so a
    2.7B model is created directly on the GPU (and in bf16 under ``bf16-true``). Outside a trainer,
    call ``configure_model()`` yourself. ``self.config`` is the validated ``ModelConfig`` of every option;
    ``self.hparams`` the arguments as given (``size``, and None for the widths the size sets).

    A subclass with ``config_class`` set to a ``ModelConfig`` subclass (``with_config``) takes that schema's
    options, on the command line too.
    """

    #: The option schema: the fields this module takes (``schema_init`` builds ``__init__`` from it).
    config_class: type[ModelConfig] = ModelConfig
    #: How ``cuda_graphs`` captures and replays a step (``lmtrain.graphs``); tests put the CPU stand-in here.
    graph_class: type[WholeStepGraph] = WholeStepGraph

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "config_class" in cls.__dict__ and "__init__" not in cls.__dict__:
            cls.__init__ = schema_init(cls.config_class)  # type: ignore[method-assign]

    @classmethod
    def with_config(cls, config_class: type[ModelConfig]) -> type[LMModule]:
        """A subclass whose options are ``config_class``'s fields (a schema with a group or field more)."""
        return type(f"{cls.__name__}With{config_class.__name__}", (cls,), {"config_class": config_class,
                                                                            "__module__": cls.__module__})

    def _setup(self, size: str, options: dict[str, Any]) -> None:
        pl.LightningModule.__init__(self)
        known = {p.name: p.default for p, _ in cli_parameters(self.config_class)}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {unknown[0]!r}")
        # Under LightningCLI, Lightning records the options as the command line gave them (lists stay lists, as in
        # the saved config.yaml); called from Python, the arguments as given with the defaults filled in.
        self.save_hyperparameters()
        if not self.hparams:
            self.save_hyperparameters({**known, "size": size, **options})
        # Every option checked once, by the schema (a combination that cannot work is refused there).
        self.config = self.config_class.from_module_kwargs(self.hparams)
        config = self.config
        # Checked here, not in configure_model: the trainer has written its log folder by then.
        if needs_gpu(config.attention) and not torch.cuda.is_available() and not triton_interpreted():
            raise LmtrainError("model.attention", f"backend {config.attention!r} runs Triton kernels and "
                               "needs a CUDA GPU, and none is visible.",
                               "use model.attention: sdpa (or naive / flash_pytorch) on this machine.")
        # Before any matrix product runs on a GPU: cuBLAS reads its workspace size when its first handle is made.
        note = apply_blas_workspace(config.blas_workspace, config.cuda_graphs)
        if note:
            rank_zero_warn(note)
        self.step_mode = config.step_mode
        self.cuda_graphs = config.cuda_graphs
        # Forward-only and forward+backward steps must not step the optimizer, and a graphed step runs the whole
        # step itself: optimise by hand.
        self.automatic_optimization = self.step_mode == "train" and not self.cuda_graphs
        self.model: TransformerLM | torch.nn.Module | None = None
        self.val_loss = torchmetrics.MeanMetric()
        self._tokens_per_batch: tuple[int, int] | None = None
        # Progress-bar loss on a CUDA device: (host copy, event) in flight, and the newest copy known complete.
        self._bar_copy: tuple[torch.Tensor, torch.cuda.Event] | None = None
        self._bar_loss: torch.Tensor | None = None
        self._batches_without_step = 0
        self._in_backward: InBackwardAdamW | None = None
        # Under DDP with master_weights: the fp32 masters of the linear weights made bf16 in configure_model.
        self._masters: dict[torch.Tensor, torch.Tensor] | None = None
        #: The graphed step under ``cuda_graphs`` (None without).
        self.graphed_step = GraphedStep(self.graph_class, config.cuda_graph_warmup) if self.cuda_graphs else None
        # Whether the weights came from training or a checkpoint; validate/test warn when neither.
        self._weights_known = False
        # The cosine decay's length: set by configure_optimizers; a resumed checkpoint's own length wins.
        self._decay_steps: int | None = None
        self._checkpoint_decay_steps: int | None = None
        self.register_load_state_dict_post_hook(LMModule._mark_weights_loaded)

    # -- model --------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """Build the model; under ``ModelParallelStrategy`` (a device mesh is set), shard it with FSDP2."""
        if self.model is not None:
            return
        if self.device_mesh is not None:
            from lmtrain.distributed import build_sharded_model

            self.model = build_sharded_model(self)
            return
        model = TransformerLM(self.config)
        convert_model(model, self.config)  # float8 layers (model.float8), before compile fuses their casts
        if self.config.master_weights and self._trainer is not None and strategy_kind_of(self.trainer) == "ddp":
            # DDP buckets the gradients in the parameters' dtype when it wraps the model, after this hook and before
            # the optimizer exists: the linear weights are made bf16 now, their fp32 masters kept for the optimizer.
            self._masters = bf16_with_masters(linear_weights(model))
        if self.config.compile:
            # In place (nn.Module.compile): the module stays a TransformerLM and its state_dict keys stay
            # those of the eager model, so checkpoints load with or without compile.
            model.compile(**compile_kwargs(self.config.compile_mode, self.config.compile_fullgraph))
        self.model = model

    @property
    def flops_per_batch(self) -> float | None:
        """Model FLOPs of one step on the last batch seen (``lmtrain.flops``); None before the first."""
        if self._tokens_per_batch is None:
            return None
        return flops_per_step(self.config, *self._tokens_per_batch, mode=self.step_mode)

    @property
    def flops_by_category_per_batch(self) -> dict[str, float] | None:
        """``flops_per_batch`` split by the kernel category that runs it (``lmtrain.flops.flops_by_category``:
        ``gemm`` and, with an attention backend of fused kernels, ``attention``); None before the first batch."""
        if self._tokens_per_batch is None:
            return None
        return flops_by_category(self.config, *self._tokens_per_batch, mode=self.step_mode,
                                 fused_attention=backend_info(self.config.attention).fused)

    @property
    def float8_flops_per_batch(self) -> float | None:
        """The part of ``flops_per_batch`` that runs as float8 GEMMs (``model.float8``'s converted layers); 0 without
        float8, None before the first batch."""
        if self._tokens_per_batch is None:
            return None
        if self.config.float8 == "none":
            return 0.0
        return float8_flops_per_step(self.config, *self._tokens_per_batch, mode=self.step_mode)

    def note_batch(self, batch: torch.Tensor) -> None:
        """Record the shape of a batch of windows (B, T + 1) that a step trains on (for ``flops_per_batch``)."""
        self._tokens_per_batch = (batch.shape[0], batch.shape[1] - 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (fp32) of a batch of windows (B, T + 1).

        With ``loss_chunk_tokens`` set, through the model's forward with targets (``TransformerLM.forward``),
        which chunks the output head and the loss; otherwise the model returns the logits (its output is what
        ``PrecisionInspector`` reports as the logits) and the loss is taken here.
        """
        inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T) each
        self.note_batch(batch)
        if self.config.loss_chunk_tokens or self.config.compile:
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
        if self.graphed_step is not None:
            loss = self.graphed_step.training_step(self, batch)
            self._log_train_loss(loss)
            return loss
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

    def replays_graph(self, step: int) -> bool:
        """Step ``step`` of this fit runs as a CUDA graph replay (the capture step included).

        Asked by the callbacks (``lmtrain.callbacks._common.StepPhases``) at each batch start, before the step
        runs; the step itself decides the same way. False without ``cuda_graphs``, during the eager warm-up and
        for steps in which a callback asks for an eager step (``needs_eager_step``).
        """
        return self.graphed_step is not None and self.graphed_step.replays(self._trainer, step)

    def in_window(self, step: int) -> bool:
        """Under ``cuda_graphs``, step ``step`` is an eager warm-up step, the step that captured the graphs, or the
        first launch of the second graph.

        ``CudaSyncTimer`` keeps such steps out of its statistics (and reports them apart), so that its summary
        describes the replayed steps only.
        """
        return self.graphed_step is not None and self.graphed_step.in_window(step)

    def graph_phase_marks(self) -> dict[str, Any] | None:
        """Under ``cuda_graphs``, the phase marks recorded inside the graph by the last replayed step: mark name
        (``lmtrain.analysis.timing.MARKS``) -> CUDA timing event, valid until the replay after next
        (``lmtrain.graphs.WholeStepGraph``). None without ``cuda_graphs``, before the first replay, or where
        timing events cannot be recorded inside a graph. ``CudaSyncTimer`` reads them for the replayed steps."""
        return self.graphed_step.phase_marks() if self.graphed_step is not None else None

    def on_train_start(self) -> None:
        if self.graphed_step is not None:
            self.graphed_step.reset(self.device)

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
        note = deterministic_workspace()  # the trainer has set deterministic mode by now, no product has run yet
        if note:
            rank_zero_warn(note)
        return []

    def check_trainer(self, trainer: pl.Trainer) -> None:
        """Refuse trainer settings this module's options cannot work with: :meth:`check_settings` of the trainer's
        settings (:func:`trainer_settings`).

        Called from ``configure_callbacks`` at the start of every fit, before Lightning's own configuration checks.
        """
        settings = trainer_settings(trainer)
        if self.device_mesh is not None:  # set only once the strategy has set up; the strategy is known before
            settings = replace(settings, strategy="fsdp")
        self.check_settings(self.config, settings)

    @classmethod
    def check_settings(cls, config: ModelConfig, settings: TrainerSettings, training: bool = True) -> None:
        """Refuse trainer settings that ``config``'s options cannot work with (one ``LmtrainError``, field and fix).

        The command line calls it right after parsing, with the settings the trainer will have
        (``lmtrain.cli_config.parsed_trainer_settings``), so that a refusal is its one line before Lightning prints
        or writes anything; :meth:`check_trainer` calls it again when a fit starts, with the trainer's own. Each
        option's rules live with what implements it (``lmtrain.distributed``, ``lmtrain.float8``,
        ``lmtrain.graphs``, ``lmtrain.optim``).

        Args:
            config: the model's options.
            settings: the trainer's settings.
            training: the run trains (``fit``); validate and test take no training step, so the options of the
                training step (``step_mode``, ``cuda_graphs``, ``master_weights``, ``optimizer_in_backward``) are not
                checked.
        """
        check_strategy_options(config, settings.strategy, settings.world_size, training)
        if settings.strategy == "fsdp":
            check_fsdp_precision(settings.precision)
        if config.float8 != "none":
            check_float8_run(settings)
        if not training:
            return
        if config.step_mode != "train":
            check_step_mode_run(config.step_mode, settings)
        if config.cuda_graphs:
            check_graph_run(settings, needs_cuda=cls.graph_class.needs_cuda)
        if config.master_weights:
            check_master_weights_run(settings)
        if config.optimizer_in_backward:
            check_in_backward_run(settings)

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
        # What blas_workspace resolved to (auto: by cuda_graphs), beside the options as given
        chosen = resolve_blas_workspace(self.config.blas_workspace, self.config.cuda_graphs)
        for logger in self.loggers:
            logger.log_hyperparams({"blas_workspace_applied": chosen})
        if self.config.attention == "flash_triton":
            served = flash_kernels_record(self.config, self.device, str(self.trainer.precision))
            for logger in self.loggers:
                logger.log_hyperparams({"flash_kernels": served})

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

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the length of the cosine decay, so that a resumed run keeps the schedule it started with."""
        if self._decay_steps is not None:
            checkpoint[SCHEDULE_KEY] = {"decay_steps": self.schedule_decay_steps}

    @property
    def schedule_decay_steps(self) -> int | None:
        """The step where the cosine decay ends: the resumed checkpoint's, else ``decay_steps`` or the trainer's
        total (None before ``configure_optimizers``)."""
        return self._checkpoint_decay_steps or self._decay_steps

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint of another architecture with one line, before its weights are loaded.

        Raises:
            LmtrainError: the checkpoint's model differs in a field of ``ARCHITECTURE_FIELDS`` (the error
                names each field with both values and says how to request the checkpoint's model).
        """
        check_architecture(checkpoint.get("hyper_parameters") or {}, dict(self.hparams), self.config)
        trainer = self._trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            check_resumed_master_weights(checkpoint, self.config.master_weights)
        # Resume on the checkpoint's schedule: a new max_steps would stretch the decay and make the rate jump.
        self._checkpoint_decay_steps = (checkpoint.get(SCHEDULE_KEY) or {}).get("decay_steps")
        if self.model is not None and "state_dict" in checkpoint:
            # LMModule.load_from_checkpoint(path, **overrides) writes the overrides into the checkpoint's
            # hyperparameters before this hook runs, so compare the weights' shapes too.
            check_shapes(checkpoint["state_dict"], self.state_dict())
        self._weights_known = True

    # -- optimizer ----------------------------------------------------------------------------

    def configure_optimizers(self) -> dict[str, Any]:
        cfg = self.config
        on_cuda = all(p.is_cuda for p in self.parameters())  # fused AdamW is CUDA-only; CPU uses foreach
        groups = weight_decay_groups(self, cfg.weight_decay)
        fused = bool(cfg.fused_adamw and on_cuda)
        # A captured step keeps AdamW's step count on the device and reads the rate from a device tensor.
        capturable = self.cuda_graphs and on_cuda
        if cfg.optimizer_in_backward:
            if self._in_backward is not None:  # configured again: the old hooks must not update as well
                self._in_backward.remove_hooks()
            optimizer = InBackwardAdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused,
                                        overlap=cfg.optimizer_overlap, capturable=capturable)
            self._in_backward = optimizer
        elif cfg.master_weights:
            # The weights autocast casts: every linear layer's (the embedding table and the norm gains stay fp32).
            # Under FSDP2 the fp32 shards are the masters: its policy all-gathers them in bf16 for the compute.
            optimizer = MasterWeightAdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                          bf16_params=linear_weights(self.model),
                                          fused=None if cfg.fused_adamw else False, capturable=capturable,
                                          state_dtype=OPTIMIZER_STATE_DTYPES[cfg.optimizer_state_dtype],
                                          params_are_masters=self.device_mesh is not None, masters=self._masters)
            self._masters = None  # the optimizer holds them now
        else:
            optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused,
                                          capturable=capturable)
        if capturable:
            lr_as_tensors(optimizer, self.device)
        if self.cuda_graphs:
            optimizer = GraphedOptimizer(optimizer)
        self._decay_steps = int(cfg.decay_steps or self._total_steps())
        # The length is read at every step: a checkpoint loaded after this call (FSDP restores late) still counts.
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, cfg.warmup_steps, int(self.schedule_decay_steps or 1),
                                              cfg.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def _total_steps(self) -> int:
        """The trainer's total optimizer steps; without a finite bound, the schedule ends after warmup."""
        if self._trainer is None:
            return max(1, self.config.warmup_steps)
        total = self.trainer.estimated_stepping_batches
        return int(total) if math.isfinite(total) else max(1, self.config.warmup_steps)


LMModule.__init__ = schema_init(ModelConfig)  # type: ignore[method-assign]


def strategy_kind_of(trainer: pl.Trainer) -> str:
    """``ddp``, ``fsdp`` or ``single`` for the trainer's strategy (``lmtrain.memory_plan.strategy_kind``);
    ``other`` for a strategy the memory plan does not know."""
    from lmtrain.memory_plan import strategy_kind

    if getattr(trainer, "strategy", None) is None:
        return "single"
    try:
        return strategy_kind(trainer.strategy)
    except ValueError:
        return "other"


def check_step_mode_run(step_mode: str, settings: TrainerSettings) -> None:
    """Refuse trainer settings of an optimizer step with a step mode that takes none (``forward``,
    ``forward_backward``: the module optimises by hand, and Lightning refuses them for manual optimization with a
    message that names neither option).

    Raises:
        LmtrainError: gradient accumulation or clipping, naming ``model.step_mode``.
    """
    why = f"{step_mode} takes no optimizer step, so"
    fix = "or use model.step_mode: train."
    if settings.accumulate_grad_batches > 1:
        raise LmtrainError("model.step_mode", f"{why} there is no step to accumulate trainer.accumulate_grad_batches="
                           f"{settings.accumulate_grad_batches} batches for.",
                           "set trainer.accumulate_grad_batches: 1 for step-mode timing " + fix)
    if settings.gradient_clip_val:
        raise LmtrainError("model.step_mode", f"{why} there is no step to clip the gradients for "
                           f"(trainer.gradient_clip_val={settings.gradient_clip_val}).",
                           "unset trainer.gradient_clip_val for step-mode timing " + fix)


def trainer_settings(trainer: pl.Trainer) -> TrainerSettings:
    """The settings of a Lightning trainer that :meth:`LMModule.check_settings` checks the options against (the
    device: its strategy's root device)."""
    strategy = getattr(trainer, "strategy", None)
    device = None if strategy is None else strategy.root_device
    return TrainerSettings(precision=str(trainer.precision), strategy=strategy_kind_of(trainer),
                           world_size=getattr(trainer, "world_size", 1), device=None if device is None else str(device),
                           accumulate_grad_batches=trainer.accumulate_grad_batches,
                           gradient_clip_val=trainer.gradient_clip_val)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate: linear warmup, then cosine decay to ``min_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= total_steps:
        return min_ratio
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def flash_kernels_record(config: ModelConfig, device: torch.device | str, precision: str) -> dict[str, Any]:
    """Which flash_triton kernels serve ``config``'s attention on ``device`` at ``precision``, with the kernel
    settings (``lmtrain.kernels.flash.describe``): what a fit records in its loggers' hyperparameters."""
    from lmtrain.kernels.flash import describe

    return describe([(config.context_length, config.head_dim)], device=device, dtype=compute_dtype(precision))
