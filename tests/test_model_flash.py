"""The model with each FlashAttention backend computes what it computes with the naive backend.

``flash_triton`` runs on CPU only under Triton's interpreter, which is chosen when the kernels are
first decorated (at import). The interpreter case therefore runs in a fresh subprocess with
``TRITON_INTERPRET=1`` that writes its logits and gradients to a file; the comparison happens here.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmtrain.config import ModelConfig
from lmtrain.model import TransformerLM

ROOT = Path(__file__).resolve().parents[1]
# Head dim 80 (the 2.7B model's, not a power of two), an odd sequence length, two layers.
CFG = dict(vocab_size=97, context_length=64, d_model=160, num_layers=2, num_heads=2, d_ff=96)
SEQ = 37


def logits_and_grads(attention: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(attention=attention, **CFG)).to(device=device, dtype=dtype)
    tokens = torch.randint(0, CFG["vocab_size"], (3, SEQ), generator=torch.Generator().manual_seed(1)).to(device)
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    out = {"logits": logits.detach().float().cpu()}
    out.update({name: p.grad.float().cpu() for name, p in model.named_parameters()})
    return out


def assert_close_to(got: dict, want: dict, rtol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        err = (got[name] - want[name]).norm() / want[name].norm()
        assert torch.isfinite(got[name]).all(), name
        assert err < rtol, f"{name}: relative error {err:.2e}"


def test_flash_pytorch_model_equals_naive() -> None:
    assert_close_to(logits_and_grads("flash_pytorch"), logits_and_grads("naive"), rtol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its CPU interpreter)")
def test_flash_triton_model_equals_naive_interpreted(tmp_path: Path) -> None:
    out = tmp_path / "flash_triton.pt"
    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[2]); import test_model_flash as t; "
        "torch.save(t.logits_and_grads('flash_triton'), sys.argv[1])"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code, str(out), str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_close_to(torch.load(out), logits_and_grads("naive"), rtol=1e-5)


@pytest.mark.gpu
def test_flash_triton_model_equals_naive_cuda_fp32() -> None:
    assert_close_to(logits_and_grads("flash_triton", "cuda"), logits_and_grads("naive", "cuda"), rtol=1e-5)


@pytest.mark.gpu
def test_flash_triton_model_bf16_as_accurate_as_naive_bf16() -> None:
    """In bf16 both backends round; flash must be no less accurate than naive, against fp32 naive."""
    want = logits_and_grads("naive", "cuda", torch.float32)
    naive = logits_and_grads("naive", "cuda", torch.bfloat16)
    flash = logits_and_grads("flash_triton", "cuda", torch.bfloat16)
    for name in want:
        err_naive = (naive[name] - want[name]).norm() / want[name].norm()
        err_flash = (flash[name] - want[name]).norm() / want[name].norm()
        assert err_flash <= 2 * err_naive + 1e-3, f"{name}: flash {err_flash:.2e} vs naive {err_naive:.2e}"
