"""Checkpoints as part of fit: save on SIGINT/SIGTERM, resume the newest run in its own run folder.

Three pieces:

- ``CheckpointOnSignal``: a callback that turns Ctrl+C (SIGINT) and preemption (SIGTERM) into a checkpoint
  and a clean stop. The signal only sets a flag; the checkpoint is written at the end of the training
  step in progress, when weights, optimizer state, loop counters and the data position agree. A second
  Ctrl+C stops at once, without saving (the step it lands in may be half done). It also writes
  ``last.ckpt`` at the end of training when the last periodic save was earlier, so ``--ckpt_path last``
  always finds the final weights.
- ``find_last_checkpoint``: the newest ``<save_dir>/<name>/version_N/checkpoints/last*.ckpt``.
- ``resolve_ckpt_path``: for the command line, before the trainer is built: turns ``ckpt_path: last`` into
  that file and points the TensorBoard logger at the checkpoint's ``version_N``, so a resumed run goes on
  writing the same run folder, and ``validate``/``test`` of a checkpoint log beside its training curves
  (Lightning alone would open ``version_N+1`` and, looking for ``last`` there, find nothing and start from
  scratch).

Under FSDP2 (``ModelParallelStrategy``) ``last.ckpt`` is a folder, a distributed checkpoint: each rank writes its
shards and rank 0 the rest (``meta.pt``); ``--ckpt_path last`` finds it and resumes it on the same number of ranks
like a file. One process reads it whole (``read_full_checkpoint``): ``generate``, and through ``FullCheckpointIO``
``validate``/``test`` without FSDP2. On several ranks ``CheckpointOnSignal`` also runs
``lmtrain.faults.RankWatchdog``, which stops every rank within a minute, naming it, when one dies.

Checkpoint cost: a checkpoint holds the fp32 weights and AdamW's two fp32 moments, 12 bytes per
parameter (also under ``bf16-mixed``, whose weights and optimizer state stay fp32; gradients are not
saved): tiny 13 MB, small 1.44 GiB, medium 4.73 GiB, large 10.8 GiB, xl 22.3 GiB, 2.7B 38.1 GiB per file
(training itself holds 16 bytes per parameter with the gradients: 50.8 GiB for 2.7B).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import warnings
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, TQDMProgressBar
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lmtrain.config import weight_fields
from lmtrain.errors import LmtrainError

#: ModelConfig fields that fix the weights (their shapes or what they compute; ``option(weights=True)``). A
#: checkpoint must agree on all of them; context_length, attention, activation_checkpointing, compile and the other
#: step options may change between runs.
ARCHITECTURE_FIELDS: tuple[str, ...] = weight_fields()

LAST = ModelCheckpoint.CHECKPOINT_NAME_LAST + ModelCheckpoint.FILE_EXTENSION  # "last.ckpt"
_VERSION = re.compile(r"version_(\d+)")


def checkpoint_dir(trainer: pl.Trainer) -> Path:
    """Where this run's checkpoints go: the ModelCheckpoint's folder, else ``<log_dir>/checkpoints``
    (the folder Lightning's ModelCheckpoint uses by default)."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath:
        return Path(callback.dirpath)
    return Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints"


def _no_sigterm_broadcast() -> None:
    """Stands in for Lightning's per-step SIGTERM broadcast while :class:`CheckpointOnSignal` owns SIGTERM."""


class CheckpointOnSignal(pl.Callback):
    """Stop cleanly on SIGINT / SIGTERM, saving ``last.ckpt`` first; save it at the end of training too.

    The handlers are installed whether or not the trainer checkpoints, so that every run stopped by a signal can
    say so in its exit status; ``last.ckpt`` is written only when it does (``enable_checkpointing`` with a
    ``ModelCheckpoint``), so a 2.7B benchmark without checkpointing never writes 38 GiB on Ctrl+C.

    During ``fit`` the handlers are installed while training runs (``on_train_start`` to ``on_train_end``, or
    Lightning's own teardown after an exception) and replace the previous ones meanwhile: Lightning installs its
    own SIGTERM handler just before, which would raise ``SystemExit`` after the step instead of letting the loop
    stop. The signal only sets a flag; the loop stops (and saves) at the end of the training step in progress.
    During ``validate``/``test``, which have nothing to save, a signal stops the run at once.
    On several ranks they agree on the step to stop at by gathering each rank's flag over the host (a gloo group
    beside NCCL, ``lmtrain.callbacks._common.host_group``), which does not wait for the GPU but does wait for the
    slowest rank's host; so they agree only every ``agree_every_n_steps`` steps (default: the trainer's
    ``log_every_n_steps``) and on the last step, not every step.
    While they own SIGTERM on several ranks, Lightning's own per-step check is skipped: Lightning (2.6) broadcasts
    rank 0's SIGTERM flag at the start of every training step and reads it on the host (``.item()``), which makes
    the host wait for the GPU once a step, so that each step's forward is launched onto an idle GPU (measured on
    FSDP2, 2.7B on 2 GPUs: the broadcast waited up to 348 ms and the forward idled for the host). With these
    handlers in place Lightning's flag cannot be set during training (one set before it is taken over as
    ``received``), so the broadcast would only ever carry "no"; the agreement above replaces it.
    ``received`` names the signal that stopped the run (also one that reached Lightning's own handlers first:
    Ctrl+C as ``KeyboardInterrupt``, SIGTERM as ``SIGTERMException``); ``python -m lmtrain fit|validate|test``
    then exits with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as a process killed by it would,
    so a scheduler can tell it from a finished run (exit status 0).

    Args:
        signals: names of the signals to catch.
        save_on_train_end: also write ``last.ckpt`` when training ends, if the newest checkpoint is older
            than the final step (a ModelCheckpoint every N steps misses the last steps otherwise).
        agree_every_n_steps: on several ranks, how often (in optimizer steps) the ranks check whether any of
            them was signalled; None: ``trainer.log_every_n_steps``.
        peer_timeout_s: on several ranks, stop when another rank has been dead this long, naming it
            (``lmtrain.faults.RankWatchdog``; a ``RankWatchdog`` among the trainer's callbacks replaces this one);
            None: no watchdog.
    """

    def __init__(self, signals: tuple[str, ...] = ("SIGINT", "SIGTERM"), save_on_train_end: bool = True,
                 agree_every_n_steps: int | None = None, peer_timeout_s: float | None = 30.0) -> None:
        from lmtrain.faults import RankWatchdog

        self.signals = tuple(signals)
        self.save_on_train_end = save_on_train_end
        self.agree_every_n_steps = agree_every_n_steps
        self.watchdog = RankWatchdog(peer_timeout_s) if peer_timeout_s is not None else None
        self.received: str | None = None
        #: The fit's last step (max_steps, or the last batch of max_epochs) ended: a signal after it stops nothing
        #: that a resumed run would do, and the command line exits 0.
        self.completed = False
        self.saved_path: Path | None = None
        self._saved_step: int | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._saves = False  # whether a signal during fit saves last.ckpt (the trainer checkpoints)
        self._evaluating = False  # validate/test: a signal stops at once
        self._paused_save_last: tuple[ModelCheckpoint, Any] | None = None
        self._quiet_loop: Any = None  # the training loop whose per-step SIGTERM broadcast is skipped

    # -- handlers -------------------------------------------------------------------------------

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._evaluating:
            self.received = name
            rank_zero_info(f"\n{name} received: stopping the evaluation now (it has nothing to save).")
            raise KeyboardInterrupt  # Lightning's graceful stop; the exit status still names this signal
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl+C: stop now, nothing saved
        self.received = name
        if self._saves:
            rank_zero_info(f"\n{name} received: saving a checkpoint after the current step, then stopping "
                           "(Ctrl+C again stops at once without saving).")
        else:
            rank_zero_info(f"\n{name} received: stopping after the current step; checkpointing is off, so nothing "
                           "is saved (Ctrl+C again stops at once).")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.received, self._saved_step, self.completed = None, None, False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lmtrain.faults import RankWatchdog

        self.received = None
        if self.watchdog is not None and not any(isinstance(c, RankWatchdog) for c in trainer.callbacks):
            self.watchdog.setup(trainer, pl_module, stage)
        from lmtrain.callbacks._common import host_group

        host_group(trainer)  # several ranks: a collective the first time, made now on every rank together

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        # A signal that reached Lightning's handlers instead of these (before training starts, or a second Ctrl+C):
        # Lightning turns both into SystemExit, whose status alone would not name the signal.
        if self.received is None and isinstance(exception, (KeyboardInterrupt, SIGTERMException)):
            self.received = "SIGINT" if isinstance(exception, KeyboardInterrupt) else "SIGTERM"
        if self.watchdog is not None:
            self.watchdog.on_exception(trainer, pl_module, exception)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._saves = trainer.checkpoint_callback is not None
        if getattr(trainer, "received_sigterm", False) and self.received is None:
            self.received = "SIGTERM"  # reached Lightning's handler before training: stop at the first agreement
        self._install_handlers("fit")
        if "SIGTERM" in self.signals and trainer.world_size > 1:
            self._skip_lightning_sigterm_broadcast(trainer)

    def _skip_lightning_sigterm_broadcast(self, trainer: pl.Trainer) -> None:
        """Replaces the training loop's per-step SIGTERM broadcast (Lightning's ``_broadcast_sigterm_tensor``,
        where this Lightning has it) with nothing, for this fit; :meth:`teardown` puts it back."""
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        if loop is None or not callable(getattr(type(loop), "_broadcast_sigterm_tensor", None)):
            return
        loop._broadcast_sigterm_tensor = _no_sigterm_broadcast
        self._quiet_loop = loop

    def _restore_lightning_sigterm_broadcast(self) -> None:
        loop, self._quiet_loop = self._quiet_loop, None
        if loop is not None:
            loop.__dict__.pop("_broadcast_sigterm_tensor", None)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn != TrainerFn.FITTING:  # during fit, the training's handlers are in place
            self._evaluating = True
            self._install_handlers("validate")

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluating = True
        self._install_handlers("test")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._evaluating:
            self._restore_handlers()

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_handlers()

    def _install_handlers(self, command: str) -> None:
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(f"CheckpointOnSignal: {command} runs outside the main thread, where Python cannot install "
                          "signal handlers; SIGINT/SIGTERM will not stop it cleanly.", stacklevel=2)
            return
        for name in self.signals:
            signum = signal.Signals[name]
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        self._evaluating = False

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.watchdog is not None:
            self.watchdog.teardown(trainer, pl_module, stage)
        self._restore_handlers()  # after an exception, when on_train_end does not run
        self._restore_lightning_sigterm_broadcast()
        if self._paused_save_last is not None:
            callback, value = self._paused_save_last
            callback.save_last = value
            self._paused_save_last = None

    # -- saving ---------------------------------------------------------------------------------

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        # Every save passes here (ModelCheckpoint's too): remember the newest step on disk, and record the
        # run folder so that a checkpoint moved elsewhere still says where its scalars are.
        self._saved_step = trainer.global_step
        checkpoint["lmtrain"] = {"log_dir": trainer.log_dir, "version": getattr(trainer.logger, "version", None)}

    def _save_last(self, trainer: pl.Trainer, why: str) -> None:
        path = checkpoint_dir(trainer) / LAST
        trainer.save_checkpoint(path, weights_only=False)  # the full state: resume needs optimizer and loops
        self.saved_path = path
        rank_zero_info(f"{why}: saved {path} at step {trainer.global_step}.")

    @staticmethod
    def _final_step(trainer: pl.Trainer) -> bool:
        """Whether the step that just ended is the last one of ``max_steps`` or ``max_epochs``."""
        if trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps:
            return True
        max_epochs = trainer.max_epochs
        return bool(trainer.is_last_batch and max_epochs is not None and max_epochs >= 0
                    and trainer.current_epoch + 1 >= max_epochs)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._accumulating(trainer):
            # A micro-batch that took no optimizer step: its gradients live only in memory, so a checkpoint now
            # would resume without them. Stop (and agree on it across ranks) at the window's last micro-batch.
            return
        self.completed = self._final_step(trainer)
        stop = self.received is not None
        if trainer.world_size > 1:
            every = self.agree_every_n_steps or max(1, int(trainer.log_every_n_steps))
            if trainer.global_step % every and not self._final_step(trainer):
                return  # every rank skips the same steps: the collective below stays matched
            stop = self._any_rank(trainer, stop)
        if stop:
            trainer.should_stop = True
            if not self._saves:
                return
            self._save_last(trainer, self.received or "a signal on another rank")
        elif (self._saves and self.save_on_train_end and self._final_step(trainer)
              and self._saved_step != trainer.global_step):
            self._save_last(trainer, "training ended")
        else:
            return
        # Saved at the end of a step, the checkpoint resumes exactly. ModelCheckpoint(save_last=True) that has
        # not written last.ckpt yet would overwrite it in on_train_end with one taken after the loop closed the
        # epoch, which resumes at the next logging step and with another epoch boundary: keep ours.
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint) and callback.save_last:
            self._paused_save_last = (callback, callback.save_last)
            callback.save_last = False

    @staticmethod
    def _accumulating(trainer: pl.Trainer) -> bool:
        """Whether the batch that just ended only accumulated gradients (Lightning's own test, the same on every
        rank); never under manual optimization or without accumulation."""
        if trainer.accumulate_grad_batches <= 1:
            return False
        should_accumulate = getattr(trainer.fit_loop.epoch_loop, "_should_accumulate", None)
        return bool(should_accumulate()) if callable(should_accumulate) else False

    @staticmethod
    def _any_rank(trainer: pl.Trainer, stop: bool) -> bool:
        """Whether any rank was signalled: the flags gathered over the host (gloo), so that the check does not
        make the host wait for the GPU as an all-reduce over NCCL would."""
        from lmtrain.callbacks._common import gather_values

        return any(row[0] > 0 for row in gather_values(trainer, [1.0 if stop else 0.0]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_handlers()
        # Training that stopped otherwise (e.g. early stopping): the best we have is the end-of-training state.
        if (self.save_on_train_end and trainer.checkpoint_callback is not None
                and self._saved_step != trainer.global_step and trainer.global_step > 0):
            self._save_last(trainer, "training ended")


class LogAtCheckpointStep(pl.Callback):
    """Log the scalars of ``validate``/``test`` of a checkpoint at the step the checkpoint was saved at.

    Lightning logs an evaluation-only run at the fit loop's step counter, which only ``fit`` restores from a
    checkpoint: ``val/loss`` of ``validate --ckpt_path last`` would land at step 0 of the run folder's curves
    (``resolve_ckpt_path`` points the logger at the checkpoint's run). This restores the fit loop's counters from
    the checkpoint when ``validate``/``test`` load one (the fit loop itself does not run), so the point lands on the
    fit's curve at the checkpoint's ``global_step`` and with its epoch.
    """

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn not in (TrainerFn.VALIDATING, TrainerFn.TESTING):
            return  # fit restores its loops itself
        fit_loop = (checkpoint.get("loops") or {}).get("fit_loop")
        if fit_loop is not None:  # Lightning saves it in every checkpoint, weights_only ones included
            trainer.fit_loop.load_state_dict(fit_loop)


# -- the model summary ------------------------------------------------------------------------------


class StepFlopsSummary(ModelSummary):
    """Lightning's model summary, its "Total Flops" line giving the model FLOPs of one training step.

    Lightning counts FLOPs by running ``example_input_array`` through the model and prints 0 without one; lmtrain
    knows them from the shapes: ``lmtrain.flops.flops_per_step`` at the model's config, the data module's batch size
    and context length, and the module's step mode (matrix products and attention, forward and backward).
    """

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        super().__init__(max_depth, **summarize_kwargs)
        self._step_flops = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step_flops = step_flops(trainer, pl_module)
        super().on_fit_start(trainer, pl_module)

    def summarize(self, summary_data: list, total_parameters: int, trainable_parameters: int, model_size: float,
                  total_training_modes: dict[str, int], total_flops: int, **summarize_kwargs: Any) -> None:
        super().summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                          total_flops=self._step_flops or total_flops, **summarize_kwargs)


def step_flops(trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
    """Model FLOPs of one step of ``pl_module`` on ``trainer``'s data (0 where either is not lmtrain's)."""
    from lmtrain.flops import flops_per_step

    config, data = getattr(pl_module, "config", None), getattr(trainer, "datamodule", None)
    batch, context = getattr(data, "batch_size", None), getattr(data, "context_length", None)
    if config is None or not batch or not context:
        return 0
    return int(flops_per_step(config, batch, context, getattr(config, "step_mode", "train")))


# -- resuming ---------------------------------------------------------------------------------------


class ResumedProgressBar(pl.Callback):
    """Give Lightning's progress bar the right total in the epoch where a fit resumes.

    The bar counts the batches of the epoch (``batch_idx + 1``), but after a resume in the middle of an epoch
    Lightning either sets no total (it skips ``on_train_epoch_start``) or the steps left to ``max_steps``, which
    the count passes at once, so that tqdm drops the total: the bar shows ``17/?``. At the first batch of a fit
    this sets the epoch's last batch instead: ``min(batches per epoch, batch_idx + steps left)``.
    """

    def __init__(self) -> None:
        self._first = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first = True

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not self._first:
            return
        self._first = False
        total = float(trainer.num_training_batches)
        if trainer.max_steps is not None and trainer.max_steps > 0:
            total = min(total, batch_idx + trainer.max_steps - trainer.global_step)
        for callback in trainer.callbacks:
            if isinstance(callback, TQDMProgressBar) and callback.is_enabled:
                callback.train_progress_bar.total = None if total == float("inf") else int(total)
                callback.train_progress_bar.refresh()


#: The file of a distributed checkpoint folder that holds everything but the weights and optimizer states (loops,
#: hyperparameters, callbacks, data position): Lightning's ``ModelParallelStrategy`` writes it beside the shards.
DISTRIBUTED_METADATA = "meta.pt"


def is_distributed_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a distributed checkpoint: the folder ``ModelParallelStrategy`` (FSDP2) saves, one shard
    file per rank (torch.distributed.checkpoint) plus :data:`DISTRIBUTED_METADATA`."""
    path = Path(path)
    return path.is_dir() and (path / DISTRIBUTED_METADATA).is_file()


def _saved_at(path: Path) -> float:
    """When a checkpoint was last written: a file's modification time, a distributed checkpoint's metadata file's
    (rewriting the shards in place leaves the folder's own time unchanged)."""
    return (path / DISTRIBUTED_METADATA if path.is_dir() else path).stat().st_mtime


def find_last_checkpoint(save_dir: str | os.PathLike = "logs", name: str = "lmtrain") -> Path | None:
    """The newest (by modification time) ``last*.ckpt`` under ``<save_dir>/<name>/version_*/checkpoints``: a file,
    or under FSDP2 a distributed checkpoint folder (:func:`is_distributed_checkpoint`)."""
    root = Path(save_dir) / name
    found = [p for p in root.glob("version_*/checkpoints/last*.ckpt") if p.is_file() or is_distributed_checkpoint(p)]
    return max(found, key=_saved_at) if found else None


def run_version(ckpt_path: str | os.PathLike, save_dir: str | os.PathLike = "logs",
                name: str = "lmtrain") -> int | None:
    """N when ``ckpt_path`` lies in ``<save_dir>/<name>/version_N/checkpoints/``; None otherwise."""
    path = Path(ckpt_path).resolve()
    if path.parent.name != "checkpoints":
        return None
    run = path.parent.parent
    match = _VERSION.fullmatch(run.name)
    if match is None or run.parent != (Path(save_dir) / name).resolve():
        return None
    return int(match.group(1))


def _get(namespace: Any, key: str, default: Any = None) -> Any:
    """Attribute or item access: jsonargparse namespaces and plain dicts alike."""
    if isinstance(namespace, dict):
        return namespace.get(key, default)
    return getattr(namespace, key, default)


def _set(namespace: Any, key: str, value: Any) -> None:
    if isinstance(namespace, dict):
        namespace[key] = value
    else:
        setattr(namespace, key, value)


def resolve_ckpt_path(config: Any, subcommand: str, processes: int | None = None) -> None:
    """Resolve and check ``ckpt_path`` in a LightningCLI subcommand's config, right after parsing.

    Call it from ``LightningCLI.parse_arguments`` (after ``super()``): LightningCLI then replaces the model
    options with the checkpoint's, so the comparison with the requested model must come first.

    ``last`` becomes the newest ``last*.ckpt`` of the TensorBoard logger's runs (see
    ``find_last_checkpoint``). A checkpoint inside ``<save_dir>/<name>/version_N/checkpoints`` sets the logger's
    ``version`` to N, so the resumed run's scalars and checkpoints, and the scalars of ``validate``/``test`` of
    that checkpoint, stay in that folder.
    ``fit`` with ``last`` and no checkpoint yet starts a new run (so a preemptible job can always pass
    ``--ckpt_path last``); ``validate``/``test`` with ``last`` and none stop with an error. Does nothing when
    the logger is not a TensorBoardLogger given by class path. ``validate``/``test`` of a checkpoint file without
    a config (``config`` unset) evaluate the file's own model (LightningCLI takes every model option from it), so
    its model is compared with the requested one only where a config was given, for ``fit``, and for a folder.

    Args:
        config: ``LightningCLI.config[subcommand]`` (a jsonargparse Namespace; a dict works too).
        subcommand: ``fit``, ``validate``, ``test`` or ``predict``.
        processes: the processes the trainer will run; given, ``fit`` also checks that the checkpoint's data order
            can continue (:func:`check_checkpoint_data_order`).

    Raises:
        LmtrainError: ``validate``/``test`` asked for ``last`` and there is no checkpoint, the given
            checkpoint file does not exist, its model differs from the requested one, or (``fit``) it has trained
            ``max_steps`` already or its data order cannot continue with the requested data options.
    """
    ckpt_path = _get(config, "ckpt_path")
    if ckpt_path is None:
        return
    logging_in = _resolve_in_log_dir(config, subcommand, ckpt_path)
    ckpt_path = _get(config, "ckpt_path")
    if ckpt_path is not None and (Path(ckpt_path).is_file() or is_distributed_checkpoint(ckpt_path)):
        # validate/test of a checkpoint file alone request no model: the model section holds the defaults (the
        # small model), which LightningCLI replaces with the file's own options. It takes none from a folder.
        if subcommand == "fit" or _get(config, "config") or not Path(ckpt_path).is_file():
            check_checkpoint_model(ckpt_path, _get(config, "model"))
        if subcommand == "fit":
            check_steps_left(ckpt_path, _get(_get(config, "trainer"), "max_steps"))
            if processes is not None:
                check_checkpoint_data_order(ckpt_path, _get(config, "data"), processes)
    if ckpt_path is not None and is_distributed_checkpoint(ckpt_path):
        _read_folder_unsharded(config, subcommand, ckpt_path)
    if logging_in is not None:  # said once every check passed: a refused checkpoint gets its one line only
        rank_zero_info(logging_in)


def checkpoint_data_options(config: Any, subcommand: str) -> dict[str, Any] | None:
    """The data options of the run that wrote a checkpoint file (its data module's hyperparameters), for
    ``validate``/``test`` of a checkpoint given without a config: LightningCLI takes the model's options from the
    file, and without these the data would be the defaults, not the run's.

    Args:
        config: ``LightningCLI.config[subcommand]`` right after parsing (``ckpt_path: last`` is resolved in it).
        subcommand: ``fit``, ``validate`` or ``test``.

    Returns:
        The options (those of ``LMDataModule`` that the model does not set), or None: ``fit``, a config was given,
        no checkpoint file, or a checkpoint without data options.

    Raises:
        LmtrainError: ``last`` finds no checkpoint, or the file is not a checkpoint.
    """
    import inspect

    from lmtrain.data import LMDataModule

    ckpt_path = _get(config, "ckpt_path")
    if subcommand == "fit" or _get(config, "config") or ckpt_path is None:
        return None
    _resolve_in_log_dir(config, subcommand, ckpt_path)
    ckpt_path = _get(config, "ckpt_path")
    if ckpt_path is None or not Path(ckpt_path).is_file():
        return None
    saved = read_checkpoint(ckpt_path).get("datamodule_hyper_parameters") or {}
    accepted = set(inspect.signature(LMDataModule.__init__).parameters) - {"self", "context_length", "vocab_size"}
    return {k: v for k, v in saved.items() if k in accepted} or None


def _read_folder_unsharded(config: Any, subcommand: str, ckpt_path: str) -> None:
    """A distributed checkpoint folder given to a run without FSDP2: ``validate``/``test`` read it whole
    (:class:`FullCheckpointIO` added to the trainer's plugins); ``fit`` stops, since its optimizer states are kept
    in FSDP2's layout."""
    from jsonargparse import Namespace

    from lmtrain.memory_plan import strategy_kind

    trainer = _get(config, "trainer")
    strategy = _get(trainer, "strategy") if trainer is not None else None
    if strategy is not None and not isinstance(strategy, str):  # a class_path entry, or a strategy object
        strategy = _get(strategy, "class_path", strategy)
    try:
        if trainer is None or strategy_kind(strategy or "auto") == "fsdp":
            return
    except ValueError:
        return  # a strategy of its own: left to it (and Lightning) to read the folder or say why not
    if subcommand == "fit":
        raise LmtrainError("ckpt_path", f"{ckpt_path} is a distributed checkpoint (FSDP2), and fit resumes one only "
                           "under FSDP2: its optimizer states are kept in FSDP2's layout.",
                           "resume it with --trainer.strategy lightning.pytorch.strategies.ModelParallelStrategy, "
                           "or validate, test or generate from it on one device.")
    # A class_path entry, as the command line's own parse gives: LightningCLI builds the plugin with the trainer.
    plugins = _get(trainer, "plugins")
    plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    _set(trainer, "plugins", [*plugins, Namespace(class_path=f"{__name__}.{FullCheckpointIO.__name__}",
                                                  init_args=Namespace())])


def check_steps_left(ckpt_path: str | os.PathLike, max_steps: int | None) -> None:
    """Stop when a checkpoint has already trained ``max_steps`` steps: resuming it would train nothing.

    Raises:
        LmtrainError: the checkpoint's ``global_step`` is >= ``max_steps`` (a positive ``max_steps``).
    """
    if max_steps is None or max_steps < 0:
        return
    step = read_checkpoint(ckpt_path).get("global_step")
    if isinstance(step, int) and step >= max_steps:
        raise LmtrainError("trainer.max_steps", f"the checkpoint {ckpt_path} is at step {step}, so "
                           f"max_steps {max_steps} leaves nothing to train.",
                           f"give --trainer.max_steps above {step} to train on, or use validate/test to evaluate it.")


def check_checkpoint_data_order(ckpt_path: str | os.PathLike, data: Any, processes: int) -> None:
    """Stop, before the trainer exists, when ``fit`` of a checkpoint could not continue its data order with the
    requested data options on ``processes`` processes (``lmtrain.data.check_data_order``, which the fit runs again
    when it restores the data module: by then Lightning has printed its device lines and the logger has written).

    Args:
        ckpt_path: the checkpoint to resume.
        data: the parsed ``data`` section (``LMDataModule``'s arguments).
        processes: the processes the trainer will run.

    Raises:
        LmtrainError: the checkpoint was written with another seed, source, global batch or epoch size.
    """
    from lmtrain.data import LMDataModule, check_data_order, data_order

    saved = read_checkpoint(ckpt_path).get(LMDataModule.__qualname__)  # where Lightning keeps the data's state
    if saved:
        check_data_order(saved, data_order(_get(data, "seed"), _get(data, "source"), _get(data, "batch_size"),
                                           processes, _get(data, "train_batches")))


def read_checkpoint(ckpt_path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's contents, memory-mapped (the weights are not read until used). Of a distributed checkpoint
    folder (FSDP2), everything but the sharded weights and optimizer states: its :data:`DISTRIBUTED_METADATA`.

    Raises:
        LmtrainError: the file is not a checkpoint (truncated, another format, not a file).
    """
    import torch

    if is_distributed_checkpoint(ckpt_path):
        ckpt_path = Path(ckpt_path) / DISTRIBUTED_METADATA
    try:
        return torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - zip, pickle and mmap errors alike: the file is no checkpoint
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0]
        if "mmap can only be used" in reason:  # torch's word for "not a zip file": no checkpoint at all
            reason = "not a file written by torch.save"
        raise LmtrainError("ckpt_path", f"{ckpt_path} cannot be read as a checkpoint ({reason}).",
                           "give a checkpoint file that fit wrote completely (e.g. --ckpt_path last); a file cut "
                           "short by a full disk or a killed copy cannot be resumed.") from None


def read_distributed_weights(ckpt_path: str | os.PathLike) -> dict[str, Any]:
    """The full (unsharded) model weights of a distributed checkpoint folder, read on one process without a process
    group: ``torch.distributed.checkpoint.load(..., no_dist=True)`` into CPU tensors of the shapes and dtypes its
    metadata records. The optimizer states in the folder are not read.

    Returns:
        The LightningModule's ``state_dict`` (``model.embedding.weight``: tensor, ...), as a file checkpoint holds it.

    Raises:
        LmtrainError: the folder's shards cannot be read (missing or cut-short files, another format).
    """
    import torch
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    # Lightning's ModelParallelStrategy saves {"state_dict": weights, "optimizer_0": ...}; the folder's metadata
    # names every entry by its flattened path, "state_dict.<weight name>".
    prefix = "state_dict."
    try:
        entries = FileSystemReader(ckpt_path).read_metadata().state_dict_metadata
        weights = {key.removeprefix(prefix): torch.empty(entry.size, dtype=entry.properties.dtype)
                   for key, entry in entries.items()
                   if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
        with warnings.catch_warnings():
            # One process and no process group is what no_dist asks for; torch warns that it assumes so.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            load({"state_dict": weights}, checkpoint_id=ckpt_path, no_dist=True)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - missing or cut-short files alike
        if isinstance(exc, CheckpointException):  # a BaseException wrapping each process's own: show the first
            exc = next(iter(exc.failures.values()))[0]
        reason = (str(exc).strip().splitlines() or ["no message"])[0][:160]
        raise LmtrainError("ckpt_path", f"the weights of the distributed checkpoint {ckpt_path} cannot be read "
                           f"({type(exc).__name__}: {reason}).",
                           "give a checkpoint folder that fit wrote completely (every rank's shard file and "
                           ".metadata beside meta.pt).") from None
    return weights


def read_full_checkpoint(ckpt_path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint with its full model weights under ``state_dict``, as one process can use it: a file as saved, a
    distributed checkpoint folder (FSDP2) as its :data:`DISTRIBUTED_METADATA` plus :func:`read_distributed_weights`
    (without optimizer states: enough to evaluate or sample, not to resume training).

    Raises:
        LmtrainError: the file or folder cannot be read as a checkpoint.
    """
    checkpoint = read_checkpoint(ckpt_path)
    if is_distributed_checkpoint(ckpt_path):
        checkpoint = {**checkpoint, "state_dict": read_distributed_weights(ckpt_path)}
    return checkpoint


class FullCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint reader and writer, which also reads a distributed checkpoint folder (FSDP2) as one full
    checkpoint (:func:`read_full_checkpoint`), so that ``validate`` and ``test`` of it run on one device or under
    DDP: each process loads every weight into its unsharded model. Writing is Lightning's, unchanged."""

    @override
    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if is_distributed_checkpoint(path):
            return read_full_checkpoint(path)
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)


def check_checkpoint_model(ckpt_path: str | os.PathLike, model: Any) -> None:
    """Stop when a checkpoint's model differs from the requested one; warn about other options that differ.

    LightningCLI replaces the requested ``model`` options with a checkpoint file's own hyperparameters right
    after parsing, so without this check a run asking for another model would silently continue the old one. Of a
    distributed checkpoint folder it takes none: the requested options apply, which the warning says.

    Args:
        ckpt_path: a checkpoint file or distributed checkpoint folder written by lmtrain.
        model: the requested ``model`` section (namespace or dict of LMModule arguments).

    Raises:
        LmtrainError: the architectures differ (see :func:`check_architecture`).
    """
    from lmtrain.config import ModelConfig

    if model is None:
        return
    saved = read_checkpoint(ckpt_path).get("hyper_parameters") or {}
    requested = dict(model) if isinstance(model, dict) else dict(vars(model))
    if requested.get("size") is None:
        return
    fields = ARCHITECTURE_FIELDS + ("context_length",)
    config = ModelConfig.from_size(requested["size"], **{k: requested.get(k) for k in fields if k in requested})
    check_architecture(saved, requested, config)
    differing = [k for k in sorted(saved.keys() & requested.keys()) if _as_tuple(saved[k]) != _as_tuple(requested[k])]
    if differing and is_distributed_checkpoint(ckpt_path):
        warnings.warn("the requested model options apply, not the distributed checkpoint's (LightningCLI takes a "
                      "checkpoint's options from a file only): " + ", ".join(
                          f"{k}={requested[k]!r} (checkpoint {saved[k]!r})" for k in differing) + ".", stacklevel=2)
    elif differing:
        warnings.warn("the checkpoint's model options replace the requested ones (LightningCLI takes them from the "
                      "checkpoint): " + ", ".join(f"{k}={saved[k]!r} (requested {requested[k]!r})" for k in differing)
                      + ".", stacklevel=2)


def _as_tuple(value: Any) -> Any:
    """Lists as tuples: YAML gives ``[0.9, 0.95]`` where Python code and checkpoints hold ``(0.9, 0.95)``."""
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _resolve_in_log_dir(config: Any, subcommand: str, ckpt_path: str) -> str | None:
    """Resolve ``last`` and point the logger at the checkpoint's run folder; returns the line that says so (None
    for a checkpoint outside the logger's runs)."""
    logger = _get(_get(config, "trainer"), "logger")
    if not str(_get(logger, "class_path", "")).endswith("TensorBoardLogger"):
        return None
    init_args = _get(logger, "init_args")
    save_dir, name = _get(init_args, "save_dir", "logs"), _get(init_args, "name", "lightning_logs")
    if ckpt_path == "last":
        found = find_last_checkpoint(save_dir, name)
        if found is None:
            where = Path(save_dir) / name / "version_*" / "checkpoints"
            if subcommand == "fit":
                warnings.warn(f"--ckpt_path last: no last.ckpt under {where} yet; starting a new run.", stacklevel=2)
                _set(config, "ckpt_path", None)
                return None
            raise LmtrainError("ckpt_path", f"'last' asks for the newest run's last.ckpt, and there is none under "
                               f"{where}.", "run fit first (it keeps last.ckpt), or pass a checkpoint file.")
        ckpt_path = str(found)
        _set(config, "ckpt_path", ckpt_path)
    elif Path(ckpt_path).is_dir() and not is_distributed_checkpoint(ckpt_path):
        raise LmtrainError("ckpt_path", f"{ckpt_path} is a folder, not a checkpoint file.",
                           f"give a file inside it, e.g. {Path(ckpt_path) / 'checkpoints' / LAST} or "
                           f"{Path(ckpt_path) / LAST}, or use --ckpt_path last.")
    elif ckpt_path not in ("best", "hpc", "registry") and not Path(ckpt_path).exists():
        raise LmtrainError("ckpt_path", f"checkpoint {ckpt_path} does not exist.",
                           "check the path, or use --ckpt_path last for the newest run's last.ckpt.")
    if ckpt_path in ("best", "hpc", "registry"):
        return None
    version = run_version(ckpt_path, save_dir, name)
    if version is not None:
        _set(init_args, "version", version)
        what = "Resuming" if subcommand == "fit" else f"{subcommand.capitalize()} of"
        return f"{what} {ckpt_path}: logging in {Path(save_dir) / name / f'version_{version}'}."
    return None


def check_architecture(saved: dict[str, Any], requested: dict[str, Any], config: Any) -> None:
    """Compare a checkpoint's hyperparameters with the requested model's resolved configuration.

    Args:
        saved: the checkpoint's ``hyper_parameters`` (an LMModule's ``__init__`` arguments).
        requested: the requested module's hyperparameters.
        config: the requested module's resolved ``ModelConfig``.

    Raises:
        LmtrainError: a field of ``ARCHITECTURE_FIELDS`` differs.
    """
    from lmtrain.config import SIZES, ModelConfig

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


def check_resumed_master_weights(checkpoint: dict[str, Any], requested: bool) -> None:
    """Refuse resuming training (the optimizer state restored) across ``master_weights`` settings.

    With master weights the fp32 values of the linear weights live in the optimizer state and the weights are bf16;
    without, the weights are fp32 and the optimizer holds none. Resumed across the two, the fp32 values would be
    rounded to bf16 without a word (or left unused in the optimizer state). Loading weights alone (validate, test,
    generate) is not affected.

    Raises:
        LmtrainError: the checkpoint holds an optimizer state and was trained with the other setting.
    """
    saved = (checkpoint.get("hyper_parameters") or {}).get("master_weights")
    if saved is None or not checkpoint.get("optimizer_states") or bool(saved) == bool(requested):
        return
    raise LmtrainError("model.master_weights", f"the checkpoint was trained with master_weights {bool(saved)}, this "
                       f"run asks for {bool(requested)}: resuming would round its fp32 weights to bf16.",
                       f"resume with --model.master_weights {str(bool(saved)).lower()}, or start a new run from its "
                       "weights (LMModule.load_from_checkpoint, then fit without ckpt_path).")


def check_shapes(saved: dict[str, Any], requested: dict[str, Any]) -> None:
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
