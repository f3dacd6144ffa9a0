"""The whole training step as one CUDA graph: forward, backward and the optimizer step, captured once, replayed.

A small model's step is bound by the host: a step of the 128M model launches well over a thousand kernels, each
costing the CPU a few microseconds in PyTorch, Lightning and the driver, while the GPU finishes most of them
sooner. Captured as a CUDA graph, the step is one launch (``cudaGraphLaunch``) whatever its kernel count.

:class:`WholeStepGraph` captures a step function (``loss = step(batch)``, the whole training step with the
optimizer update inside it) on a static input buffer and replays it on new batches; :class:`GraphedOptimizer`
is the optimizer Lightning sees, so that a replayed step still counts as an optimizer step (``global_step``,
the LR schedule, checkpoints) without updating the parameters a second time. :class:`GraphedStep` is
``lmtrain.module.LMModule``'s training step when ``cuda_graphs`` is on (eager warm-up, capture, replays);
``docs/speed.md`` describes the mode and what the callbacks report under it.

What a captured step needs, and where it comes from:

- static shapes: a batch of another shape runs eagerly (:meth:`WholeStepGraph.matches`);
- static memory: the graph allocates its intermediates, gradients included, from a private pool that only its
  replays use; tensors made outside it (parameters, optimizer state) keep their addresses;
- no host work inside the step: a capturable AdamW (``capturable=True``) keeps its step count on the device, and
  the learning rate is a device tensor that the schedule fills in place between steps; nothing in the step reads
  a value back to the host (no ``.item()``, no gradient clipping by a host-side norm);
- warm caches: cuBLAS workspaces, Triton autotuning, ``torch.compile`` and the optimizer state exist before the
  capture; the module runs ordinary eager steps first (``cuda_graph_warmup``) and one forward and backward pass
  without an update on the capture stream itself (:meth:`WholeStepGraph.capture`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lmtrain.errors import LmtrainError
from lmtrain.optim import InBackwardAdamW

StepFn = Callable[[torch.Tensor], torch.Tensor]


class WholeStepGraph:
    """One training step captured as a CUDA graph on a static batch buffer.

    Usage::

        graph = WholeStepGraph()
        graph.capture(step, batch, prepare=dry_run)   # records; runs nothing
        loss = graph.replay(batch)                     # copies batch in, launches the graph

    ``loss`` is the graph's static output: the next replay overwrites it, so a caller that keeps it clones it.
    """

    #: A real CUDA graph: the module refuses ``cuda_graphs`` on other devices.
    needs_cuda = True

    def __init__(self) -> None:
        self.graph: Any = None
        self.static_batch: torch.Tensor | None = None
        self.static_loss: torch.Tensor | None = None
        self.captures = 0

    @property
    def ready(self) -> bool:
        """A step has been captured."""
        return self.static_loss is not None

    def matches(self, batch: torch.Tensor) -> bool:
        """``batch`` has the captured batch's shape, dtype and device (a replay can take it)."""
        s = self.static_batch
        return s is not None and s.shape == batch.shape and s.dtype == batch.dtype and s.device == batch.device

    def capture(self, step: StepFn, batch: torch.Tensor, prepare: Callable[[torch.Tensor], None] | None = None) -> None:
        """Capture ``step`` on a copy of ``batch``. Nothing runs: call :meth:`replay` to run the captured step.

        Args:
            step: the whole training step, ``batch -> loss`` (scalar tensor), updating the parameters inside.
            batch: a batch of the shape every replay will have (copied into the static buffer).
            prepare: run once on the capture stream before the capture (a forward and backward pass without an
                update: creates what the step's kernels need on that stream, such as cuBLAS workspaces).
        """
        self.static_batch = batch.detach().clone()
        stream = torch.cuda.Stream(device=batch.device)
        stream.wait_stream(torch.cuda.current_stream(batch.device))
        if prepare is not None:
            with torch.cuda.stream(stream):
                prepare(self.static_batch)
            torch.cuda.current_stream(batch.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            self.static_loss = step(self.static_batch).detach()
        self.captures += 1

    def replay(self, batch: torch.Tensor) -> torch.Tensor:
        """Copy ``batch`` into the static buffer and run the captured step; returns the static loss."""
        assert self.static_batch is not None and self.static_loss is not None, "capture() first"
        self.static_batch.copy_(batch, non_blocking=True)
        self.graph.replay()
        return self.static_loss


class EmulatedStepGraph(WholeStepGraph):
    """Stands in for :class:`WholeStepGraph` where there is no CUDA: "replays" by calling the step function.

    It runs no graph and saves no time; it exists so that everything around the graph (when the module
    captures, how a replayed step reaches Lightning's step count, the schedule and the callbacks) can be tested
    on a CPU. ``prepare`` runs as with a real capture.
    """

    needs_cuda = False

    def capture(self, step: StepFn, batch: torch.Tensor, prepare: Callable[[torch.Tensor], None] | None = None) -> None:
        self.static_batch = batch.detach().clone()
        if prepare is not None:
            prepare(self.static_batch)
        self.graph = step
        self.static_loss = torch.zeros((), device=batch.device)
        self.captures += 1

    def replay(self, batch: torch.Tensor) -> torch.Tensor:
        assert self.static_batch is not None and self.static_loss is not None, "capture() first"
        self.static_batch.copy_(batch)
        self.static_loss = self.graph(self.static_batch).detach()
        return self.static_loss


class GraphedOptimizer(torch.optim.Optimizer):
    """The optimizer Lightning steps when the step may be a graph replay; wraps the optimizer that does the work.

    Eager steps: :meth:`step` is the inner optimizer's ``step`` (closure included, so an in-backward optimizer
    works unchanged). Replayed steps (:attr:`replaying` set by the module around the call): the closure runs the
    replay, which has updated the parameters already, and :meth:`step` does nothing more. Either way Lightning
    counts an optimizer step and fires its hooks.

    ``param_groups`` and ``state`` are the inner optimizer's own objects (a schedule that changes ``lr`` here
    changes it there); ``state_dict``/``load_state_dict`` are the inner optimizer's, so checkpoints of graphed
    and eager runs are interchangeable.
    """

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        super().__init__([{"params": [p for g in inner.param_groups for p in g["params"]]}], {})
        self.inner = inner
        self.param_groups = inner.param_groups
        self.state = inner.state
        self.defaults = inner.defaults
        self.replaying = False

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if self.replaying:
            return closure() if closure is not None else None
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        devices = [g["lr"].device for g in self.inner.param_groups if isinstance(g["lr"], torch.Tensor)]
        self.inner.load_state_dict(state_dict)
        if devices:  # the checkpoint's rates are numbers (an eager run's) or tensors on another device
            lr_as_tensors(self.inner, devices[0])
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state


def lr_as_tensors(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Make each group's ``lr`` a device tensor (a captured step reads it; the schedule fills it in place).

    Also sets ``initial_lr`` to a Python float when it is missing, so the schedule computes rates on the host and
    fills them in without reading the device.
    """
    for group in optimizer.param_groups:
        lr = group["lr"]
        value = float(lr) if not isinstance(lr, torch.Tensor) else float(lr.detach().cpu())
        group.setdefault("initial_lr", value)
        if isinstance(group["initial_lr"], torch.Tensor):
            group["initial_lr"] = float(group["initial_lr"].detach().cpu())
        if not isinstance(lr, torch.Tensor) or lr.device != device:
            group["lr"] = torch.tensor(value, dtype=torch.float32, device=device)


def eager_requested(trainer: Any, step: int) -> bool:
    """Some callback of ``trainer`` needs step ``step`` to run eagerly (its ``needs_eager_step(step)`` is True).

    The protocol is duck-typed like ``in_window``: a callback that works through the step's module hooks or
    dispatched operations (which a graph replay does not run) implements ``needs_eager_step``.
    """
    for callback in getattr(trainer, "callbacks", []):
        needs = getattr(callback, "needs_eager_step", None)
        if callable(needs) and needs(step):
            return True
    return False


class GraphedStep:
    """``LMModule``'s training step under ``cuda_graphs``: eager warm-up steps, one capture, then replays.

    The module's ``training_step`` hands each batch to :meth:`training_step`, which runs it eagerly (warm-up,
    a step a callback asks to see eagerly, a batch of another shape) or as a replay of the captured step. The
    module's ``replays_graph`` and ``in_window`` (asked by the callbacks) are :meth:`replays` and
    :meth:`in_window`.

    Args:
        graph_class: how the step is captured and replayed (``WholeStepGraph``; tests use ``EmulatedStepGraph``).
        warmup: eager steps of each fit before the capture (``cuda_graph_warmup``).
    """

    def __init__(self, graph_class: type[WholeStepGraph], warmup: int) -> None:
        self.graph_class = graph_class
        self.warmup = warmup
        self.reset()

    def reset(self) -> None:
        """Start a fit: it captures its own graph after its own warm-up (compilation and autotuning are per
        process)."""
        self.graph: WholeStepGraph | None = None
        self.eager_steps = 0
        self.capture_step: int | None = None

    def replays(self, trainer: Any, step: int) -> bool:
        """Step ``step`` runs as a replay (the capture step included): not during the warm-up, nor when a callback
        asks for an eager step (``needs_eager_step``)."""
        if self.eager_steps < self.warmup:
            return False
        return trainer is None or not eager_requested(trainer, step)

    def in_window(self, step: int) -> bool:
        """Step ``step`` is an eager warm-up step or the step that captured the graph."""
        return self.capture_step is None or step <= self.capture_step

    def training_step(self, module: Any, batch: torch.Tensor) -> torch.Tensor:
        """One training step of ``module`` (an ``LMModule``): eager or a replay. Returns the detached loss."""
        optimizer = module.optimizers()
        schedule = module.lr_schedulers()
        graphed: GraphedOptimizer = optimizer.optimizer
        trainer = module.trainer
        step = trainer.global_step
        # The rate this step's update uses, from the schedule on the host (the groups' ``lr`` is a device tensor
        # here: reading it would wait for the GPU).
        module.log("train/lr", torch.tensor(float(module.config.lr * schedule.lr_lambdas[0](schedule.last_epoch))))
        if self.graph is None:
            self.graph = self.graph_class()
        graph = self.graph
        wanted = self.replays(trainer, step)
        replay = wanted and (not graph.ready or graph.matches(batch))
        if wanted and not replay:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(f"model.cuda_graphs: a batch of shape {tuple(batch.shape)} differs from the captured "
                           f"{tuple(graph.static_batch.shape)}; such batches run eagerly.")
        if replay:
            if not graph.ready:
                self._capture(module, graph, graphed.inner, batch)
            module.note_batch(batch)
            graphed.replaying = True
            try:
                optimizer.step(closure=lambda: graph.replay(batch))
            finally:
                graphed.replaying = False
            graphed.inner.zero_grad(set_to_none=True)  # as after an eager step (a host-side no-op after a replay)
            loss = graph.static_loss.clone()  # the next replay overwrites the static output
        else:
            def forward_backward() -> torch.Tensor:
                loss = module.loss(batch)
                module.manual_backward(loss)
                return loss

            if isinstance(graphed.inner, InBackwardAdamW):
                loss = optimizer.step(closure=forward_backward)
            else:
                loss = forward_backward()
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self.eager_steps += 1
            loss = loss.detach()
        schedule.step()
        return loss

    def _capture(self, module: Any, graph: WholeStepGraph, inner: torch.optim.Optimizer,
                 batch: torch.Tensor) -> None:
        """Capture the whole step: forward, backward and ``inner``'s update (inside the backward pass for an
        in-backward optimizer), with autocast's weight cache off (each cast is a kernel of the graph)."""
        import contextlib

        def forward_backward(b: torch.Tensor) -> torch.Tensor:
            loss = module.loss(b)
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
        self.capture_step = module.trainer.global_step


def check_graph_trainer(trainer: Any, activation_checkpointing: tuple[str, ...], needs_cuda: bool = True) -> None:
    """Refuse trainer settings a graphed step (``model.cuda_graphs``) cannot work with.

    Args:
        trainer: the Lightning trainer.
        activation_checkpointing: the model's checkpointing policies (``activation_checkpointing``,
            ``checkpoint_rest``).
        needs_cuda: the graph class needs a CUDA device (the CPU stand-in of the tests does not).

    Raises:
        LmtrainError: no CUDA device, several devices, accumulation, clipping, ``16-mixed`` or offload.
    """
    field, why = "model.cuda_graphs", "replays the whole step as one graph, so"
    off = "or set model.cuda_graphs: false."
    device = trainer.strategy.root_device
    if needs_cuda and device.type != "cuda":
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
    if "offload" in activation_checkpointing:
        raise LmtrainError(field, f"{why} it cannot copy saved tensors to freshly pinned host memory "
                           "(activation_checkpointing: offload).", "use full or selective checkpointing " + off)
