"""``python -m lmtrain bench optimizer``: rows, byte counts and refusals on the CPU; the kernel rows on a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmtrain.bench.optimizer import ADAMW_BYTES, COPY_BYTES, MASTER_BYTES, build_model
from lmtrain.cli import main
from lmtrain.config import ModelConfig
from lmtrain.flops import parameter_count


def test_counts_the_models_parameters() -> None:
    model = build_model("tiny", 300, torch.device("cpu"))
    assert sum(p.numel() for p in model.parameters()) == parameter_count(ModelConfig.from_size("tiny", vocab_size=300))


def test_runs_on_cpu_and_counts_the_bytes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "optim.json"
    assert main(["bench", "optimizer", "--size", "tiny", "--vocab-size", "300", "--steps", "2", "--warmup", "1",
                 "--state-dtypes", "float32,bfloat16", "--allow-cpu", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    numel = parameter_count(ModelConfig.from_size("tiny", vocab_size=300))
    assert record["parameters"] == numel
    rows = {r["name"]: r for r in record["rows"]}
    assert list(rows) == ["copy", "adamw", "master", "master, bfloat16 state"]
    assert rows["master"]["kernel"] == "torch operations" and rows["adamw"]["kernel"] == "foreach"
    # compact state: 18 bytes per linear weight, 28 for the fp32 embedding and gains
    model = build_model("tiny", 300, torch.device("cpu"))
    fp32 = model.embedding.weight.numel() + sum(p.numel() for p in model.parameters() if p.ndim == 1)
    assert 0 < fp32 < numel
    bf16_bytes = ((numel - fp32) * MASTER_BYTES["bfloat16"] + fp32 * ADAMW_BYTES) / numel
    for name, per_param in (("copy", COPY_BYTES), ("adamw", ADAMW_BYTES), ("master", MASTER_BYTES["float32"]),
                            ("master, bfloat16 state", bf16_bytes)):
        row = rows[name]
        assert row["gbytes"] == pytest.approx(numel * per_param / 1e9)
        assert len(row["steps_ms"]) == 2 and all(t > 0 for t in row["steps_ms"])
        assert row["gb_per_s"] == pytest.approx(row["gbytes"] / row["ms"] * 1e3)
    text = capsys.readouterr().out
    assert "| master" in text and "of copy" in text and "100%" in text  # the copy row is its own reference


@pytest.mark.parametrize(("argv", "option"), [
    (["--blocks", "3000"], "--blocks/--warps"),
    (["--warps", "3"], "--blocks/--warps"),
    (["--blocks", "x"], "--blocks"),
    (["--blocks", ""], "--blocks/--warps"),
    (["--only", "sgd"], "--only"),
    (["--state-dtypes", "fp8"], "--state-dtypes"),
    (["--size", "huge"], "--size"),
    (["--steps", "0"], "--steps"),
])
def test_bad_options_are_refused_with_one_line(argv: list[str], option: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "optimizer", "--size", "tiny", "--allow-cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {option}: ") and "Fix:" in err and err.count("\n") == 1


def test_refuses_without_gpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "optimizer", "--size", "tiny"]) == 2
    assert capsys.readouterr().err.startswith("error: device: ")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_rows_on_a_gpu(tmp_path: Path) -> None:
    out = tmp_path / "optim.json"
    assert main(["bench", "optimizer", "--size", "tiny", "--steps", "2", "--warmup", "1", "--only", "master",
                 "--blocks", "1024,4096", "--warps", "4", "--state-dtypes", "float32,bfloat16", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["kernel"] for r in rows] == ["Triton, block 1024, 4 warps", "Triton, block 4096, 4 warps"] * 2
    assert [r["name"] for r in rows] == ["master"] * 2 + ["master, bfloat16 state"] * 2
