"""Mixed-precision facts: summing 0.01 ten thousand times in fp32, fp16, bf16 and mixed; ToyModel dtypes under autocast.

Accumulation: an accumulator starts at 0 and ``value`` (0.01) is added ``n`` (10000) times with in-place
``+=`` on the chosen device, one tensor operation per addition, as a training loop would. Each row names
the accumulator dtype and the addend's dtype (``-> float32`` when the addend is converted explicitly
before each addition). The table shows the result, its error against the exact sum (``n * value`` = 100),
and ``n`` times the addend *as stored* in its dtype (0.01 is not exact in any binary format), which
separates the addend's rounding from the accumulator's. What it shows:

* an fp16 accumulator stops growing once half its spacing exceeds the addend: at 32 (spacing 2^-5);
  bf16 (8 significant bits) stops at 4; the addend's width does not help, the accumulator's does;
* an fp32 accumulator is off by about 3e-3 from its own rounding; with fp16 or bf16 addends the sum
  is n times the stored addend (100.021 and 100.098: the addend's rounding, not the accumulator's),
  and converting the addend explicitly changes nothing because the conversion is exact.

ToyModel (``--toy``, on by default): the ``fc1 -> relu -> layernorm -> fc2`` model of the course's mixed-
precision exercise run once under fp16 and bf16 autocast on the device, with ``lmtrain.callbacks.precision``'s
recorder: the dtypes of the parameters, each layer's output, the logits, the loss, the gradients and AdamW's
state. On CUDA, ``layer_norm`` is on autocast's fp32 list; on CPU it is not, and the table shows it.

Prints Markdown tables; ``--out`` writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lmtrain.analysis.dtypes import PrecisionReport, dtype_name, grad_entries, optimizer_entries, parameter_entries
from lmtrain.analysis.tables import markdown_table
from lmtrain.callbacks.dtype_recorder import DtypeRecorder
from lmtrain.errors import LmtrainError

#: (accumulator dtype, addend dtype, convert the addend to the accumulator's dtype before each addition)
VARIANTS: list[tuple[torch.dtype, torch.dtype, bool]] = [
    (torch.float32, torch.float32, False),
    (torch.float16, torch.float16, False),
    (torch.float32, torch.float16, False),
    (torch.float32, torch.float16, True),
    (torch.float16, torch.float32, False),
    (torch.bfloat16, torch.bfloat16, False),
    (torch.float32, torch.bfloat16, False),
    (torch.float32, torch.bfloat16, True),
    (torch.bfloat16, torch.float32, False),
]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--n", type=int, default=10_000, help="number of additions (default 10000)")
    parser.add_argument("--value", type=float, default=0.01, help="the addend (default 0.01)")
    parser.add_argument("--toy", action=argparse.BooleanOptionalAction, default=True,
                        help="also print the ToyModel dtype table under fp16 and bf16 autocast (default on)")
    parser.add_argument("--out", default=None, help="write all results as JSON to this file")


def accumulate(acc_dtype: torch.dtype, value_dtype: torch.dtype, n: int, value: float = 0.01,
               device: str | torch.device = "cpu", convert: bool = False) -> float:
    """Add ``value`` (stored in ``value_dtype``) ``n`` times to a zero accumulator of ``acc_dtype``, in place.

    Args:
        acc_dtype: accumulator dtype (``+=`` keeps it).
        value_dtype: dtype the addend is stored in.
        n: number of additions.
        value: the addend.
        device: where the tensors live.
        convert: convert the addend to ``acc_dtype`` before each addition (``x.to(acc_dtype)``).

    Returns:
        The final accumulator value as a Python float.
    """
    acc = torch.zeros((), dtype=acc_dtype, device=device)
    x = torch.tensor(value, dtype=value_dtype, device=device)
    for _ in range(n):
        acc += x.to(acc_dtype) if convert else x
    return float(acc.item())


def accumulation_rows(n: int = 10_000, value: float = 0.01, device: str | torch.device = "cpu") -> list[dict[str, Any]]:
    """One dict per variant of ``VARIANTS``: dtypes, result, error against ``n * value``, ``n`` x stored addend."""
    exact = n * value
    rows = []
    for acc_dtype, value_dtype, convert in VARIANTS:
        result = accumulate(acc_dtype, value_dtype, n, value, device, convert)
        stored = torch.tensor(value, dtype=value_dtype).double().item()
        rows.append({
            "accumulator": dtype_name(acc_dtype),
            "addend": dtype_name(value_dtype) + (f" -> {dtype_name(acc_dtype)}" if convert else ""),
            "result": result, "abs_error": abs(result - exact), "rel_error": abs(result - exact) / abs(exact),
            "addend_stored": stored, "n_times_stored": n * stored,
        })
    return rows


def accumulation_markdown(rows: list[dict[str, Any]], n: int, value: float) -> str:
    body = [[str(i + 1), r["accumulator"], r["addend"], f"{r['result']:.6f}", f"{r['abs_error']:.6f}",
             f"{r['rel_error']:.2e}", f"{r['addend_stored']:.10g}", f"{r['n_times_stored']:.6f}"]
            for i, r in enumerate(rows)]
    return markdown_table(["#", "accumulator", "addend", "result", f"|error| vs {n * value:g}", "rel. error",
                           "addend as stored", "n × stored addend"], body)


class ToyModel(nn.Module):
    """The course's mixed-precision toy model: fc1 -> relu -> layer norm -> fc2 (no biases)."""

    def __init__(self, in_features: int = 20, out_features: int = 5) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.ln(self.relu(self.fc1(x))))


def inspect_toy(dtype: torch.dtype, device: str | torch.device = "cpu", seed: int = 0) -> PrecisionReport:
    """One training step of ``ToyModel`` under ``dtype`` autocast with AdamW; every dtype recorded."""
    device = torch.device(device)
    torch.manual_seed(seed)
    model = ToyModel().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 20, device=device)
    y = torch.randint(0, 5, (8,), device=device)
    with DtypeRecorder(model, device.type) as rec:
        with torch.autocast(device.type, dtype=dtype):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        loss.backward()
        autocast, ac_dtype = rec.autocast_state()
        report = PrecisionReport(
            precision=f"autocast {dtype_name(dtype)}", device_type=device.type, autocast=autocast,
            autocast_dtype=dtype_name(ac_dtype) if autocast else None,
            compute_dtype=dtype_name(ac_dtype if autocast else torch.float32),
            parameters=parameter_entries(model), modules=rec.module_entries(ac_dtype or torch.float32),
            logits_module="(root)", logits_dtype=dtype_name(logits.dtype), loss_dtype=dtype_name(loss.dtype),
            grads=grad_entries(model))
    opt.step()
    report.optimizer_state = optimizer_entries([opt], model)
    return report


def toy_markdown(reports: dict[str, PrecisionReport]) -> str:
    """One table: rows = the questions of the course's mixed-precision exercise, one column per autocast dtype;
    flags with reasons below."""
    names = list(reports)

    def module(rep: PrecisionReport, path: str) -> str:
        m = next((m for m in rep.modules if m["path"] == path), None)
        return ", ".join(m["output_dtypes"]) + (" ⚑" if m["flagged"] else "") if m else "-"

    def uniq(values: list[str]) -> str:
        return ", ".join(sorted(set(values))) or "-"

    rows = [["parameters", *[uniq([p["dtype"] for p in r.parameters]) for r in reports.values()]]]
    for path in ("fc1", "relu", "ln", "fc2"):
        rows.append([f"output of {path}", *[module(r, path) for r in reports.values()]])
    rows.append(["logits", *[r.logits_dtype or "-" for r in reports.values()]])
    rows.append(["loss", *[r.loss_dtype or "-" for r in reports.values()]])
    rows.append(["gradients", *[uniq([g["dtype"] for g in r.grads]) for r in reports.values()]])
    for key in ("exp_avg", "exp_avg_sq", "step"):
        rows.append([f"AdamW {key}", *[uniq([s["dtype"] for s in r.optimizer_state if s["key"] == key])
                                       for r in reports.values()]])
    text = markdown_table(["ToyModel", *[f"autocast {n}" for n in names]], rows)
    flags = [f"- {n}: `{m['path']}` ({m['type']}) -> {', '.join(m['output_dtypes'])}: {m['reason']}"
             for n, r in reports.items() for m in r.flagged]
    if flags:
        text += "\n\n⚑ wider than the autocast dtype:\n" + "\n".join(flags)
    return text


def run(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise LmtrainError("--device", "CUDA was asked for but no CUDA device is visible.", "use --device cpu.")
    if args.n < 1:
        raise LmtrainError("--n", f"must be at least 1, got {args.n}.", "use e.g. --n 10000.")
    try:
        torch.device(device)
    except RuntimeError:
        raise LmtrainError("--device", f"{device!r} is no device torch knows.", "use --device cpu or cuda.") from None
    if not (args.value != 0 and math.isfinite(args.value)):
        raise LmtrainError("--value", f"must be a finite number other than 0 (the errors are relative to n x value), "
                           f"got {args.value}.", "use e.g. --value 0.01.")
    if args.out:
        from lmtrain.errors import check_writable_folder

        check_writable_folder("--out", Path(args.out).resolve().parent)
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    rows = accumulation_rows(args.n, args.value, device)
    print(f"## Summing {args.value:g} {args.n} times (exact: {args.n * args.value:g}) on {where}\n")
    print(accumulation_markdown(rows, args.n, args.value))
    result: dict[str, Any] = {"device": where, "torch": torch.__version__, "n": args.n, "value": args.value,
                              "accumulation": rows}
    if args.toy:
        reports = {name: inspect_toy(_DTYPES[name], device) for name in ("fp16", "bf16")}
        print(f"\n## ToyModel dtypes under autocast on {where}\n")
        print(toy_markdown(reports))
        result["toy"] = {name: json.loads(rep.to_json()) for name, rep in reports.items()}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {args.out}")
    return 0
