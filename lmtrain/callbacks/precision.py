"""PrecisionInspector: the dtype of everything in one training step, and how far mixed precision moves the result.

For one chosen training step the callback records, under the trainer's precision (autocast or not): the
storage dtype of every parameter; the input and output dtypes of every module, by module path (forward
hooks installed for that step only and removed right after); the logits and the loss; every gradient
after backward and the optimizer state after the optimizer step; and numerics: the same batch's logits
and loss recomputed in fp32 (autocast disabled, same weights, no gradients) and compared with the step's
own. Modules whose output is wider than the compute dtype are flagged with the reason found from what was
observed (``lmtrain.analysis.dtypes``, which also holds the report; this module only captures).

Every metric the callback logs, with its unit, is listed in the docstring of :class:`PrecisionInspector`.
The fp32 reference needs fp32 parameter storage (mixed precision or ``32-true``); with ``bf16-true`` or
``16-true`` storage it is skipped with a note. Dropout or other randomness in the model makes the
comparison meaningless; lmtrain's model has none.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lmtrain.analysis.dtypes import (
    AUTOCAST_FP32_MODULES,
    PrecisionReport,
    compare,
    dtype_name,
    first_float_tensor,
    grad_entries,
    optimizer_entries,
    parameter_entries,
    path_pattern,
)
from lmtrain.callbacks._common import StepPhases, StepWindow, WarnOnce, check_int, log_dir, log_scalars, log_text
from lmtrain.callbacks.dtype_recorder import DtypeRecorder

__all__ = [  # the analysis names stay importable from here for existing scripts
    "AUTOCAST_FP32_MODULES",
    "DtypeRecorder",
    "PrecisionInspector",
    "PrecisionReport",
    "compare",
    "dtype_name",
    "grad_entries",
    "optimizer_entries",
    "parameter_entries",
    "path_pattern",
]


class PrecisionInspector(Callback):
    """Record the dtypes of one training step and the error mixed precision adds (see the module docstring).

    Only the inspected step pays: its forward hooks are installed when it starts and removed when it ends
    (or in ``on_exception``); every other step costs a counter increment. Under gradient accumulation the
    first micro-batch's forward is recorded (the hooks then pause) and the report is built when the step's
    optimizer step is done.

    Metrics (TensorBoard scalars at the inspected step, ``trainer.global_step`` while it ran; the first three
    only when the fp32 reference ran, see the module docstring):

    - ``precision/logits_max_abs_err``: max |logits - logits_fp32|, in logit units (logits cast to fp32).
    - ``precision/logits_rel_err``: ||logits - logits_fp32||_2 / ||logits_fp32||_2, a ratio (no unit).
    - ``precision/loss_abs_err``: |loss - loss_fp32| in the loss's unit (nats for cross-entropy); needs a
      ``loss(batch)`` method on the LightningModule.
    - ``precision/flagged_modules``: count of module paths whose output is wider than the compute dtype.
    - text ``precision/report`` (Markdown); file ``precision_step{N}.json`` in the log dir.

    Args:
        step: the training step to inspect, on Lightning's ``global_step`` axis (0: the first step of a fresh
            fit; see ``lmtrain.callbacks._common.StepPhases``). Under ``16-mixed`` the first steps may be
            skipped by the GradScaler (no optimizer state yet): pick a later one there.
        logits_module: path of the module whose output is the logits (default: the outermost submodule
            that runs, e.g. ``model`` for ``LMModule``).
        reference: recompute logits and loss in fp32 for the numerics.
        max_rows: rows per grouped table in the text report (the JSON file has everything).
    """

    def __init__(self, step: int = 0, logits_module: str | None = None, reference: bool = True,
                 max_rows: int = 40) -> None:
        super().__init__()
        self.step = step
        self.logits_module = logits_module
        self.reference = reference
        self.max_rows = max_rows
        self._clear()

    def _clear(self) -> None:
        self._warn = WarnOnce()
        self._recorder: DtypeRecorder | None = None
        self._window = StepWindow(None)  # the real one is made in setup, once the arguments are checked
        self._beyond = False  # the step lies beyond max_steps (warned in setup)
        self._phases = StepPhases()
        self._batch: Any = None
        self._loss_dtype: torch.dtype | None = None
        self._loss: torch.Tensor | None = None
        self._ref: dict[str, Any] = {}
        self._grads: list[dict[str, Any]] = []
        self._stepped = False
        self._done = False
        self.result: PrecisionReport | None = None  # the inspection (for scripts and tests)

    def in_window(self, step: int) -> bool:
        """Step ``step`` is the inspected one (hooks, fp32 reference forward: slower than the others)."""
        return self._window.contains(step)

    def perturbs_timing(self, step: int) -> bool:
        """Yes for the inspected step: forward hooks on every module and an extra fp32 forward pass."""
        return self.in_window(step)

    def needs_eager_step(self, step: int) -> bool:
        """The inspected step records dtypes through module hooks, which a CUDA graph replay
        (``LMModule(cuda_graphs=True)``) does not run: it runs eagerly."""
        return self.in_window(step)

    def check_arguments(self, world_size: int = 1) -> None:
        """Check the arguments: ``setup`` calls it, and the command line before any log folder exists.

        Args:
            world_size: the number of processes of the run (unused here).

        Raises:
            LmtrainError: an argument is out of range, naming it.
        """
        check_int("PrecisionInspector", "step", self.step, 0, fix="use 0 for the first training step.")
        check_int("PrecisionInspector", "max_rows", self.max_rows, 1, fix="use e.g. 40.")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return  # validate / test after a fit must not clear that fit's result
        self.check_arguments()
        self._remove()
        self._clear()
        self._window = StepWindow(self.step, 1)
        self._beyond = self._window.beyond(getattr(trainer, "max_steps", None))
        if self._beyond:  # said now, once, rather than after the whole run
            self._warn(f"PrecisionInspector: step {self.step} lies beyond the last step of max_steps "
                       f"{trainer.max_steps}; nothing will be inspected. Lower step or train for more steps.")
        if getattr(pl_module, "cuda_graphs", False):
            rank_zero_info(f"PrecisionInspector: step {self.step} runs eagerly (a CUDA graph replay runs no module "
                           "hooks); the steps around it replay the graph.")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and not self._done and not self._beyond:
            self._warn(f"PrecisionInspector: step {self.step} did not run in this fit (its steps: "
                       f"{self._phases.steps_started} up to step {self._phases.step}); nothing was inspected.")
        self._remove()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove()

    def _remove(self) -> None:
        if self._recorder is not None:
            self._recorder.remove()
            self._recorder = None
        self._batch = self._loss = None
        self._ref = {}

    @property
    def hooks_installed(self) -> int:
        """Forward hooks this callback has on the model now (0 outside the inspected step)."""
        return 0 if self._recorder is None else self._recorder.installed

    # -- hooks -----------------------------------------------------------------------------------

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._phases.batch_start(trainer)
        if self._done or not self._phases.enters(self._window):
            return
        self._recorder = DtypeRecorder(pl_module, pl_module.device.type)
        self._recorder.install()
        self._batch = batch

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._phases.before_backward()
        if self._recorder is None:
            return
        self._recorder.paused = True  # the forward is over; backward recomputation must not add entries
        if self._loss_dtype is None:
            self._loss_dtype = loss.dtype
            self._loss = loss.detach()
        if self.reference and not self._ref:
            self._reference(pl_module)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phases.after_backward()
        if self._recorder is not None and not self._grads:
            self._grads = grad_entries(pl_module)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self._phases.before_optimizer_step()
        if self._recorder is not None:
            self._stepped = True

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        first = self._phases.first_batch
        ended = self._phases.batch_end(trainer)
        if self._recorder is None:
            return
        try:
            self._recorder.paused = True
            if self.reference and not self._ref and not self._stepped:
                self._reference(pl_module)  # forward-only step: the weights did not change
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if first and isinstance(loss, torch.Tensor) and loss.numel() == 1:
                # Unscaled (the hook's loss is scaled under 16-mixed); Lightning divides the returned loss by
                # the accumulation factor, which the fp32 reference of the same batch does not.
                factor = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
                self._loss = loss.detach() * factor
                self._loss_dtype = self._loss_dtype or loss.dtype
            if ended:
                self.result = self._build(trainer, pl_module)
                self._log(trainer, self.result)
        finally:
            if ended:  # else the step's other micro-batches run with the hooks paused
                self._done = True
                self._remove()


    # -- work ------------------------------------------------------------------------------------

    def _reference(self, pl_module: pl.LightningModule) -> None:
        """fp32 logits (and loss) of the same batch, autocast off, no gradients, hooks paused."""
        rec = self._recorder
        path = rec.logits_path(self.logits_module)
        self._ref = {"path": path}
        storage = {p.dtype for p in pl_module.parameters() if p.is_floating_point()}
        if storage and storage != {torch.float32}:
            self._ref["note"] = (f"no fp32 reference: parameters are stored in "
                                 f"{', '.join(sorted(dtype_name(d) for d in storage))}.")
            return
        gathered = {d for d in rec.param_compute.values() if d.is_floating_point}
        if gathered and gathered != {torch.float32}:
            self._ref["note"] = (f"no fp32 reference: the modules computed with "
                                 f"{', '.join(sorted(dtype_name(d) for d in gathered))} parameters (FSDP2 "
                                 "all-gathers the fp32 master weights in its MixedPrecisionPolicy's param_dtype).")
            return
        if path is None or path not in rec.kept:
            self._ref["note"] = "no fp32 reference: the logits module's inputs were not kept (set logits_module)."
            return
        args, kwargs, output = rec.kept[path]
        module = pl_module.get_submodule(path) if path else pl_module
        device_type = pl_module.device.type
        was = rec.paused
        rec.paused = True
        try:
            with torch.no_grad(), torch.autocast(device_type, enabled=False):
                ref_logits = first_float_tensor(module(*args, **kwargs))
                mixed = first_float_tensor(output)
                if ref_logits is not None and mixed is not None:
                    self._ref["logits"] = compare(mixed, ref_logits)
                loss_fn = getattr(pl_module, "loss", None)
                if callable(loss_fn) and self._batch is not None:
                    with contextlib.suppress(Exception):  # a loss(batch) of another signature: skip the loss
                        self._ref["loss"] = loss_fn(self._batch).detach().float()
        finally:
            rec.paused = was

    def _build(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> PrecisionReport:
        rec = self._recorder
        autocast, ac_dtype = rec.autocast_state()
        storage = Counter()
        for p in pl_module.parameters():
            if p.is_floating_point():
                storage[p.dtype] += p.numel()
        compute = ac_dtype if autocast else (storage.most_common(1)[0][0] if storage else torch.float32)
        path = rec.logits_path(self.logits_module)
        logits = first_float_tensor(rec.kept[path][2]) if path in rec.kept else None
        if self.logits_module is not None and path is None:
            self._warn(f"PrecisionInspector: logits_module {self.logits_module!r} did not run in the inspected "
                       "step; logits not reported.")
        report = PrecisionReport(
            precision=str(trainer.precision), device_type=pl_module.device.type, autocast=autocast,
            autocast_dtype=dtype_name(ac_dtype) if autocast else None, compute_dtype=dtype_name(compute),
            step=self._phases.step, parameters=parameter_entries(pl_module, rec.param_compute),
            modules=rec.module_entries(compute),
            logits_module=path if path != "" else "(root)",
            logits_dtype=dtype_name(logits.dtype) if logits is not None else None,
            loss_dtype=dtype_name(self._loss_dtype) if self._loss_dtype is not None else None,
            grads=self._grads,
            optimizer_state=optimizer_entries(trainer.optimizers, pl_module) if self._stepped else [],
        )
        if "logits" in self._ref:
            report.numerics["logits_max_abs_err"], report.numerics["logits_rel_err"] = self._ref["logits"]
        if "loss" in self._ref and self._loss is not None:
            report.numerics["loss_abs_err"] = abs(self._loss.float().item() - self._ref["loss"].item())
        if "note" in self._ref:
            report.notes.append(self._ref["note"])
        return report

    def _log(self, trainer: pl.Trainer, report: PrecisionReport) -> None:
        step = self._phases.step
        metrics = {f"precision/{k}": v for k, v in report.numerics.items()}
        metrics["precision/flagged_modules"] = float(len(report.flagged))
        log_scalars(trainer, metrics, step)
        log_text(trainer, "precision/report", report.to_markdown(self.max_rows), step)
        out_dir = log_dir(trainer)
        if out_dir and trainer.global_rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, f"precision_step{self.step}.json"), "w") as f:
                f.write(report.to_json())
