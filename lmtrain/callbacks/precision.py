"""PrecisionInspector: the dtype of everything in one training step, and how far mixed precision moves the result.

For one chosen training step the callback records, under the trainer's precision (autocast or not):

* the storage dtype of every parameter;
* the output dtype of every module, by module path (forward hooks installed for that step only and removed
  right after), with the input dtypes beside it;
* the logits (the output of ``logits_module``, by default the outermost submodule that ran) and the loss
  (the tensor handed to ``on_before_backward``);
* every gradient after backward, and the optimizer state after the optimizer step (``exp_avg``,
  ``exp_avg_sq``, ``step`` for AdamW);
* numerics: the same batch's logits and loss recomputed in fp32 (autocast disabled, same weights, no
  gradients) and compared with the step's own.

Modules whose output is wider than the compute dtype (the autocast dtype, or the parameters' dtype without
autocast) are flagged with the reason, found from what was observed rather than assumed:

* lmtrain's ``RMSNorm`` computes in fp32 by design and returns its input's dtype;
* an op that autocast runs in fp32 (``layer_norm``, ``softmax``, ``cross_entropy`` ... on CUDA; the
  lists differ per device) widens a narrower input;
* a module that is not an autocast op (``nn.Embedding``) runs in its parameters' dtype, and parameters are
  fp32 under mixed precision;
* a module whose input is already wide keeps it (the residual stream stays fp32 once an fp32 tensor
  enters it: bf16 + fp32 promotes to fp32); the report names the module where the widening started.

Every metric the callback logs, with its unit, is listed in the docstring of :class:`PrecisionInspector`;
it also writes ``precision/report`` (Markdown: answers, grouped tables, flags) and ``precision_step{N}.json``
in the log dir (every parameter, module, gradient and optimizer-state entry, ungrouped).

The fp32 reference needs fp32 parameter storage (mixed precision or ``32-true``); with ``bf16-true`` or
``16-true`` storage it is skipped with a note. Dropout or other randomness in the model makes the
comparison meaningless; lmtrain's model has none.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lmtrain.callbacks._common import StepWindow, WarnOnce, check_int, log_dir, log_scalars, log_text, markdown_table

__all__ = [
    "AUTOCAST_FP32_MODULES",
    "DtypeRecorder",
    "PrecisionInspector",
    "PrecisionReport",
    "dtype_name",
    "grad_entries",
    "optimizer_entries",
    "parameter_entries",
    "path_pattern",
]

#: Module types whose op autocast runs in fp32 on CUDA (``torch.amp`` "ops that can autocast to float32").
#: Used only to word a reason when such a module is seen widening a narrower input; CPU lists differ.
AUTOCAST_FP32_MODULES: dict[str, str] = {
    "LayerNorm": "layer_norm", "GroupNorm": "group_norm", "Softmax": "softmax", "LogSoftmax": "log_softmax",
    "Softmin": "softmin", "CrossEntropyLoss": "cross_entropy", "NLLLoss": "nll_loss", "MSELoss": "mse_loss",
    "L1Loss": "l1_loss", "SmoothL1Loss": "smooth_l1_loss", "KLDivLoss": "kl_div", "Softplus": "softplus",
    "BCEWithLogitsLoss": "binary_cross_entropy_with_logits", "CosineSimilarity": "cosine_similarity",
    "RMSNorm": "rms_norm",
}


def dtype_name(dtype: torch.dtype | None) -> str:
    """``torch.bfloat16`` -> ``bfloat16``; None -> ``-``."""
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _wider(a: torch.dtype | None, b: torch.dtype | None) -> bool:
    """a is a floating dtype with more bytes than floating dtype b."""
    return (a is not None and b is not None and a.is_floating_point and b.is_floating_point
            and _itemsize(a) > _itemsize(b))


def _widest(dtypes: list[torch.dtype]) -> torch.dtype | None:
    floats = [d for d in dtypes if d.is_floating_point]
    return max(floats, key=_itemsize) if floats else None


def path_pattern(path: str) -> str:
    """Module or parameter path with layer indices replaced: ``model.blocks.3.attn`` -> ``model.blocks.{i}.attn``."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "{i}", path)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _first_float_tensor(obj: Any) -> torch.Tensor | None:
    return next((t for t in _tensors(obj) if t.is_floating_point()), None)


@dataclass
class _Call:
    type: str
    module_path: str  # the class's module (lmtrain.model, torch.nn.modules.linear ...)
    calls: int = 0
    in_dtypes: list[torch.dtype] = field(default_factory=list)
    out_dtypes: list[torch.dtype] = field(default_factory=list)
    autocast: bool = False
    autocast_dtype: torch.dtype | None = None
    param_dtypes: list[torch.dtype] = field(default_factory=list)


class DtypeRecorder:
    """Forward hooks on every submodule of ``root`` that record input and output dtypes (and the autocast state).

    Use as a context manager (hooks removed on exit) or call :meth:`install` / :meth:`remove`. The outputs
    and inputs of the outermost modules (depth <= 1) are kept by reference for the logits and the fp32
    reference forward; :meth:`remove` drops them.

    Args:
        root: the module whose submodules are hooked (the root itself too, as path ``""``).
        device_type: ``cuda`` or ``cpu``: whose autocast state to read.
    """

    def __init__(self, root: nn.Module, device_type: str) -> None:
        self.root = root
        self.device_type = device_type
        self.calls: dict[str, _Call] = {}
        self.order: list[str] = []
        self.kept: dict[str, tuple[tuple, dict, Any]] = {}  # path -> (args, kwargs, output), depth <= 1
        self.paused = False
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def install(self) -> None:
        for path, module in self.root.named_modules():
            self._handles.append(module.register_forward_hook(self._hook(path), with_kwargs=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.kept.clear()

    @property
    def installed(self) -> int:
        return len(self._handles)

    def __enter__(self) -> DtypeRecorder:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _hook(self, path: str) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self.paused:
                return
            call = self.calls.get(path)
            if call is None:
                call = self.calls[path] = _Call(type=type(module).__name__, module_path=type(module).__module__)
                call.param_dtypes = sorted({p.dtype for p in module.parameters(recurse=False)}, key=str)
                self.order.append(path)
            call.calls += 1
            for t in _tensors((args, kwargs)):
                if t.dtype not in call.in_dtypes:
                    call.in_dtypes.append(t.dtype)
            for t in _tensors(output):
                if t.dtype not in call.out_dtypes:
                    call.out_dtypes.append(t.dtype)
            call.autocast = torch.is_autocast_enabled(self.device_type)
            call.autocast_dtype = torch.get_autocast_dtype(self.device_type) if call.autocast else None
            if path.count(".") + (path != "") <= 1:
                self.kept[path] = (args, kwargs, output)

        return hook

    def logits_path(self, preferred: str | None = None) -> str | None:
        """The module whose output is the logits: ``preferred`` if given, else the outermost module that ran
        and returned a floating tensor (first in call order among equals)."""
        if preferred is not None:
            return preferred if preferred in self.calls else None
        ran = [p for p in self.order if p in self.kept and _first_float_tensor(self.kept[p][2]) is not None]
        if not ran:
            return None
        return min(ran, key=lambda p: (p.count(".") + (p != ""), self.order.index(p)))

    def autocast_state(self) -> tuple[bool, torch.dtype | None]:
        """(autocast on, its dtype) as seen by the modules (on if any module ran under autocast)."""
        for path in self.order:
            if self.calls[path].autocast:
                return True, self.calls[path].autocast_dtype
        return False, None

    def module_entries(self, compute_dtype: torch.dtype) -> list[dict[str, Any]]:
        """One entry per module path, in call order: type, calls, dtypes, flagged (wider than compute), reason."""
        entries, source = [], None
        for path in self.order:
            c = self.calls[path]
            out = _widest(c.out_dtypes)
            widest_in = _widest(c.in_dtypes)
            flagged = _wider(out, compute_dtype)
            reason = ""
            if flagged:
                reason = self._reason(c, out, widest_in, compute_dtype, source)
                if not _wider(widest_in, compute_dtype) and source is None:
                    source = path or "(root)"
            entries.append({
                "path": path or "(root)", "type": c.type, "calls": c.calls,
                "input_dtypes": [dtype_name(d) for d in c.in_dtypes],
                "output_dtypes": [dtype_name(d) for d in c.out_dtypes],
                "flagged": flagged, "reason": reason,
            })
        return entries

    @staticmethod
    def _reason(c: _Call, out: torch.dtype, widest_in: torch.dtype | None, compute: torch.dtype,
                source: str | None) -> str:
        o, cd = dtype_name(out), dtype_name(compute)
        if c.type == "RMSNorm" and c.module_path.startswith("lmtrain"):
            why = "RMSNorm computes in fp32 by design (lmtrain.model.RMSNorm) and returns its input's dtype"
            if widest_in is not None and not _wider(out, widest_in):
                return why + f"; its input is already {dtype_name(widest_in)}" + (f" (widened from `{source}` on)"
                                                                                  if source else "")
            return why
        if widest_in is not None and not _wider(out, widest_in):
            return (f"keeps its input's dtype, and its input is already {dtype_name(widest_in)}"
                    + (f" (widened from `{source}` on; a {cd} + {o} add promotes to {o})" if source else ""))
        if c.autocast and c.type in AUTOCAST_FP32_MODULES:
            return f"autocast runs this op in fp32 ({AUTOCAST_FP32_MODULES[c.type]} is on autocast's fp32 list)"
        if c.autocast and out in c.param_dtypes:
            return (f"not an op autocast casts, so it runs in its parameters' dtype ({o}): parameters are "
                    f"{o} under mixed precision")
        return f"widens to {o} itself (an explicit cast, or an op autocast runs in fp32 inside it)"


def parameter_entries(module: nn.Module) -> list[dict[str, Any]]:
    """Path, storage dtype, shape and element count of every parameter."""
    return [{"path": n, "dtype": dtype_name(p.dtype), "shape": list(p.shape), "numel": p.numel()}
            for n, p in module.named_parameters()]


def grad_entries(module: nn.Module) -> list[dict[str, Any]]:
    """Path and gradient dtype (``-`` when the gradient is None) of every parameter."""
    return [{"path": n, "dtype": dtype_name(p.grad.dtype if p.grad is not None else None)}
            for n, p in module.named_parameters()]


def optimizer_entries(optimizers: list[torch.optim.Optimizer], module: nn.Module) -> list[dict[str, Any]]:
    """One entry per (parameter, state key): dtype (or Python type) and device of the optimizer's state."""
    names = {id(p): n for n, p in module.named_parameters()}
    out = []
    for opt in optimizers:
        for p, state in opt.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out.append({"path": names.get(id(p), "?"), "key": key, "dtype": dtype_name(value.dtype),
                                "device": value.device.type})
                else:
                    out.append({"path": names.get(id(p), "?"), "key": key, "dtype": type(value).__name__,
                                "device": "python"})
    return out


@dataclass
class PrecisionReport:
    """Everything one inspection found; ``to_markdown()`` for people, ``asdict`` for the JSON file."""

    precision: str
    device_type: str
    autocast: bool
    autocast_dtype: str | None
    compute_dtype: str
    step: int | None = None
    parameters: list[dict[str, Any]] = field(default_factory=list)
    modules: list[dict[str, Any]] = field(default_factory=list)
    logits_module: str | None = None
    logits_dtype: str | None = None
    loss_dtype: str | None = None
    grads: list[dict[str, Any]] = field(default_factory=list)
    optimizer_state: list[dict[str, Any]] = field(default_factory=list)
    numerics: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @property
    def flagged(self) -> list[dict[str, Any]]:
        return [m for m in self.modules if m["flagged"]]

    def module_rows(self) -> list[list[str]]:
        """Modules grouped by (path pattern, type, input dtypes, output dtypes, reason), in call order."""
        groups: dict[tuple, int] = {}
        for m in self.modules:
            key = (path_pattern(m["path"]), m["type"], ", ".join(m["input_dtypes"]) or "-",
                   ", ".join(m["output_dtypes"]) or "-", m["reason"])
            groups[key] = groups.get(key, 0) + 1
        return [[f"`{k[0]}`", k[1], str(n), k[2], k[3] + (" ⚑" if k[4] else ""), k[4]] for k, n in groups.items()]

    def parameter_rows(self) -> list[list[str]]:
        """Parameters grouped by path pattern: count, storage, gradient and optimizer-state dtypes."""
        grads = {g["path"]: g["dtype"] for g in self.grads}
        states: dict[str, dict[str, str]] = defaultdict(dict)
        for s in self.optimizer_state:
            # Name the device only where the state lives elsewhere than the model (AdamW's CPU step counter).
            states[s["path"]][s["key"]] = s["dtype"] + ("" if s["device"] in (self.device_type, "python") else
                                                        f" ({s['device']})")
        keys = sorted({s["key"] for s in self.optimizer_state})
        groups: dict[tuple, list[int]] = {}
        for p in self.parameters:
            key = (path_pattern(p["path"]), p["dtype"], grads.get(p["path"], "-"),
                   *[states.get(p["path"], {}).get(k, "-") for k in keys])
            g = groups.setdefault(key, [0, 0])
            g[0] += 1
            g[1] += p["numel"]
        return [[f"`{k[0]}`", str(n), f"{numel:,}", *k[1:]] for k, (n, numel) in groups.items()]

    def state_keys(self) -> list[str]:
        return sorted({s["key"] for s in self.optimizer_state})

    def to_markdown(self, max_rows: int = 40) -> str:
        ac = f"autocast {self.autocast_dtype} on {self.device_type}" if self.autocast else "no autocast"
        lines = [f"## Dtypes in one training step{f' (batch {self.step})' if self.step is not None else ''}",
                 f"Precision `{self.precision}`: {ac}; compute dtype {self.compute_dtype}.", ""]
        param_dtypes = Counter(p["dtype"] for p in self.parameters)
        grad_dtypes = Counter(g["dtype"] for g in self.grads)
        state = defaultdict(Counter)
        for s in self.optimizer_state:
            state[s["key"]][s["dtype"]] += 1
        first_linear = next((m for m in self.modules if m["type"] == "Linear"), None)
        first_norm = next((m for m in self.modules if "Norm" in m["type"]), None)
        qa = [["parameters (storage)", _counts(param_dtypes),
               "parameters are fp32 under mixed precision; autocast casts copies for each op"
               if self.autocast and "float32" in param_dtypes else ""]]
        if first_linear:
            qa.append([f"first Linear output (`{first_linear['path']}`)", ", ".join(first_linear["output_dtypes"]),
                       "matmuls run in the autocast dtype" if self.autocast else ""])
        if first_norm:
            qa.append([f"first norm output (`{first_norm['path']}`)", ", ".join(first_norm["output_dtypes"]),
                       first_norm["reason"]])
        qa.append([f"logits (`{self.logits_module}`)", self.logits_dtype or "not seen", ""])
        loss_note = ""
        if self.loss_dtype and self.logits_dtype and self.loss_dtype != self.logits_dtype:
            loss_note = ("the loss is computed in fp32 (cross-entropy / log-softmax are on autocast's fp32 list, "
                         "and a loss of logits.float() is fp32)" if self.loss_dtype == "float32" else "")
        qa.append(["loss", self.loss_dtype or "not seen (no backward in this step)", loss_note])
        qa.append(["gradients", _counts(grad_dtypes) or "not seen",
                   "gradients take their parameter's dtype" if grad_dtypes else ""])
        for key in sorted(state):
            qa.append([f"optimizer state `{key}`", _counts(state[key]), ""])
        if not state:
            qa.append(["optimizer state", "not seen", "no optimizer step in this batch (forward-only mode, gradient "
                       "accumulation, or a step skipped by the fp16 GradScaler)"])
        lines += [markdown_table(["what", "dtype", "why"], qa), ""]
        if self.numerics:
            lines.append("**Numerics against an fp32 forward of the same batch** (autocast off, same weights): "
                         + ", ".join(f"{k} = {v:.3g}" for k, v in self.numerics.items()) + ".")
            lines.append("")
        for note in self.notes:
            lines += [f"Note: {note}", ""]
        flagged = self.flagged
        lines.append(f"**Modules with output wider than {self.compute_dtype}:** {len(flagged)} of "
                     f"{len(self.modules)} module paths (⚑ below).")
        lines.append("")
        rows = self.module_rows()
        lines.append("**Module outputs** (layers grouped as `{i}`):")
        lines.append(markdown_table(["module", "type", "count", "input", "output", "why wider"], rows[:max_rows]))
        if len(rows) > max_rows:
            lines.append(f"... {len(rows) - max_rows} more groups in the JSON file.")
        lines.append("")
        prow = self.parameter_rows()
        lines.append("**Parameters, gradients, optimizer state:**")
        lines.append(markdown_table(["parameter", "count", "elements", "storage", "grad", *self.state_keys()],
                                    prow[:max_rows]))
        if len(prow) > max_rows:
            lines.append(f"... {len(prow) - max_rows} more groups in the JSON file.")
        return "\n".join(lines)


def _counts(counter: Counter) -> str:
    return ", ".join(f"{k} ×{n}" if len(counter) > 1 else k for k, n in counter.most_common())


def compare(mixed: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max abs error, relative L2 error) of ``mixed`` against ``reference``, in fp32."""
    a, b = mixed.detach().float(), reference.detach().float()
    diff = a - b
    denom = b.norm().item()
    return diff.abs().max().item(), diff.norm().item() / denom if denom > 0 else float("inf")


class PrecisionInspector(Callback):
    """Record the dtypes of one training step and the error mixed precision adds (see the module docstring).

    Only the inspected batch pays: its forward hooks are installed in its ``on_train_batch_start`` and
    removed at its end (or in ``on_exception``); every other batch costs a counter increment.

    Metrics (TensorBoard scalars at the inspected step's global step; the first three only when the fp32
    reference ran, see the module docstring):

    - ``precision/logits_max_abs_err``: max |logits - logits_fp32|, in logit units (logits cast to fp32).
    - ``precision/logits_rel_err``: ||logits - logits_fp32||_2 / ||logits_fp32||_2, a ratio (no unit).
    - ``precision/loss_abs_err``: |loss - loss_fp32| in the loss's unit (nats for cross-entropy); needs a
      ``loss(batch)`` method on the LightningModule.
    - ``precision/flagged_modules``: count of module paths whose output is wider than the compute dtype.
    - text ``precision/report`` (Markdown); file ``precision_step{N}.json`` in the log dir.

    Args:
        step: the training batch to inspect, counted from 0 at the start of the fit (0: the first step).
            Under ``16-mixed`` the first steps may be skipped by the GradScaler (no optimizer state yet):
            pick a later one there.
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
        self._batch: Any = None
        self._loss_dtype: torch.dtype | None = None
        self._loss: torch.Tensor | None = None
        self._ref: dict[str, Any] = {}
        self._grads: list[dict[str, Any]] = []
        self._stepped = False
        self._done = False
        self.result: PrecisionReport | None = None  # the inspection (for scripts and tests)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return  # validate / test after a fit must not clear that fit's result
        check_int("PrecisionInspector", "step", self.step, 0, fix="use 0 for the first training step.")
        check_int("PrecisionInspector", "max_rows", self.max_rows, 1, fix="use e.g. 40.")
        self._remove()
        self._clear()
        self._window = StepWindow(self.step, 1)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and not self._done and self._window.batches_seen <= self.step:
            self._warn(f"PrecisionInspector: training ended after {self._window.batches_seen} batches, before batch "
                       f"{self.step}; nothing was inspected.")
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
        index = self._window.next_batch()
        if self._done or not self._window.contains(index):
            return
        self._recorder = DtypeRecorder(pl_module, pl_module.device.type)
        self._recorder.install()
        self._batch = batch

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
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
        if self._recorder is not None and not self._grads:
            self._grads = grad_entries(pl_module)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self._recorder is not None:
            self._stepped = True

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._recorder is None:
            return
        try:
            self._recorder.paused = True
            if self.reference and not self._ref and not self._stepped:
                self._reference(pl_module)  # forward-only step: the weights did not change
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                self._loss = loss.detach()  # unscaled (the hook's loss is scaled under 16-mixed)
                self._loss_dtype = self._loss_dtype or loss.dtype
            report = self._build(trainer, pl_module)
            self.result = report
            self._log(trainer, report)
        finally:
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
                ref_logits = _first_float_tensor(module(*args, **kwargs))
                mixed = _first_float_tensor(output)
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
        logits = _first_float_tensor(rec.kept[path][2]) if path in rec.kept else None
        if self.logits_module is not None and path is None:
            self._warn(f"PrecisionInspector: logits_module {self.logits_module!r} did not run in the inspected "
                       "step; logits not reported.")
        report = PrecisionReport(
            precision=str(trainer.precision), device_type=pl_module.device.type, autocast=autocast,
            autocast_dtype=dtype_name(ac_dtype) if autocast else None, compute_dtype=dtype_name(compute),
            step=self.step, parameters=parameter_entries(pl_module), modules=rec.module_entries(compute),
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
        step = trainer.global_step
        metrics = {f"precision/{k}": v for k, v in report.numerics.items()}
        metrics["precision/flagged_modules"] = float(len(report.flagged))
        log_scalars(trainer, metrics, step)
        log_text(trainer, "precision/report", report.to_markdown(self.max_rows), step)
        out_dir = log_dir(trainer)
        if out_dir and trainer.global_rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, f"precision_step{self.step}.json"), "w") as f:
                f.write(report.to_json())
