"""PrecisionInspector: the dtype of everything in one training step, and how far mixed precision moves the result.

For one chosen training step the callback records, under the trainer's precision (autocast or not): the
storage dtype of every parameter; the input and output dtypes of every module, by module path (forward
hooks installed for that step only and removed right after); the logits and the loss; every gradient
after backward and the optimizer state after the optimizer step; and numerics: the same batch's logits
and loss recomputed in fp32 (autocast disabled, same weights, no gradients) and compared with the step's
own. Modules whose output is wider than the compute dtype are flagged with the reason found from what was
observed (``lmtrain.analysis.dtypes``, which also holds the report; this module only captures).

Float8 layers (``model.float8``, ``lmtrain.float8``): on the inspected step (and every ``float8_every`` steps after
it) each float8 layer's three GEMMs are replayed from their high-precision operands with float8 casts
(:class:`Float8Probe`; the statistics are ``lmtrain.analysis.float8``'s): scale, amax and its history over the
inspected steps, the saturated and flushed-to-zero fractions of each operand, and the relative error of the float8
GEMM against the bf16 GEMM of the same operands. A layer whose saturated or underflow fraction exceeds
``float8_threshold`` is named in one warning.

Under ``torch.compile`` the inspected step (and every float8 replay step) runs its forward and backward passes
with the compiler's stance ``force_eager``: compiled code does not run module hooks added after its first call
(dynamo does not guard on them), so the hooks would see nothing. Its numerics are then the eager path's (no fused
kernels); the log says so once, and the reports carry a note.

Every metric the callback logs, with its unit, is listed in the docstring of :class:`PrecisionInspector`.
The fp32 reference needs fp32 parameter storage (mixed precision or ``32-true``); with ``bf16-true`` or
``16-true`` storage it is skipped with a note. Dropout or other randomness in the model makes the
comparison meaningless; lmtrain's model has none.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import Counter
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from typing_extensions import override

from lmtrain.analysis import float8 as f8
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
from lmtrain.errors import LmtrainError
from lmtrain.float8 import float8_linears, gemm_specs

__all__ = [  # the analysis names stay importable from here for existing scripts
    "AUTOCAST_FP32_MODULES",
    "DtypeRecorder",
    "Float8Probe",
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

    Float8 metrics, only when the model has float8 layers (``model.float8``), at the inspected step and every
    ``float8_every`` steps after it (fractions and ratios have no unit; amax in the operand's units; a scale
    multiplies the operand before its float8 cast; rowwise scales log their smallest):

    - ``precision/float8/<layer>/<gemm>/<operand>_amax``, ``..._scale``, ``..._saturated``, ``..._underflow``:
      per float8 layer (its module path), GEMM (``output``, ``grad_input``, ``grad_weight``) and operand
      (``input``, ``weight``, ``grad_output``; see ``lmtrain.analysis.float8.GEMMS``).
    - ``precision/float8/<layer>/<gemm>/rel_err``: ||float8 GEMM - bf16 GEMM|| / ||bf16 GEMM|| on the same
      operands.
    - ``precision/float8_max_saturated``, ``precision/float8_max_underflow``, ``precision/float8_max_rel_err``:
      the largest over every layer, GEMM and operand.
    - ``precision/float8_flagged_layers``: count of layers over ``float8_threshold``.
    - text ``precision/float8`` (Markdown): one row per layer and GEMM, with the amax history of the inspected
      steps. Under FSDP2's float8 all-gather (tensorwise) the weight arrives in float8: the replay's weight operand
      is that float8 weight, so the weight's own cast error is not in its statistics nor in ``rel_err``; a note
      under the table (and one log line) says so.

    Args:
        step: the training step to inspect, on Lightning's ``global_step`` axis (0: the first step of a fresh
            fit; see ``lmtrain.callbacks._common.StepPhases``). Under ``16-mixed`` the first steps may be
            skipped by the GradScaler (no optimizer state yet): pick a later one there.
        logits_module: path of the module whose output is the logits (default: the outermost submodule
            that runs, e.g. ``model`` for ``LMModule``).
        reference: recompute logits and loss in fp32 for the numerics.
        max_rows: rows per grouped table in the text report (the JSON file has everything).
        float8_threshold: a float8 layer whose saturated or underflow fraction, in any operand of any of its
            GEMMs, exceeds this is named in a warning (0.001: 0.1% of the values).
        float8_every: also replay the float8 GEMMs every this many steps after ``step`` (their amax history);
            0: at ``step`` only. Each such step pays the replay (forward and backward hooks on the float8 layers,
            an fp32 GEMM per float8 GEMM).
        float8_scale_factors: a test hook for the warning: layer path -> factor multiplying every scale of that
            layer's replayed float8 casts (2**10 makes its values saturate). It changes the inspector's replay
            only, never the training step.
    """

    def __init__(self, step: int = 0, logits_module: str | None = None, reference: bool = True,
                 max_rows: int = 40, float8_threshold: float = 1e-3, float8_every: int = 0,
                 float8_scale_factors: dict[str, float] | None = None) -> None:
        super().__init__()
        self.step = step
        self.logits_module = logits_module
        self.reference = reference
        self.max_rows = max_rows
        self.float8_threshold = float8_threshold
        self.float8_every = float8_every
        self.float8_scale_factors = float8_scale_factors
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
        self._in_backward = False  # model.optimizer_in_backward: the update frees each gradient inside backward
        self._grad_hook: Any = None  # the optimizer step pre-hook reading those gradients, in the inspected step
        self._grad_dtypes: dict[int, torch.dtype] = {}  # id(parameter) -> its gradient's dtype, read by that hook
        self._stepped = False
        self._done = False
        self.result: PrecisionReport | None = None  # the inspection (for scripts and tests)
        self._probe: Float8Probe | None = None
        self._float8_present: bool | None = None  # known at the first batch (the model is built by then)
        self._eager: contextlib.ExitStack | None = None  # the compiler stance force_eager, while a step is inspected
        self._eager_note: str | None = None  # said when the model is compiled
        self._gathered_said = False  # the note on float8 all-gathered weights was logged
        #: The float8 layers' statistics at the last float8 step, and every operand's amax per inspected step
        #: (``<layer>/<gemm>/<operand>`` -> [(step, amax)]).
        self.float8_result: list[f8.Float8LayerStats] = []
        self.float8_history: dict[str, list[tuple[int, float]]] = {}

    def in_window(self, step: int) -> bool:
        """Step ``step`` is the inspected one (hooks, fp32 reference forward: slower than the others), or a step
        that replays the float8 GEMMs."""
        return self._window.contains(step) or bool(self._float8_present and self._float8_step(step))

    def _float8_step(self, step: int) -> bool:
        """Step ``step`` replays the float8 GEMMs (when the model has float8 layers)."""
        if step == self.step:
            return True
        return bool(self.float8_every) and step > self.step and (step - self.step) % self.float8_every == 0

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
        check_int("PrecisionInspector", "float8_every", self.float8_every, 0,
                  fix="use 0 (the inspected step only) or a step count such as 100.")
        threshold = self.float8_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
            raise LmtrainError("PrecisionInspector.float8_threshold", f"must be a fraction in [0, 1], got "
                               f"{threshold!r}.", "use e.g. 0.001 (0.1% of an operand's values).")
        for layer, factor in (self.float8_scale_factors or {}).items():
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
                raise LmtrainError("PrecisionInspector.float8_scale_factors", f"the factor of {layer!r} must be a "
                                   f"number above 0, got {factor!r}.", "use e.g. 1024 (2**10).")

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
        if self.reference and getattr(getattr(pl_module, "config", None), "master_weights", False):
            rank_zero_info("PrecisionInspector: no fp32 reference with model.master_weights (the step computes with "
                           "bf16 copies of the fp32 master weights); logits_max_abs_err, logits_rel_err and "
                           "loss_abs_err are not logged, the dtypes are.")
        self._in_backward = bool(getattr(getattr(pl_module, "config", None), "optimizer_in_backward", False))
        if self._in_backward:
            rank_zero_info("PrecisionInspector: with model.optimizer_in_backward each gradient is freed by its update "
                           "inside the backward pass: its dtype is read just before that update; the optimizer state "
                           "is read after the step as usual.")
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
        self._leave_eager()
        if self._probe is not None:
            self._probe.remove()
            self._probe = None
        if self._recorder is not None:
            self._recorder.remove()
            self._recorder = None
        if self._grad_hook is not None:
            self._grad_hook.remove()
            self._grad_hook = None
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
        step = self._phases.batch_start(trainer)
        if self._float8_present is None:
            self._float8_present = bool(float8_linears(pl_module))
        if self._float8_present and self._phases.first_batch and self._float8_step(step) and self._probe is None:
            self._probe = Float8Probe(pl_module, self.float8_scale_factors)
            self._probe.install()
            unknown = sorted(set(self.float8_scale_factors or {}) - set(self._probe.layers))
            if unknown:
                self._warn(f"PrecisionInspector: float8_scale_factors names {', '.join(unknown)}, not a float8 layer "
                           f"of this model (its float8 layers: {', '.join(self._probe.layers)}); nothing is scaled "
                           "there.")
        if not self._done and self._phases.enters(self._window):
            self._recorder = DtypeRecorder(pl_module, pl_module.device.type)
            self._recorder.install()
            self._batch = batch
            if self._in_backward:
                # The in-backward optimizer steps one torch.optim optimizer per parameter from a post-accumulate
                # hook and frees .grad right after: a step pre-hook sees each gradient before it goes (also
                # under FSDP2, which runs those hooks on the sharded parameters after its reduce-scatter).
                self._grad_hook = register_optimizer_step_pre_hook(self._read_grads)
        if self._probe is not None or self._recorder is not None:
            self._enter_eager(pl_module, step)

    def _enter_eager(self, pl_module: pl.LightningModule, step: int) -> None:
        """Run this step's forward and backward passes without compiled code, so that the hooks just installed
        fire (dynamo does not guard on module hooks: compiled code keeps skipping hooks added after its first
        call). A no-op for a model that is not compiled."""
        if self._eager is not None:
            return
        self._eager = contextlib.ExitStack()
        self._eager.enter_context(torch.compiler.set_stance("force_eager"))
        if self._eager_note is None and _compiled(pl_module):
            self._eager_note = ("the inspected steps ran their forward and backward passes eagerly (torch.compile's "
                                "stance force_eager, so that the inspection's module hooks run): their numerics "
                                "are the eager path's, not the compiled kernels'.")
            rank_zero_info(f"PrecisionInspector: step {step} runs eagerly under torch.compile (stance "
                           "force_eager: compiled code skips module hooks added after its first call); so does "
                           "every float8 replay step.")

    def _leave_eager(self) -> None:
        """Back to compiled code (before the optimizer step: only the forward and backward passes are inspected)."""
        if self._eager is not None:
            self._eager.close()
            self._eager = None

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

    def _read_grads(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Optimizer step pre-hook (in the inspected step, with the in-backward optimizer): the dtype of each
        gradient the optimizer is about to read, the first time it is seen."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._grad_dtypes.setdefault(id(p), p.grad.dtype)

    def _grad_entries(self, pl_module: pl.LightningModule) -> list[dict[str, Any]]:
        """The gradients' dtypes after backward; those the in-backward optimizer freed, from :meth:`_read_grads`."""
        params = dict(pl_module.named_parameters())
        entries = [e if e["dtype"] != "-" or id(params[e["path"]]) not in self._grad_dtypes
                   else {**e, "dtype": dtype_name(self._grad_dtypes[id(params[e["path"]])])} for e in self._grads]
        missing = sum(e["dtype"] == "-" and params[e["path"]].requires_grad for e in entries)
        if self._in_backward and missing:
            self._warn(f"PrecisionInspector: {missing} gradient(s) were freed by the in-backward optimizer before "
                       "they could be read; their dtype is reported as '-'.")
        return entries

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self._phases.before_optimizer_step()
        self._leave_eager()
        if self._recorder is not None:
            self._stepped = True

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        first = self._phases.first_batch
        ended = self._phases.batch_end(trainer)
        if ended:
            self._leave_eager()  # a step without an optimizer step (forward-only, manual optimization)
        if ended and self._probe is not None:
            try:
                self._float8_report(trainer, self._probe.results(self._phases.step), self._probe.gathered)
            finally:
                self._probe.remove()
                self._probe = None
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
            grads=self._grad_entries(pl_module),
            optimizer_state=optimizer_entries(trainer.optimizers, pl_module) if self._stepped else [],
        )
        if "logits" in self._ref:
            report.numerics["logits_max_abs_err"], report.numerics["logits_rel_err"] = self._ref["logits"]
        if "loss" in self._ref and self._loss is not None:
            report.numerics["loss_abs_err"] = abs(self._loss.float().item() - self._ref["loss"].item())
        if "note" in self._ref:
            report.notes.append(self._ref["note"])
        if self._eager_note is not None:
            report.notes.append(self._eager_note)
        if "logits" in self._ref and self._float8_present:
            report.notes.append("the fp32 reference runs the float8 layers in float8 too (they cast whatever their "
                                "input's dtype): its errors leave out float8's own, which precision/float8 reports "
                                "per layer.")
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

    def _float8_report(self, trainer: pl.Trainer, layers: list[f8.Float8LayerStats],
                       gathered: set[str] | frozenset[str] = frozenset()) -> None:
        """Log one float8 step's statistics, extend the amax history and warn about layers over the threshold.
        ``gathered``: the layers whose weight arrived in float8 (:attr:`Float8Probe.gathered`)."""
        step = self._phases.step
        self.float8_result = layers
        metrics: dict[str, float] = {}
        for s in layers:
            for name, g in s.gemms.items():
                prefix = f"precision/float8/{s.layer}/{name}"
                for operand, c in zip(f8.GEMMS[name], (g.a, g.b), strict=True):
                    self.float8_history.setdefault(f"{s.layer}/{name}/{operand}", []).append((step, c.amax))
                    metrics.update({f"{prefix}/{operand}_amax": c.amax, f"{prefix}/{operand}_scale": c.scale_min,
                                    f"{prefix}/{operand}_saturated": c.saturated,
                                    f"{prefix}/{operand}_underflow": c.underflow})
                metrics[f"{prefix}/rel_err"] = g.rel_err
        worst = [s.worst() for s in layers]
        over = f8.flagged(layers, self.float8_threshold)
        metrics["precision/float8_max_saturated"] = f8.nan_max(w[0] for w in worst)
        metrics["precision/float8_max_underflow"] = f8.nan_max(w[1] for w in worst)
        metrics["precision/float8_max_rel_err"] = f8.nan_max(g.rel_err for s in layers for g in s.gemms.values())
        metrics["precision/float8_flagged_layers"] = float(len(over))
        log_scalars(trainer, metrics, step)
        table = f8.markdown_table(layers, self.float8_history, self.float8_threshold)
        if self._eager_note is not None:
            table += f"\n\nNote: {self._eager_note}\n"
        if gathered:
            note = (f"under FSDP2's float8 all-gather the weight operand's reference is the gathered float8 weight "
                    f"(dequantised; {len(gathered)} of {len(layers)} layers): the weight was cast before the "
                    "all-gather, so its saturated and underflow fractions and each GEMM's rel_err leave that cast's "
                    "error out.")
            table += f"\n\nNote: {note}\n"
            if not self._gathered_said:
                self._gathered_said = True
                rank_zero_info(f"PrecisionInspector: {note}")
        log_text(trainer, "precision/float8", table, step)
        if over:
            rank_zero_warn(f"PrecisionInspector: step {step}: float8 layer(s) {', '.join(over)} have more than "
                           f"{self.float8_threshold:g} of an operand's values saturated or flushed to zero, or an "
                           "operand holding inf or NaN (see precision/float8).")


class Float8Probe:
    """Forward and gradient hooks on a module's float8 layers for one step: each layer's three GEMMs replayed from
    their high-precision operands (``lmtrain.analysis.float8.gemm``).

    The forward hook keeps the layer's input (the tensor the layer casts: the autocast copy under ``*-mixed``)
    until the gradient of the layer's output arrives, which replays all three GEMMs (the weight has not changed
    in between); without gradients the forward hook replays ``output`` at once. Each layer is replayed once per
    step: a forward run again by activation checkpointing, or a later micro-batch, is ignored. The hooks run
    eagerly under ``torch.compile``, but compiled code skips module hooks added after its first call (dynamo does
    not guard on them): on a compiled module run the probed step under ``torch.compiler.set_stance("force_eager")``,
    as ``PrecisionInspector`` does.

    Args:
        module: the module whose float8 layers are probed (``lmtrain.float8.float8_linears``).
        scale_factors: layer path -> factor multiplying that layer's replayed scales (a test of the warning).
    """

    def __init__(self, module: torch.nn.Module, scale_factors: dict[str, float] | None = None) -> None:
        self.layers = float8_linears(module)
        self.scale_factors = dict(scale_factors or {})
        self._handles: list[Any] = []
        #: Layers whose weight arrived already in float8 (FSDP2's float8 all-gather): the replay's weight operand is
        #: that float8 weight, dequantised, so the weight's own cast error is not in the replay.
        self.gathered: set[str] = set()
        self._inputs: dict[str, torch.Tensor] = {}
        self._raw: dict[str, dict[str, dict[str, Any]]] = {}

    def install(self) -> None:
        for path, layer in self.layers.items():
            self._handles.append(layer.register_forward_hook(functools.partial(self._forward, path)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._inputs.clear()

    def results(self, step: int) -> list[f8.Float8LayerStats]:
        """The replayed GEMMs as numbers, one entry per layer that ran, in module order."""
        return [f8.Float8LayerStats(path, step, {name: f8.to_gemm_stats(self._raw[path][name])
                                                 for name in f8.GEMMS if name in self._raw[path]})
                for path in self.layers if self._raw.get(path)]

    def _replay(self, path: str, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        specs = gemm_specs(self.layers[path].config)[name]
        if specs is not None:
            self._raw.setdefault(path, {})[name] = f8.gemm(a, b, *specs, self.scale_factors.get(path, 1.0))

    @torch.compiler.disable
    def _forward(self, path: str, layer: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        if path in self._raw:
            return
        if _gathered_float8(layer.weight):
            self.gathered.add(path)
        x = args[0]
        # The cast Float8Linear.forward makes before its GEMM: under CUDA autocast only (torchao reads the CUDA
        # autocast state and dtype; under CPU autocast its input stays as it comes)
        if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
            x = x.to(torch.get_autocast_dtype("cuda"))
        x = x.detach().reshape(-1, x.shape[-1])  # (M, K)
        self._raw[path] = {}
        if not output.requires_grad:  # no backward pass: replay now (no checkpointing without gradients)
            self._replay(path, "output", x, _high_precision(layer.weight).t())
            return
        # Replayed when the gradient arrives: inside a selectively checkpointed block a product computed here
        # would enter the checkpoint's cache of saved outputs, which the recomputation (skipped here) then
        # misreads. The weight is read again then too (FSDP2 frees the gathered weight after the forward).
        self._inputs[path] = x
        output.register_hook(functools.partial(self._backward, path, layer))

    @torch.compiler.disable
    def _backward(self, path: str, layer: torch.nn.Module, grad: torch.Tensor) -> None:
        x = self._inputs.pop(path, None)
        if x is None:
            return
        go = grad.detach().reshape(-1, grad.shape[-1])  # (M, N)
        weight = _high_precision(layer.weight)  # (N, K): the forward's values (no update has run yet)
        self._replay(path, "output", x, weight.t())
        self._replay(path, "grad_input", go, weight)
        self._replay(path, "grad_weight", go.t(), x)


def _compiled(module: torch.nn.Module) -> bool:
    """``module`` or one of its submodules is compiled (``nn.Module.compile`` or ``config.compile``)."""
    if getattr(getattr(module, "config", None), "compile", False) is True:
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in module.modules())


def _gathered_float8(weight: torch.Tensor) -> bool:
    """The weight is already a float8 tensor (torchao's ``Float8TrainingTensor``: FSDP2's float8 all-gather casts
    each shard before gathering it)."""
    return callable(getattr(weight, "to_original_precision", None))


def _high_precision(weight: torch.Tensor) -> torch.Tensor:
    """The weight's values in high precision (2-D, (N, K)); under FSDP2's float8 all-gather the gathered weight is
    already float8, and is dequantised: the replay then casts values that are float8 already, so the weight's own
    cast error is invisible (``Float8Probe.gathered`` names such layers)."""
    return (weight.to_original_precision() if _gathered_float8(weight) else weight).detach()
