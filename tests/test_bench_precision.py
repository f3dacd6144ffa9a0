"""``python -m lmtrain bench precision`` on CPU: the accumulation table matches known float arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmtrain.bench.precision import accumulate, accumulation_rows, inspect_toy
from lmtrain.cli import main


def test_accumulation_facts() -> None:
    rows = {(r["accumulator"], r["addend"]): r for r in accumulation_rows(10_000, 0.01, "cpu")}
    # fp16 stalls where half its spacing (2^-5 / 2 at 32) exceeds the addend; bf16 (8 significant bits) at 4
    assert rows[("float16", "float16")]["result"] == 32.0
    assert rows[("float16", "float32")]["result"] == 32.0
    assert rows[("bfloat16", "bfloat16")]["result"] == 4.0
    assert rows[("bfloat16", "float32")]["result"] == 4.0
    # fp32 accumulator: the same rounding as NumPy's float32 loop, close to 100
    s = np.float32(0.0)
    for _ in range(10_000):
        s = np.float32(s + np.float32(0.01))
    assert rows[("float32", "float32")]["result"] == float(s)
    assert abs(rows[("float32", "float32")]["result"] - 100) < 0.01
    # fp32 accumulator of a 16-bit addend: n times the stored addend; the explicit conversion changes nothing
    fp16_sum = rows[("float32", "float16")]
    assert fp16_sum["result"] == rows[("float32", "float16 -> float32")]["result"]
    assert fp16_sum["addend_stored"] == 0.01000213623046875
    assert fp16_sum["result"] == pytest.approx(fp16_sum["n_times_stored"], abs=0.01)
    bf16_sum = rows[("float32", "bfloat16")]
    assert bf16_sum["result"] == rows[("float32", "bfloat16 -> float32")]["result"]
    assert bf16_sum["addend_stored"] == 0.010009765625
    assert bf16_sum["result"] == pytest.approx(100.09765625, abs=0.01)
    assert rows[("float16", "float16")]["abs_error"] == 68.0


def test_accumulate_small() -> None:
    assert accumulate(torch.float16, torch.float16, 4, 0.25) == 1.0


def test_toy_model_dtypes_cpu() -> None:
    r = inspect_toy(torch.bfloat16, "cpu")
    outputs = {m["path"]: m["output_dtypes"] for m in r.modules}
    assert outputs["fc1"] == ["bfloat16"] and outputs["fc2"] == ["bfloat16"] and outputs["relu"] == ["bfloat16"]
    assert r.logits_dtype == "bfloat16" and r.loss_dtype == "float32"
    assert {p["dtype"] for p in r.parameters} == {"float32"} and {g["dtype"] for g in r.grads} == {"float32"}
    assert {s["key"] for s in r.optimizer_state} == {"exp_avg", "exp_avg_sq", "step"}


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    assert main(["bench", "precision", "--device", "cpu", "--n", "2000", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| float16     | float16 " in text and "ToyModel" in text and "autocast bf16" in text
    data = json.loads(out.read_text())
    assert data["n"] == 2000 and len(data["accumulation"]) == 9 and set(data["toy"]) == {"fp16", "bf16"}
    rows = {(r["accumulator"], r["addend"]): r["result"] for r in data["accumulation"]}
    assert rows[("float16", "float16")] < 20 < rows[("float32", "float32")]  # exact sum: 20


def test_cli_rejects_missing_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    assert main(["bench", "precision", "--device", "cuda"]) == 2
    assert "error: --device" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "field"), [(["--device", "bogus"], "--device"), (["--value", "0"], "--value"),
                                             (["--value", "nan"], "--value")])
def test_cli_refuses_what_it_cannot_measure(args: list[str], field: str, capsys: pytest.CaptureFixture[str]) -> None:
    """One line and exit 2 (a traceback before): a device torch does not know, a value the relative errors divide
    by."""
    assert main(["bench", "precision", *args]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {field}:")


def test_cli_writes_into_a_folder_it_creates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "new" / "p.json"
    assert main(["bench", "precision", "--device", "cpu", "--n", "10", "--no-toy", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["n"] == 10
