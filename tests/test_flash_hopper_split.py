"""The TMA forward's split head dims (``flash_triton_hopper.split_head_dim``, ``LMTRAIN_FLASH_TMA_SPLIT=1``): the
rule, and the kernel against a float64 reference under Triton's interpreter (on a Hopper GPU the same cases run in
``test_flash_attention.py::test_gpu_tma_path_matches_reference``).

``usable`` never picks the TMA kernels under the interpreter, so the interpreted case launches the module's
``forward`` directly, in a fresh process (the interpreter is chosen when Triton is first imported), in fp16 (the
interpreter's bf16 arithmetic is not the GPU's).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

# (N_q, N_k, head dim, causal): split dims 80, 48, 96, 72 and an unsplit 64; odd lengths, N_q != N_k both ways.
CASES = [(97, 97, 80, True), (130, 130, 80, False), (70, 130, 48, True), (130, 70, 96, False),
         (33, 33, 72, True), (97, 97, 64, True)]

_SCRIPT = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
sys.path.insert(0, sys.argv[1])
from lmtrain.kernels import flash_triton as ft, flash_triton_hopper as hop
torch.manual_seed(0)
results = []
for n_q, n_k, d, causal in eval(sys.argv[3]):
    q, k, v = (torch.randn(1, 2, n, d, dtype=torch.float16) for n in (n_q, n_k, n_k))
    o, lse = torch.full_like(q, float("nan")), torch.full((2, n_q), float("nan"))  # poisoned
    consts = dict(HEAD_DIM=d, BLOCK_D=ft._block_d(d), IS_CAUSAL=causal, DOT_PRECISION="tf32")
    hop.forward(q, k, v, o, lse, consts, (ft._n_key(n_q, n_k), d, causal, "tf32", q.dtype))
    results.append((q, k, v, o, lse))
torch.save(results, sys.argv[2])
"""


@pytest.mark.parametrize(("d", "tiles"), [(80, (64, 16)), (96, (64, 32)), (48, (32, 16)), (72, (64, 16)),
                                         (40, (32, 16)), (64, (64, 0)), (128, (128, 0)), (112, (128, 0)),
                                         (24, (32, 0)), (16, (16, 0))])
def test_split_rule(d: int, tiles: tuple[int, int]) -> None:
    from lmtrain.kernels.flash_triton_hopper import split_head_dim

    assert split_head_dim(d) == tiles
    first, second = tiles
    assert first + second >= d and (second == 0 or second >= 16)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its interpreter on CPU)")
def test_split_forward_matches_float64_reference_under_the_interpreter(tmp_path: Path) -> None:
    out = tmp_path / "results.pt"
    root = str(Path(__file__).resolve().parents[1])
    subprocess.run([sys.executable, "-c", _SCRIPT, root, str(out), repr(CASES)], check=True, timeout=600,
                   env={**os.environ, "TRITON_INTERPRET": "1", "LMTRAIN_FLASH_TMA_SPLIT": "1"})  # opt-in split
    for (n_q, n_k, d, causal), (q, k, v, o, lse) in zip(CASES, torch.load(out), strict=True):
        scores = (q.double() @ k.double().transpose(-1, -2)) * d**-0.5
        if causal:  # top-left aligned
            scores = scores.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.softmax(scores, -1) @ v.double()
        name = f"N_q {n_q} N_k {n_k} d {d} causal {causal}"
        assert not o.isnan().any() and not lse.isnan().any(), name  # every element written
        torch.testing.assert_close(o.double(), ref, rtol=0, atol=5e-3, msg=name)  # fp16 output: ~1e-3
        torch.testing.assert_close(lse.double().view(1, 2, n_q), torch.logsumexp(scores, -1), rtol=0, atol=1e-5,
                                   msg=name)
