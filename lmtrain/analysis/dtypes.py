"""Dtype reports: what one training step ran in which dtype, why wider outputs are wider, and the numerics.

Pure functions and records behind ``PrecisionInspector`` (which captures them with forward hooks) and
``python -m lmtrain bench precision``: dtype names and widths, the reason a module's output is wider than
the compute dtype, entries for parameters, gradients and optimizer state, and :class:`PrecisionReport`
(Markdown for people, JSON for files). Nothing here installs hooks or imports Lightning.

Parameters may be sharded ``DTensor``s (FSDP2): their ``dtype`` is the local shard's, read without
gathering anything.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn

from lmtrain.analysis.tables import markdown_table

__all__ = [
    "AUTOCAST_FP32_MODULES",
    "ModuleCall",
    "PrecisionReport",
    "compare",
    "dtype_name",
    "first_float_tensor",
    "grad_entries",
    "module_entries",
    "optimizer_entries",
    "parameter_entries",
    "path_pattern",
    "tensors",
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


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of lists, tuples and dicts (a module's args, kwargs or output)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors(o)


def first_float_tensor(obj: Any) -> torch.Tensor | None:
    """The first floating-point tensor in a nest (the logits of a module's output)."""
    return next((t for t in tensors(obj) if t.is_floating_point()), None)



@dataclass
class ModuleCall:
    """What the forward hooks saw of one module path in one step."""

    type: str
    module_path: str  # the class's module (lmtrain.model, torch.nn.modules.linear ...)
    calls: int = 0
    in_dtypes: list[torch.dtype] = field(default_factory=list)
    out_dtypes: list[torch.dtype] = field(default_factory=list)
    autocast: bool = False
    autocast_dtype: torch.dtype | None = None
    param_dtypes: list[torch.dtype] = field(default_factory=list)


def module_entries(calls: dict[str, ModuleCall], order: list[str], compute_dtype: torch.dtype) -> list[dict[str, Any]]:
    """One entry per module path, in call order: type, calls, dtypes, flagged (wider than compute), reason."""
    entries, source = [], None
    for path in order:
        c = calls[path]
        out = _widest(c.out_dtypes)
        widest_in = _widest(c.in_dtypes)
        flagged = _wider(out, compute_dtype)
        reason = ""
        if flagged:
            reason = _reason(c, out, widest_in, compute_dtype, source)
            if not _wider(widest_in, compute_dtype) and source is None:
                source = path or "(root)"
        entries.append({
            "path": path or "(root)", "type": c.type, "calls": c.calls,
            "input_dtypes": [dtype_name(d) for d in c.in_dtypes],
            "output_dtypes": [dtype_name(d) for d in c.out_dtypes],
            "flagged": flagged, "reason": reason,
        })
    return entries


def _reason(c: ModuleCall, out: torch.dtype, widest_in: torch.dtype | None, compute: torch.dtype,
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



def parameter_entries(module: nn.Module, compute: dict[str, torch.dtype] | None = None) -> list[dict[str, Any]]:
    """Path, storage (master) dtype, global shape and element count of every parameter.

    A sharded parameter (a ``DTensor``, FSDP2) also gets ``local_shape`` and ``local_numel``, this rank's shard
    (``to_local()``, no communication). With ``compute`` (parameter path -> the dtype its module saw while it
    ran, e.g. ``DtypeRecorder.param_compute``) each entry seen there gets ``compute_dtype``: under FSDP2's
    mixed precision the fp32 master shards are all-gathered in bf16, and the modules compute with those.
    """
    out = []
    for n, p in module.named_parameters():
        entry: dict[str, Any] = {"path": n, "dtype": dtype_name(p.dtype), "shape": list(p.shape), "numel": p.numel()}
        local = p.to_local() if callable(getattr(p, "to_local", None)) else None
        if local is not None:
            entry.update(local_shape=list(local.shape), local_numel=local.numel())
        if compute and n in compute:
            entry["compute_dtype"] = dtype_name(compute[n])
        out.append(entry)
    return out


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
        lines = [f"## Dtypes in one training step{f' (step {self.step})' if self.step is not None else ''}",
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
        compute = Counter(p["compute_dtype"] for p in self.parameters if "compute_dtype" in p)
        sharded = sum(1 for p in self.parameters if "local_shape" in p)
        if compute and set(compute) != set(param_dtypes):
            qa.append(["parameters (compute: as the modules saw them)", _counts(compute),
                       "sharded master weights are all-gathered in this dtype (FSDP2 MixedPrecisionPolicy)"])
        if sharded:
            qa.append(["sharded parameters (DTensor)", f"{sharded} of {len(self.parameters)}",
                       "each rank stores a shard of the master weights (local_shape in the JSON file)"])
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
