"""The TMA kernels' split head dims (``flash.tma.split_head_dim``, setting ``tma_split_head_dim``): the
rule, and the forward, dQ and dK/dV kernels, split and padded, against the float64 reference of
``test_flash_attention`` under Triton's interpreter (on a Hopper GPU the same kernels run in
``test_flash_attention.py::test_gpu_tma_path_matches_reference``).

``usable`` never picks the TMA kernels under the interpreter, so the interpreted cases launch the module's
``forward`` and ``backward`` directly, all in ONE fresh process (the interpreter is chosen when Triton is first
imported): this file run as a script, which receives the inputs from this process and sends back the raw outputs.
They run in fp16 (the interpreter's bf16 arithmetic is not the GPU's) and fp32, which never takes the TMA path on a
GPU but checks the tiling here with less rounding in the way.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from test_flash_attention import _inputs, _reference_results, assert_matches_reference, run_interpreter_worker

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
SPLIT_SETTINGS = ("0", "1")  # tma_split_head_dim off (one padded tile) or on (split)

# (label, q shape, k shape, dtype, causal): split head dims 80 (64 + 16), 48 (32 + 16), 96 (64 + 32), 72 (64 + 16)
# and an unsplit 64 as a control; N 97/130/33, N_q != N_k both ways, a fused-qkv view for v.
CASES = [
    ("n97_d80", (1, 2, 97, 80), (1, 2, 97, 80), torch.float16, True),
    ("n130_d80", (1, 2, 130, 80), (1, 2, 130, 80), torch.float16, False),
    ("nq70_nk130_d80", (1, 1, 70, 80), (1, 1, 130, 80), torch.float16, True),
    ("nq130_nk97_d48", (1, 2, 130, 48), (1, 2, 97, 48), torch.float16, True),
    ("n97_d48_fusedv", (1, 2, 97, 48), (1, 2, 97, 48), torch.float16, False),
    ("n130_d96", (1, 1, 130, 96), (1, 1, 130, 96), torch.float16, False),
    ("n33_d72", (1, 1, 33, 72), (1, 1, 33, 72), torch.float16, True),
    ("n97_d64", (1, 2, 97, 64), (1, 2, 97, 64), torch.float16, True),
    ("nq130_nk70_d64", (1, 1, 130, 64), (1, 1, 70, 64), torch.float16, False),
    ("n130_d80_fp32", (1, 1, 130, 80), (1, 1, 130, 80), torch.float32, True),
    ("nq70_nk130_d48_fp32", (1, 1, 70, 48), (1, 1, 130, 48), torch.float32, False),
]


def _case_inputs() -> dict[str, tuple[torch.Tensor, ...]]:
    """label -> q, k, v, dO."""
    return {label: _inputs(sq, sk, dtype, seed=i, fused_v=label.endswith("fusedv"))
            for i, (label, sq, sk, dtype, _) in enumerate(CASES)}


# ---------------------------------------------------------------------------------------------
# Interpreter worker: this file run as a script
# ---------------------------------------------------------------------------------------------


def _tma_passes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool) -> dict:
    """O, L, dQ, dK, dV from the TMA launchers, written into NaN-poisoned buffers."""
    from lmtrain.kernels.flash import api as ft
    from lmtrain.kernels.flash import tma as hop

    z, h, n_q, d = q.shape
    precision = ft._dot_precision(q.dtype, allow_tf32=False)
    consts = dict(HEAD_DIM=d, BLOCK_D=ft._block_d(d), IS_CAUSAL=causal, DOT_PRECISION=precision)
    key = (ft._n_key(n_q, k.shape[2]), d, causal, precision, q.dtype)
    nan = float("nan")
    o, lse = torch.full(q.shape, nan, dtype=q.dtype), torch.full(q.shape[:-1], nan)
    hop.forward(q, k, v, o, lse, consts, key)
    dq, dk, dv = (torch.full(t.shape, nan, dtype=t.dtype) for t in (q, k, v))
    delta = torch.full((z * h, n_q), nan)
    hop.backward(q, k, v, o, do, lse, delta, dq, dk, dv, consts, key)
    return {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _run_worker(in_path: str, out_path: str) -> None:
    """Every case with the TMA kernels, padded and split, under the interpreter; raw outputs saved, no assertions."""
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT))
    from lmtrain.kernels.flash.settings import use_settings

    inputs = torch.load(in_path)
    results = {}
    for label, _, _, _, causal in CASES:
        for split in SPLIT_SETTINGS:
            with use_settings(tma_split_head_dim=split == "1"):
                results[label, split] = _tma_passes(*inputs[label], causal)
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory) -> tuple[dict, dict]:
    """(inputs, outputs) of all interpreter cases, computed in one subprocess."""
    if not HAS_TRITON:
        pytest.skip("needs Triton (its interpreter on CPU)")
    inputs = _case_inputs()
    return inputs, run_interpreter_worker(__file__, inputs, tmp_path_factory.mktemp("tma_interp"))


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("d", "tiles"), [(80, (64, 16)), (96, (64, 32)), (48, (32, 16)), (72, (64, 16)),
                                         (40, (32, 16)), (64, (64, 0)), (128, (128, 0)), (112, (128, 0)),
                                         (24, (32, 0)), (16, (16, 0))])
def test_split_rule(d: int, tiles: tuple[int, int]) -> None:
    from lmtrain.kernels.flash.tma import split_head_dim

    assert split_head_dim(d) == tiles
    first, second = tiles
    assert first + second >= d and (second == 0 or second >= 16)


@pytest.mark.parametrize(("label", "sq", "sk", "dtype", "causal"), CASES, ids=[case[0] for case in CASES])
def test_tma_kernels_match_float64_reference_under_the_interpreter(interpreter_results, label, sq, sk, dtype,
                                                                     causal) -> None:
    """O, L, dQ, dK, dV of the TMA kernels, with the head dim split and padded, every output element written."""
    from lmtrain.kernels.flash.tma import split_head_dim

    inputs, results = interpreter_results
    q, k, v, do = inputs[label]
    ref = _reference_results(q, k, v, do, causal, upcast=True)
    base = _reference_results(q, k, v, do, causal, upcast=False)
    for split in SPLIT_SETTINGS:
        name = f"TMA kernels[interpreter] {label} causal={causal} tma_split_head_dim={split}"
        assert_matches_reference(results[label, split], ref, base, dtype, name)
    if split_head_dim(sq[-1])[1] == 0:  # a head dim that is not split: the setting changes nothing
        for name, got in results[label, "1"].items():
            assert torch.equal(got, results[label, "0"][name]), f"{label} {name}"


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    _run_worker(sys.argv[2], sys.argv[3])
