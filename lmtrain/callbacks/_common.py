"""Helpers shared by the callbacks: logging text, images and scalars through the trainer's loggers."""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn

from lmtrain.analysis.tables import markdown_table  # noqa: F401 (re-exported for the callbacks)
from lmtrain.errors import LmtrainError


def tensorboard_writers(trainer: pl.Trainer) -> list[Any]:
    """The ``SummaryWriter`` of every TensorBoard logger attached to the trainer."""
    return [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]


def log_scalars(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    """Log scalars to every logger at ``step`` (rank 0 only; outside Lightning's ``self.log`` buffering).

    Used from hooks where ``LightningModule.log`` is not allowed (``on_train_batch_start``, teardown) or
    where the value belongs to an earlier step than the current one (CUDA events read one step late).
    """
    if trainer.global_rank != 0 or not metrics:
        return
    for lg in trainer.loggers:
        lg.log_metrics(metrics, step=step)


def log_text(trainer: pl.Trainer, tag: str, text: str, step: int = 0) -> None:
    """Log Markdown text (TensorBoard's Text tab); other loggers get nothing."""
    if trainer.global_rank != 0:
        return
    for writer in tensorboard_writers(trainer):
        writer.add_text(tag, text, global_step=step)


def log_image(trainer: pl.Trainer, tag: str, image: Any, step: int = 0) -> None:
    """Log an image (a matplotlib figure, or an HxWx3 / HxWx4 uint8 array) to TensorBoard's Images tab."""
    if trainer.global_rank != 0:
        return
    for writer in tensorboard_writers(trainer):
        if isinstance(image, np.ndarray):
            writer.add_image(tag, image, global_step=step, dataformats="HWC")
        else:
            writer.add_figure(tag, image, global_step=step, close=False)


_LOG_DIRS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def world_size(trainer: pl.Trainer) -> int:
    """``trainer.world_size`` (1 for a stand-in trainer without one, as in unit tests)."""
    return getattr(trainer, "world_size", 1)


def log_dir(trainer: pl.Trainer) -> str | None:
    """Folder where the first logger writes (where callbacks put their files), or the trainer's root.

    ``trainer.log_dir`` broadcasts rank 0's folder, a collective: on several ranks the folder is read once per
    trainer (every lmtrain callback asks in ``setup``, which runs on every rank) and kept, so that a call made by
    one rank alone later (a file written by a profiling rank, an OOM dump) cannot hang.
    """
    if world_size(trainer) <= 1:
        return trainer.log_dir or trainer.default_root_dir
    try:
        if trainer not in _LOG_DIRS:
            _LOG_DIRS[trainer] = trainer.log_dir or trainer.default_root_dir
        return _LOG_DIRS[trainer]
    except TypeError:  # a stand-in trainer (unit tests) that cannot be weakly referenced
        return trainer.log_dir or trainer.default_root_dir


# -- several ranks ------------------------------------------------------------------------------------------


_HOST_GROUP: dict[str, Any] = {}  # "world": the default group it was made for, "group": the gloo group


def host_group(trainer: pl.Trainer) -> Any:
    """The process group through which the callbacks gather host-side values: gloo, over every rank.

    Created once per process group, on first use. ``torch.distributed.new_group`` is a collective: every rank must
    make the first call together, so each callback that gathers calls this from ``setup`` (which Lightning runs on
    every rank, callbacks in the same order). On a run whose default group is gloo already (CPU) that group is used;
    on NCCL a gloo group is made beside it, so that a gather neither goes through the GPU nor waits for it.
    None on one process or without a process group.
    """
    import torch.distributed as dist

    if world_size(trainer) <= 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if _HOST_GROUP.get("world") is not world:  # a new default group (a new fit in this process)
        group = world if dist.get_backend(world) == "gloo" else dist.new_group(backend="gloo")
        _HOST_GROUP.update(world=world, group=group)
    return _HOST_GROUP["group"]


def gather_values(trainer: pl.Trainer, values: Sequence[float]) -> list[list[float]]:
    """Every rank's ``values`` in rank order: one float64 vector gathered on the host (:func:`host_group`).

    A collective: every rank must call it on the same steps, in the same order, with as many values (NaN for a
    value a rank does not have). The vector stays in host memory and goes over gloo, so the call never waits for
    the GPU (an NCCL gather would make the host wait for all the work queued before it).
    One process: ``[list(values)]``, no communication.
    """
    if world_size(trainer) <= 1:
        return [list(values)]
    import torch.distributed as dist

    local = torch.tensor([float(v) for v in values], dtype=torch.float64)
    gathered = [torch.empty_like(local) for _ in range(trainer.world_size)]
    dist.all_gather(gathered, local, group=host_group(trainer))
    return [row.tolist() for row in gathered]


def gather_objects(trainer: pl.Trainer, obj: Any) -> list[Any]:
    """Every rank's picklable ``obj`` in rank order (``torch.distributed.all_gather_object`` over
    :func:`host_group`); a collective like :func:`gather_values`. One process (or no process group): ``[obj]``."""
    import torch.distributed as dist

    if world_size(trainer) <= 1 or not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=host_group(trainer))
    return out


def check_ranks(owner: str, ranks: Any, world_size: int) -> list[int]:
    """The sorted ranks of a callback's ``ranks`` argument, or :class:`LmtrainError` naming
    ``callbacks.<owner>.ranks``: a non-empty list of distinct integers in [0, world_size)."""
    ok = (isinstance(ranks, (list, tuple)) and len(ranks) > 0
          and all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world_size for r in ranks)
          and len(set(ranks)) == len(ranks))
    if not ok:
        raise LmtrainError(f"callbacks.{owner}.ranks",
                           f"must be a non-empty list of distinct ranks in 0..{world_size - 1}, got {ranks!r}.",
                           f"use e.g. [0], or any of 0..{world_size - 1} (the run has {world_size} rank(s)).")
    return sorted(ranks)


def request_cupti_teardown() -> bool:
    """Ask Kineto to tear CUPTI down when the profiler stops (``TEARDOWN_CUPTI=1``), unless the variable is set.

    Returns whether this call set it. Kineto reads the variable when a trace stops, so it must be set before.
    """
    if "TEARDOWN_CUPTI" in os.environ:
        return False
    os.environ["TEARDOWN_CUPTI"] = "1"
    return True


class WarnOnce:
    """Emit each distinct message once per instance (callbacks must not warn every step)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __call__(self, message: str) -> None:
        if message not in self._seen:
            self._seen.add(message)
            rank_zero_warn(message)


def check_int(owner: str, name: str, value: Any, minimum: int, allow_none: bool = False,
              fix: str | None = None) -> None:
    """Raise :class:`LmtrainError` for field ``callbacks.<owner>.<name>`` unless ``value`` is an int >= ``minimum``.

    Callbacks call this from ``setup`` (``__init__`` only stores arguments), so a bad option stops the run
    before the first step with a message that names the option.

    Args:
        owner: the callback's class name, e.g. ``MemorySnapshot``.
        name: the argument, e.g. ``num_steps``.
        value: its value.
        minimum: the smallest allowed value.
        allow_none: None is allowed too (and then means what the callback's docstring says).
        fix: the fix to print; by default, the allowed range.
    """
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        default_fix = f"set {name} to a whole number >= {minimum}" + (" (or leave it unset)." if allow_none else ".")
        raise LmtrainError(f"callbacks.{owner}.{name}", f"must be an integer >= {minimum}, got {value!r}.",
                           fix or default_fix)


class StepWindow:
    """A window of training steps on Lightning's step axis (see :class:`StepPhases`).

    Args:
        start_step: ``trainer.global_step`` of the first step in the window; None: the window never opens.
        num_steps: steps (optimizer steps) in the window; None: it never closes.
    """

    def __init__(self, start_step: int | None, num_steps: int | None = 1) -> None:
        self.start_step = start_step
        self.num_steps = num_steps

    def contains(self, step: int) -> bool:
        """Step ``step`` lies in the window."""
        if self.start_step is None or step < self.start_step:
            return False
        return self.num_steps is None or step < self.start_step + self.num_steps

    @property
    def last_step(self) -> int | None:
        """The window's last step (None for a window that never opens or never closes)."""
        if self.start_step is None or self.num_steps is None:
            return None
        return self.start_step + self.num_steps - 1

    def beyond(self, max_steps: int | None) -> bool:
        """The window cannot end within a fit of ``max_steps`` steps (steps 0..max_steps-1; None or -1: no bound)."""
        if self.start_step is None or max_steps is None or max_steps < 0:
            return False
        return (self.start_step if self.last_step is None else self.last_step) >= max_steps

    def describe(self) -> str:
        """``steps a-b`` (``steps a-`` without an end), for messages and reports."""
        if self.start_step is None:
            return "no steps"
        last = self.last_step
        return f"step {last}" if last == self.start_step else f"steps {self.start_step}-{'' if last is None else last}"


def waits_after(window: StepWindow, step: int, world_size: int) -> bool:
    """On several processes, ``step`` is the one right after ``window``: a callback that writes files on some ranks
    at the end of its window (after the step's last collective) holds the other ranks in the next step's first
    collective until it is done. On one process, or for any other step, False."""
    last = window.last_step
    return world_size > 1 and last is not None and step == last + 1


class StepPhases:
    """The one step axis and the phase boundaries of a training step, shared by every lmtrain callback.

    Each callback owns one instance and forwards Lightning's hooks to it (``batch_start``,
    ``before_backward``, ``after_backward``, ``before_optimizer_step``, ``batch_end``); the callback's own
    work then reads :attr:`step`, :attr:`phase`, :attr:`micro_batch` and asks :meth:`enters` /
    :meth:`leaves` about its windows.

    Step axis: a *step* is one optimizer step, and its index is ``trainer.global_step`` while it runs:
    0 for the first step of a fresh fit, the checkpoint's ``global_step`` after a resume, the same index
    for every micro-batch of a step under gradient accumulation. Lightning logs a step's ``self.log``
    values at that same index, so every lmtrain tag lines up with Lightning's own. In manual
    optimization every batch is a step; when it never calls ``optimizer.step()`` (lmtrain's ``forward``
    and ``forward_backward`` step modes) ``global_step`` stands still, and the index counts on by one per
    batch from the last ``global_step`` seen (the only axis such a run has).

    Phases of a batch: ``forward`` (batch start -> ``on_before_backward``, or -> batch end without a
    backward; includes ``zero_grad``), ``backward`` (-> ``on_after_backward``), ``after backward`` (->
    ``on_before_optimizer_step`` or batch end), ``optimizer`` (``on_before_optimizer_step`` -> batch end:
    the optimizer step, gradient clipping, the LR scheduler).

    A step that the module replays as a CUDA graph (``LMModule(cuda_graphs=True)``; the module's
    ``replays_graph(step)`` says so at the batch start) has one phase, ``cuda graph``, from start to end:
    forward, backward and update run inside one graph launch, with no boundary the host could mark.
    :attr:`graphed` tells the callbacks; ``on_before_optimizer_step`` still fires (the step is an
    optimizer step) but leaves the phase as it is.
    """

    FORWARD, BACKWARD, AFTER_BACKWARD, OPTIMIZER = "forward", "backward", "after backward", "optimizer"
    GRAPH = "cuda graph"

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every step (call from ``setup``: each fit starts a fresh count of its own steps)."""
        self.step = -1  # index of the step in progress (or last ended); -1 before the first batch
        self.micro_batch = 0  # batch number inside the step (0 without gradient accumulation)
        self.phase: str | None = None  # phase in progress; None between batches
        self.stepped = False  # the optimizer stepped in the batch in progress
        self.ended = False  # the last batch_end ended its step
        self.steps_started = 0  # steps started in this fit
        self.batches_seen = 0  # training batches started in this fit
        self.previous_step: int | None = None  # the step before the current one in this fit
        self.graphed = False  # the step in progress is a CUDA graph replay
        self._open = False

    def batch_start(self, trainer: pl.Trainer) -> int:
        """A training batch starts (``on_train_batch_start``); returns its step index."""
        if not self._open:
            global_step = trainer.global_step
            automatic = getattr(trainer.lightning_module, "automatic_optimization", True)
            self.previous_step = self.step if self.steps_started else None
            self.step = global_step if automatic or not self.steps_started else max(global_step, self.step + 1)
            self.micro_batch = 0
            self.steps_started += 1
            self._open = True
            replays = getattr(trainer.lightning_module, "replays_graph", None)
            self.graphed = bool(callable(replays) and replays(self.step))
        else:
            self.micro_batch += 1
        self.batches_seen += 1
        self.phase, self.stepped, self.ended = self.GRAPH if self.graphed else self.FORWARD, False, False
        return self.step

    def before_backward(self) -> None:
        self.phase = self.BACKWARD

    def after_backward(self) -> None:
        self.phase = self.AFTER_BACKWARD

    def before_optimizer_step(self) -> None:
        self.phase, self.stepped = self.GRAPH if self.graphed else self.OPTIMIZER, True

    def batch_end(self, trainer: pl.Trainer) -> bool:
        """A training batch ends (``on_train_batch_end``); returns whether it ended its step."""
        automatic = getattr(trainer.lightning_module, "automatic_optimization", True)
        # The optimizer stepped, or no accumulation (a batch whose training_step returned None skips the
        # optimizer yet ends its step), or manual optimization (every batch is a step).
        self.ended = (self.stepped or trainer.accumulate_grad_batches == 1 or not automatic
                      or trainer.global_step > self.step)
        self.phase = None
        if self.ended:
            self._open = False
        return self.ended

    @property
    def first_batch(self) -> bool:
        """The batch in progress is the first of its step."""
        return self.micro_batch == 0

    def starts_fit_after(self, step: int | None) -> bool:
        """At a batch start: this is the fit's first batch, and its step lies after ``step`` (a fit resumed past it;
        False for None)."""
        return step is not None and self.steps_started == 1 and self.first_batch and self.step > step

    def enters(self, window: StepWindow) -> bool:
        """At a batch start: this batch opens ``window`` for this fit (its first batch inside it; after a
        resume into the middle of a window, the first batch of the fit)."""
        return (window.contains(self.step) and self.first_batch
                and (self.previous_step is None or not window.contains(self.previous_step)))

    def leaves(self, window: StepWindow) -> bool:
        """At a batch end: this batch closes ``window`` (it ended the window's last step)."""
        return self.ended and window.contains(self.step) and not window.contains(self.step + 1)


def timing_perturbed_by(trainer: pl.Trainer, step: int, exclude: object = None, module: bool = True) -> list[str]:
    """Class names of the trainer's callbacks (and module) whose measurement perturbs the timing of ``step``.

    The protocol is public and duck-typed. An object with a method ``perturbs_timing(step: int) -> bool`` says
    itself whether its work in that step slows the step measurably (every lmtrain callback declares it; see
    ``docs/callbacks.md``, "Which steps the timer leaves out"). An object without it but with ``in_window(step) ->
    bool`` counts as perturbing wherever its window holds the step (the conservative reading for callbacks that
    predate the declaration; ``LMModule``'s window is its eager warm-up, the step that captures its CUDA graphs and
    the first launch of each of them).
    ``CudaSyncTimer`` keeps the steps named here out of its summary.

    Args:
        trainer: the trainer (its public ``callbacks`` list is read).
        step: a step index on the :class:`StepPhases` axis.
        exclude: a callback to leave out (the one asking).
        module: ask the LightningModule too. Its CUDA-graph window is known only once the graphs are captured
            (before that it answers yes for every step), so a question asked before training leaves it out.
    """
    names = []
    for cb in [*trainer.callbacks, getattr(trainer, "lightning_module", None) if module else None]:
        if cb is None or cb is exclude:
            continue
        ask = getattr(cb, "perturbs_timing", None)
        if not callable(ask):
            ask = getattr(cb, "in_window", None)
        if callable(ask) and ask(step):
            names.append(type(cb).__name__)
    return names
