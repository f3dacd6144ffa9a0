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

Phases inside the graph: the captured step records timing events (``torch.cuda.Event(enable_timing=True,
external=True)``: each becomes an event-record node that fires on every replay) at its forward / backward /
optimizer boundaries, under the mark names of ``lmtrain.analysis.timing.MARKS``. ``CudaSyncTimer`` reads a step's
marks when the step after next starts, before that step's replay is launched; so that a replay never re-records
events not read yet, the step is captured twice, into two graphs sharing one memory pool, each with its own events,
and replays alternate between them (:attr:`WholeStepGraph.phase_marks`: the marks of the last replay). Where this torch
or driver cannot time events inside a graph (:func:`graph_timing_problem`), the step is captured once, without
marks, and one line says so at the start of the fit.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import Any

import torch

from lmtrain.analysis.timing import MARKS
from lmtrain.config import TrainerSettings
from lmtrain.errors import LmtrainError
from lmtrain.optim import InBackwardAdamW

StepFn = Callable[[torch.Tensor], torch.Tensor]

_START, _BEFORE_BWD, _AFTER_BWD, _BEFORE_OPT, _END = MARKS


def graph_timing_problem(device: torch.device) -> str | None:
    """Why timing events cannot be recorded inside a CUDA graph on ``device`` with this torch, or None if they can.

    Captures a one-kernel graph between two external timing events, replays it and reads the elapsed time: the
    whole mechanism :class:`WholeStepGraph` uses for the phases, on a graph too small to cost anything.
    """
    try:
        start, end = (torch.cuda.Event(enable_timing=True, external=True) for _ in range(2))
    except TypeError:
        return f"torch {torch.__version__} has no external CUDA events (torch.cuda.Event(external=True))"
    try:
        x = torch.zeros(1, device=device)
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            start.record()
            x.add_(1)
            end.record()
        graph.replay()
        end.synchronize()
        start.elapsed_time(end)
    except RuntimeError as error:
        return f"recording timing events in a CUDA graph failed on torch {torch.__version__}: " + \
            (str(error).splitlines() or ["?"])[0]
    return None


class WholeStepGraph:
    """One training step captured as a CUDA graph on a static batch buffer.

    Usage::

        graph = WholeStepGraph()
        graph.capture(step, batch, prepare=dry_run)   # records; runs nothing
        loss = graph.replay(batch)                     # copies batch in, launches the graph

    ``loss`` is the graph's static output: the next replay overwrites it, so a caller that keeps it clones it.

    With ``timed`` (the default), the step function calls :meth:`mark` at its phase boundaries; the step is
    captured into two graphs sharing one memory pool, each recording its own events there, and replays alternate
    between them, so a replay's marks stay valid until the replay after next (see the module docstring).
    Sharing the pool is safe because the two graphs never run at once and a step keeps nothing in the pool from one
    replay to the next (gradients are written afresh, not accumulated) except its loss, which the caller clones.

    Args:
        timed: record phase marks inside the graph (the caller checks :func:`graph_timing_problem` first).
    """

    #: A real CUDA graph: the module refuses ``cuda_graphs`` on other devices.
    needs_cuda = True

    def __init__(self, timed: bool = True) -> None:
        self.timed = timed
        self.graphs: list[Any] = []
        self.losses: list[torch.Tensor] = []
        self.marks: list[dict[str, Any]] = []  # per graph: mark name -> event recorded inside it
        self.static_batch: torch.Tensor | None = None
        self.static_loss: torch.Tensor | None = None
        #: The marks of the last replay (mark name -> CUDA event or, for the CPU stand-in, seconds); None before.
        self.phase_marks: dict[str, Any] | None = None
        self.captures = 0
        self.replays = 0
        self._recording: dict[str, Any] | None = None  # the marks being recorded (capture, or an emulated replay)

    def mark(self, name: str) -> None:
        """Record phase boundary ``name`` (one of ``MARKS``) of the step being captured; nothing otherwise."""
        if self._recording is not None:
            event = torch.cuda.Event(enable_timing=True, external=True)
            event.record()
            self._recording[name] = event

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
        self.graphs, self.losses, self.marks = [], [], []
        pool = None
        for _ in range(2 if self.timed else 1):
            graph = torch.cuda.CUDAGraph()
            self._recording = {} if self.timed else None
            try:
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    loss = step(self.static_batch).detach()
            finally:
                recorded, self._recording = self._recording, None
            pool = graph.pool()
            self.graphs.append(graph)
            self.losses.append(loss)
            self.marks.append(recorded or {})
        self.static_loss = self.losses[0]
        self.captures += 1

    def replay(self, batch: torch.Tensor) -> torch.Tensor:
        """Copy ``batch`` into the static buffer and run the captured step; returns the static loss."""
        assert self.static_batch is not None and self.static_loss is not None, "capture() first"
        self.static_batch.copy_(batch, non_blocking=True)
        which = self.replays % len(self.graphs)
        self.graphs[which].replay()
        self.replays += 1
        self.static_loss, self.phase_marks = self.losses[which], self.marks[which] or None
        return self.static_loss


class EmulatedStepGraph(WholeStepGraph):
    """Stands in for :class:`WholeStepGraph` where there is no CUDA: "replays" by calling the step function.

    It runs no graph and saves no time; it exists so that everything around the graph (when the module
    captures, how a replayed step reaches Lightning's step count, the schedule and the callbacks) can be tested
    on a CPU. ``prepare`` runs as with a real capture. With ``timed``, each replay's :meth:`mark` calls take the
    host clock (``time.perf_counter``, seconds) into a fresh :attr:`phase_marks`, and there are two "graphs" (the
    same step function twice), replayed by turns, as :class:`WholeStepGraph` has.
    """

    needs_cuda = False

    def mark(self, name: str) -> None:
        if self._recording is not None:
            self._recording[name] = perf_counter()

    def capture(self, step: StepFn, batch: torch.Tensor, prepare: Callable[[torch.Tensor], None] | None = None) -> None:
        self.static_batch = batch.detach().clone()
        if prepare is not None:
            prepare(self.static_batch)
        self.graphs = [step] * (2 if self.timed else 1)
        self.static_loss = torch.zeros((), device=batch.device)
        self.captures += 1

    def replay(self, batch: torch.Tensor) -> torch.Tensor:
        assert self.static_batch is not None and self.static_loss is not None, "capture() first"
        self.static_batch.copy_(batch)
        self._recording = {} if self.timed else None
        try:
            self.static_loss = self.graphs[self.replays % len(self.graphs)](self.static_batch).detach()
        finally:
            self.phase_marks, self._recording = self._recording, None
        self.replays += 1
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
        #: Why timing events cannot be recorded inside the graph ("" until checked, None: they can).
        self.timing_problem: str | None = ""
        self.reset()

    def reset(self, device: torch.device | None = None) -> None:
        """Start a fit: it captures its own graph after its own warm-up (compilation and autotuning are per
        process).

        Args:
            device: the fit's device. On a CUDA device (with a real graph class) this checks once that timing
                events can be recorded inside a graph (:func:`graph_timing_problem`) and, where they cannot, says in
                one line that replayed steps will have no phase split.
        """
        self.graph: WholeStepGraph | None = None
        self.eager_steps = 0
        self.capture_step: int | None = None
        if device is not None and device.type == "cuda" and self.graph_class.needs_cuda and self.timing_problem == "":
            self.timing_problem = graph_timing_problem(device)
            if self.timing_problem is not None:
                from lightning.pytorch.utilities import rank_zero_warn

                rank_zero_warn(f"model.cuda_graphs: no forward/backward/optimizer split for replayed steps "
                               f"({self.timing_problem}); they report the whole step only, and the eager warm-up "
                               "steps (reported apart by CudaSyncTimer) show the split.")

    def phase_marks(self) -> dict[str, Any] | None:
        """The marks recorded inside the graph by the last replay (see :class:`WholeStepGraph`), or None."""
        return self.graph.phase_marks if self.graph is not None else None

    def replays(self, trainer: Any, step: int) -> bool:
        """Step ``step`` runs as a replay (the capture step included): not during the warm-up, nor when a callback
        asks for an eager step (``needs_eager_step``)."""
        if self.eager_steps < self.warmup:
            return False
        return trainer is None or not eager_requested(trainer, step)

    def in_window(self, step: int) -> bool:
        """Step ``step`` is an eager warm-up step, the step that captured the graphs, or one of the steps right after
        it that launch a graph for the first time (timed replays alternate between two graphs, and a graph's first
        launch uploads it to the device)."""
        if self.capture_step is None:
            return True
        return step <= self.capture_step + len(self.graph.graphs) - 1

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
            self.graph = self.graph_class(timed=self.timing_problem is None or not self.graph_class.needs_cuda)
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

        mark = graph.mark  # phase boundaries, as CudaSyncTimer's hooks mark an eager step

        def forward_backward(b: torch.Tensor) -> torch.Tensor:
            loss = module.loss(b)
            mark(_BEFORE_BWD)
            loss.backward()
            mark(_AFTER_BWD)
            # The update starts here: after the backward pass (an in-backward optimizer has done most of it inside)
            mark(_BEFORE_OPT)
            return loss

        def whole_step(b: torch.Tensor) -> torch.Tensor:
            mark(_START)
            # Host work: at the capture, the backward pass then writes fresh gradient buffers (no accumulation),
            # which is what every replay does.
            inner.zero_grad(set_to_none=True)
            if isinstance(inner, InBackwardAdamW):
                loss = inner.step(closure=lambda: forward_backward(b))
            else:
                loss = forward_backward(b)
                inner.step()
            mark(_END)
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


def check_graph_run(settings: TrainerSettings, needs_cuda: bool = True) -> None:
    """Refuse trainer settings a graphed step (``model.cuda_graphs``) cannot work with.

    Args:
        settings: the trainer's settings (``LMModule.check_settings``: at parse time and when a fit starts).
        needs_cuda: the graph class needs a CUDA device (the CPU stand-in of the tests does not).

    Raises:
        LmtrainError: no CUDA device, several devices, accumulation, clipping or ``16-mixed``.
    """
    field, why = "model.cuda_graphs", "replays the whole step as one graph, so"
    off = "or set model.cuda_graphs: false."
    device = None if settings.device is None else torch.device(settings.device)
    if needs_cuda and device is not None and device.type != "cuda":
        raise LmtrainError(field, f"needs a CUDA device; this run trains on {device.type}.",
                           "train on a GPU (trainer.accelerator: gpu) " + off)
    if settings.several_ranks:
        raise LmtrainError(field, f"captures the step of one device; this run has {settings.world_size} "
                           "devices (their gradient communication is not captured).",
                           "use trainer.devices: 1 " + off)
    if settings.accumulate_grad_batches > 1:
        raise LmtrainError(field, f"{why} gradients cannot accumulate over trainer.accumulate_grad_batches="
                           f"{settings.accumulate_grad_batches} batches.",
                           "set trainer.accumulate_grad_batches: 1 (raise data.batch_size instead) " + off)
    if settings.gradient_clip_val:
        raise LmtrainError(field, f"{why} clipping by the gradient norm (trainer.gradient_clip_val="
                           f"{settings.gradient_clip_val}) would happen after the update, outside the graph.",
                           "unset trainer.gradient_clip_val " + off)
    if settings.precision == "16-mixed":
        raise LmtrainError(field, f"{why} the loss scaler's host-side checks (trainer.precision=16-mixed) "
                           "cannot run inside it.", "use trainer.precision: bf16-mixed " + off)
