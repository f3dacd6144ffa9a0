"""FlashAttention-2: the PyTorch reference and the Triton kernels against one float64 reference.

Every check compares O, L, dQ, dK, dV with ``reference_attention`` in float64; the tolerance is relative
to the error of the same naive computation carried out in the input dtype (flash-attention test
style): ``max|out - ref| <= 3 * max|naive_same_dtype - ref| + max(2 eps(dtype), 1e-5) * max|ref|``.

Triton on CPU runs under Triton's interpreter, which is chosen when the kernels are decorated, i.e.
when ``lmtrain.kernels.flash.api`` is first imported. In a pytest process another module may have
imported it (or Triton) first, so setting ``TRITON_INTERPRET`` here would be unreliable. Instead the
interpreter cases run in ONE fresh subprocess (this file executed as a script with
``TRITON_INTERPRET=1``), which receives the inputs from this process and sends back the raw outputs;
all comparisons and assertions happen here. GPU tests (``-m gpu``) run in-process on CUDA.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and Triton")
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (CPU runs use its interpreter)")


@pytest.fixture(name="flash_settings")
def flash_settings_fixture():
    """``apply(**changes)``: FlashAttention settings changed for this test (cumulatively), restored after it."""
    from lmtrain.kernels.flash import settings

    before = settings.current()

    def apply(**changes) -> None:
        settings.set_settings(**changes)

    yield apply
    settings.set_settings(before)


# ---------------------------------------------------------------------------------------------
# The one reference
# ---------------------------------------------------------------------------------------------


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, upcast: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive softmax(q k^T / sqrt(d)) v and its logsumexp L (natural log), differentiable.

    With ``upcast`` it runs in float64 (the reference); without, in the input dtype (the error baseline).
    Causal keeps the lower triangle with the diagonal, top-left aligned.
    """
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (..., N_q, N_k)
    if causal:
        n_q, n_k = s.shape[-2:]
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def _reference_results(q, k, v, do, causal: bool, upcast: bool) -> dict[str, torch.Tensor]:
    """O, L, dQ, dK, dV of reference_attention; float64 leaves when upcasting, input-dtype leaves otherwise."""
    leaves = [(t.detach().double() if upcast else t.detach().clone()).requires_grad_() for t in (q, k, v)]
    o, lse = reference_attention(*leaves, causal=causal, upcast=upcast)
    o.backward(do.to(o.dtype))
    return {"o": o.detach(), "lse": lse.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def assert_matches_reference(out: dict[str, torch.Tensor], ref: dict, base: dict, dtype: torch.dtype, label: str):
    """Each of O, L, dQ, dK, dV given in ``out``: finite, and within 3x the same-dtype naive error of the reference."""
    # Floor: 2 ulp of the dtype, but at least 1e-5 for fp32 (torch.testing's fp32 atol), relative to the largest
    # reference value: fp32 runs sum in another order and with the GPU's approximate exp2.
    floor = max(2 * torch.finfo(dtype).eps, 1e-5)
    for name in out:
        got, want = out[name], ref[name]
        assert got.shape == want.shape, f"{label} {name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.isfinite(got).all(), f"{label} {name}: NaN/inf (unwritten or overflowed elements)"
        err = (got.double() - want).abs().max().item()
        base_err = (base[name].double() - want).abs().max().item()
        tol = 3 * base_err + floor * want.abs().max().item()
        assert err <= tol, f"{label} {name}: max error {err:.3e} > tol {tol:.3e} (same-dtype naive {base_err:.3e})"


def _inputs(shape_q, shape_k, dtype, device="cpu", seed=0, fused_v: bool = False):
    """Random q, k, v, dO (never zeros). With fused_v, v is a non-contiguous head view of a fused qkv tensor."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(shape_q, generator=gen).to(dtype=dtype, device=device)
    k = torch.randn(shape_k, generator=gen).to(dtype=dtype, device=device)
    do = torch.randn(shape_q, generator=gen).to(dtype=dtype, device=device)
    if fused_v:
        b, h, n, d = shape_k
        qkv = torch.randn(b, n, 3, h, d, generator=gen).to(dtype=dtype, device=device)  # (B, N, 3, H, d)
        v = qkv[:, :, 2].transpose(1, 2)  # (B, H, N, d), strides (N*3*H*d, d, 3*H*d, 1)
    else:
        v = torch.randn(shape_k, generator=gen).to(dtype=dtype, device=device)
    return q, k, v, do


def _shape_id(shapes) -> str:
    return "q" + "x".join(map(str, shapes[0])) + "_k" + "x".join(map(str, shapes[1]))


# (label, q shape, k shape): head dims 80, 16 and 32, odd lengths, N_q != N_k, a fused-qkv view for v.
CPU_TRITON_CASES = [
    ("b2_n97_d80", (2, 97, 80), (2, 97, 80)),
    ("b2_nq48_nk80_d16", (2, 48, 16), (2, 80, 16)),
    ("b1_nq130_nk65_d32", (1, 130, 32), (1, 65, 32)),
    ("bh2x3_n40_d32_fusedv", (2, 3, 40, 32), (2, 3, 40, 32)),
]
CPU_TRITON_LONG = ("b1_n1025_d16", (1, 1025, 16), (1, 1025, 16))  # fp32, causal only: the interpreter is slow


def _triton_case_list() -> list[dict]:
    cases = []
    for dtype in (torch.float32, torch.float16):
        for causal in (False, True):
            for label, sq, sk in CPU_TRITON_CASES:
                cases.append(dict(label=label, dtype=dtype, causal=causal, sq=sq, sk=sk))
    label, sq, sk = CPU_TRITON_LONG
    cases.append(dict(label=label, dtype=torch.float32, causal=True, sq=sq, sk=sk))
    for i, case in enumerate(cases):
        case["id"] = f"{case['label']}-{str(case['dtype']).split('.')[-1]}-{'causal' if case['causal'] else 'full'}"
        fused_v = case["label"].endswith("fusedv")
        case["inputs"] = _inputs(case["sq"], case["sk"], case["dtype"], seed=i, fused_v=fused_v)
    return cases


# ---------------------------------------------------------------------------------------------
# Interpreter worker: this file run as a script
# ---------------------------------------------------------------------------------------------


def _run_worker(in_path: str, out_path: str) -> None:
    """Compute every case with the Triton kernels under the interpreter; save raw outputs (no assertions here)."""
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT))
    from lmtrain.kernels.flash.api import FlashAttentionTriton, _backward, _forward, flash_attention

    cases = torch.load(in_path)
    results = {}
    for case in cases:
        q, k, v, do = case["inputs"]
        causal = case["causal"]
        nan = float("nan")
        # Launchers with NaN-poisoned output buffers: every element must be written.
        o = torch.full(q.shape, nan, dtype=q.dtype)
        lse = torch.full(q.shape[:-1], nan, dtype=torch.float32)
        _forward(q, k, v, causal, o=o, lse=lse)
        grads = [torch.full(t.shape, nan, dtype=t.dtype) for t in (q, k, v)]
        _backward(do, q, k, v, o, lse, causal, dq=grads[0], dk=grads[1], dv=grads[2])
        res = {"o": o, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
        # Public path (custom op + autograd) twice: determinism and agreement with the launchers.
        for run in (1, 2):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = flash_attention(*leaves, causal=causal)
            out.backward(do)
            res[f"public{run}"] = [out.detach()] + [t.grad for t in leaves]
        # The custom ops (the path torch.compile takes) with their registered autograd.
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse_op = torch.ops.lmtrain.flash_attn_fwd(*leaves, causal, False)
        out.backward(do)
        res["op"] = [out.detach(), lse_op] + [t.grad for t in leaves]
        # The course's assignment interface on 3-D inputs: FlashAttentionTriton.apply(q, k, v, is_causal); saved
        # tensors listed.
        if q.ndim == 3:
            saved = []

            def pack(t, saved=saved):
                saved.append((tuple(t.shape), t.dtype))
                return t

            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = FlashAttentionTriton.apply(*leaves, causal)
            out.backward(do)
            res["apply"] = [out.detach()] + [t.grad for t in leaves]
            res["saved"] = saved
        results[case["id"]] = res
    from lmtrain.kernels.flash.common import _CHOSEN

    # Launches after the first of each tuning key skip the autotuner: the configurations it chose are held here.
    results["chosen"] = sorted((kernel.fn.__name__, *key[1:-1]) for kernel, *key in _CHOSEN)
    torch.save(results, out_path)


def run_interpreter_worker(script: str, inputs, tmp: Path):
    """Run ``script --worker IN OUT`` in a fresh process under Triton's interpreter (see the module docstring for
    why): ``inputs`` saved to IN, what the worker saved to OUT returned."""
    in_path, out_path = tmp / "inputs.pt", tmp / "results.pt"
    torch.save(inputs, in_path)
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": pythonpath}
    proc = subprocess.run(
        [sys.executable, script, "--worker", str(in_path), str(out_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"interpreter worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out_path)


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory) -> tuple[list[dict], dict]:
    """Run all Triton interpreter cases in one subprocess (see the module docstring for why)."""
    if not HAS_TRITON:
        pytest.skip("needs Triton")
    cases = _triton_case_list()
    return cases, run_interpreter_worker(__file__, cases, tmp_path_factory.mktemp("flash_interp"))


# ---------------------------------------------------------------------------------------------
# CPU: PyTorch implementation
# ---------------------------------------------------------------------------------------------

PT_SHAPES = [
    ((2, 97, 80), (2, 97, 80)),
    ((1, 1025, 16), (1, 1025, 16)),
    ((2, 64, 64), (2, 128, 64)),
    ((3, 33, 16), (3, 17, 16)),
    ((2, 3, 50, 32), (2, 3, 70, 32)),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shapes", PT_SHAPES, ids=_shape_id)
def test_pytorch_matches_reference(shapes, dtype, causal):
    from lmtrain.kernels.flash_pytorch import flash_attention_pytorch, flash_forward

    q, k, v, do = _inputs(*shapes, dtype=dtype, seed=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = flash_attention_pytorch(*leaves, causal=causal)
    o.backward(do)
    _, lse = flash_forward(q, k, v, causal)
    out = {"o": o.detach(), "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    ref = _reference_results(q, k, v, do, causal, upcast=True)
    base = _reference_results(q, k, v, do, causal, upcast=False)
    assert_matches_reference(out, ref, base, dtype, f"flash_pytorch {shapes} {dtype} causal={causal}")


def test_pytorch_saves_only_logsumexp_of_row_shape():
    from lmtrain.kernels.flash_pytorch import FlashAttentionPyTorch

    batch, n, d = 2, 70, 32
    q, k, v, do = _inputs((batch, n, d), (batch, n, d), torch.float32)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o = FlashAttentionPyTorch.apply(*leaves, True)  # is_causal positional: the course's assignment interface
    o.backward(do)
    row_shaped = [t for t in saved if tuple(t.shape) == (batch, n)]
    assert len(row_shaped) == 1 and row_shaped[0].dtype == torch.float32
    torch.testing.assert_close(row_shaped[0].double(), reference_attention(q, k, v, True)[1], rtol=0, atol=1e-5)
    assert all(tuple(t.shape[-2:]) != (n, n) for t in saved), "an N x N tensor was saved"


# ---------------------------------------------------------------------------------------------
# CPU: Triton kernels under the interpreter
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@requires_triton
def test_triton_interpreter_matches_reference(interpreter_results):
    from lmtrain.kernels.flash import pointer

    cases, results = interpreter_results
    for case in cases:
        q, k, v, do = case["inputs"]
        res = results[case["id"]]
        ref = _reference_results(q, k, v, do, case["causal"], upcast=True)
        base = _reference_results(q, k, v, do, case["causal"], upcast=False)
        out = {name: res[name] for name in ("o", "lse", "dq", "dk", "dv")}
        assert_matches_reference(out, ref, base, case["dtype"], f"flash_triton[interpreter] {case['id']}")
        # The public path (autograd.Function, launches with the chosen configurations) and the custom ops with
        # their autograd compute exactly what the launchers computed.
        for got, want in zip(res["public1"], (res["o"], res["dq"], res["dk"], res["dv"]), strict=True):
            assert torch.equal(got, want), case["id"]
        for got, want in zip(res["op"], (res["o"], res["lse"], res["dq"], res["dk"], res["dv"]), strict=True):
            assert torch.equal(got, want), case["id"]
    # every kernel and causal setting of the cases went through the cached-configuration launch
    kernels = {name for name, *_ in results["chosen"]}
    assert kernels == set(pointer.KERNEL_NAMES), results["chosen"]
    assert {key[2] for key in results["chosen"]} == {True, False}


@requires_triton
def test_triton_interpreter_backward_is_deterministic(interpreter_results):
    cases, results = interpreter_results
    for case in cases:
        res = results[case["id"]]
        for a, b in zip(res["public1"], res["public2"], strict=True):
            assert torch.equal(a, b), f"{case['id']}: two runs differ"


@requires_triton
def test_triton_interpreter_seeds_interface_saves_only_logsumexp(interpreter_results):
    cases, results = interpreter_results
    checked = 0
    for case in cases:
        res = results[case["id"]]
        if "saved" not in res:
            continue
        batch, n_q, _ = case["sq"]
        n_k = case["sk"][1]
        row_shaped = [dt for shape, dt in res["saved"] if shape == (batch, n_q)]
        assert row_shaped == [torch.float32], f"{case['id']}: saved {res['saved']}"
        assert all(shape[-2:] != (n_q, n_k) for shape, _ in res["saved"]), "an N x N tensor was saved"
        for got, want in zip(res["apply"], (res["o"], res["dq"], res["dk"], res["dv"]), strict=True):
            assert torch.equal(got, want), case["id"]
        checked += 1
    assert checked > 0


@requires_triton
def test_triton_views_strided_inputs_without_copy():
    from lmtrain.kernels.flash.api import _as_4d

    b, h, n, d = 2, 4, 33, 80
    qkv = torch.randn(b, n, 3 * h * d)
    v = qkv.view(b, n, 3, h, d)[:, :, 2].transpose(1, 2)  # (B, H, N, d), non-contiguous
    assert not v.is_contiguous()
    assert _as_4d(v).data_ptr() == v.data_ptr() and _as_4d(v).shape == (b, h, n, d)
    assert _as_4d(qkv.view(b, n, 3 * h, d)[:, :, :h].transpose(1, 2)).stride(-1) == 1
    x3 = torch.randn(5, n, d)
    assert _as_4d(x3).shape == (5, 1, n, d) and _as_4d(x3).data_ptr() == x3.data_ptr()


@requires_triton
@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (torch.randn(2, 8, 16).int(),) * 3, "dtype"),
        (lambda: (torch.randn(2, 8, 16), torch.randn(3, 8, 16), torch.randn(3, 8, 16)), "leading"),
        (lambda: (torch.randn(2, 8, 16), torch.randn(2, 8, 32), torch.randn(2, 8, 32)), "head dim"),
        (lambda: (torch.randn(2, 8, 300),) * 3, "head dim 300"),
        (lambda: (torch.randn(2, 8, 16), torch.randn(2, 8, 16).half(), torch.randn(2, 8, 16)), "one dtype"),
        (lambda: (torch.randn(8),) * 3, "shape"),
        (lambda: (torch.randn(2, 8, 16), torch.randn(2, 0, 16), torch.randn(2, 0, 16)), "no keys"),
    ],
)
def test_triton_rejects_bad_inputs(make, match):
    from lmtrain.kernels.flash.api import flash_attention

    with pytest.raises(ValueError, match=match):
        flash_attention(*make())


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

GPU_SHAPES = [
    ((2, 97, 80), (2, 97, 80)),
    ((1, 1025, 64), (1, 1025, 64)),
    ((2, 256, 128), (2, 384, 128)),
    ((3, 1000, 16), (3, 1000, 16)),
    ((1, 333, 256), (1, 333, 256)),
    ((2, 4, 513, 80), (2, 4, 300, 80)),
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shapes", GPU_SHAPES, ids=_shape_id)
def test_gpu_triton_matches_reference(shapes, dtype, causal, flash_settings):
    from lmtrain.kernels.flash.api import _backward, _forward

    # 36 shape x dtype x mask combinations: the first valid config of each kernel (no autotuning) keeps this
    # test to compile time; the single-shape tests below run the autotuned configs.
    flash_settings(autotune=False)

    q, k, v, do = _inputs(*shapes, dtype=dtype, device="cuda", seed=2)
    nan = float("nan")
    o = torch.full(q.shape, nan, dtype=dtype, device="cuda")
    lse = torch.full(q.shape[:-1], nan, dtype=torch.float32, device="cuda")
    _forward(q, k, v, causal, o=o, lse=lse)
    grads = [torch.full_like(t, nan).contiguous() for t in (q, k, v)]
    _backward(do, q, k, v, o, lse, causal, dq=grads[0], dk=grads[1], dv=grads[2])
    out = {"o": o, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    ref = _reference_results(q, k, v, do, causal, upcast=True)
    base = _reference_results(q, k, v, do, causal, upcast=False)
    assert_matches_reference(out, ref, base, dtype, f"flash_triton {shapes} {dtype} causal={causal}")


HAS_HOPPER = HAS_CUDA and torch.cuda.get_device_capability() >= (9, 0)


def launch_into_poisoned(q, k, v, do, causal: bool) -> dict[str, torch.Tensor]:
    """O, L, dQ, dK, dV from ``flash_triton``'s launchers, written into buffers filled with NaN beforehand (so an
    element no program writes shows up as NaN)."""
    from lmtrain.kernels.flash.api import _backward, _forward

    nan = float("nan")
    o = torch.full(q.shape, nan, dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:-1], nan, dtype=torch.float32, device=q.device)
    _forward(q, k, v, causal, o=o, lse=lse)
    grads = [torch.full(t.shape, nan, dtype=t.dtype, device=t.device) for t in (q, k, v)]
    _backward(do, q, k, v, o, lse, causal, dq=grads[0], dk=grads[1], dv=grads[2])
    return {"o": o, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}


requires_hopper = pytest.mark.skipif(not (HAS_HOPPER and HAS_TRITON), reason="needs a Hopper (sm_90+) GPU and Triton")

# (q shape, k shape, v from a fused qkv tensor): odd lengths, N_q != N_k both ways, head dims 16-128 incl. 80.
TMA_SHAPES = [
    ((2, 97, 80), (2, 97, 80), False),
    ((1, 2, 1025, 64), (1, 2, 700, 64), False),
    ((1, 3, 300, 32), (1, 3, 513, 32), False),
    ((2, 3, 257, 128), (2, 3, 257, 128), False),
    ((2, 1, 1000, 16), (2, 1, 1000, 16), False),
    ((2, 5, 333, 80), (2, 5, 333, 80), True),
    ((1, 2, 1025, 48), (1, 2, 1025, 48), False),  # split head dims: 32 + 16, 64 + 32, 64 + 16 (N_q < N_k)
    ((1, 2, 211, 96), (1, 2, 97, 96), True),
    ((1, 2, 130, 80), (1, 2, 300, 80), False),
]


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shapes", TMA_SHAPES, ids=lambda s: _shape_id(s[:2]) + ("_fusedv" if s[2] else ""))
@pytest.mark.parametrize("split", ["0", "1"], ids=["padded", "split"])
def test_gpu_tma_path_matches_reference(shapes, dtype, causal, split, flash_settings, monkeypatch):
    """The TMA kernels (forward and backward, chosen on Hopper for these inputs) against float64, every output
    element written; a head dim that is not a power of two padded to one tile, or split into two
    (setting ``tma_split_head_dim``)."""
    from lmtrain.kernels.flash import common, dispatch, tma
    from lmtrain.kernels.flash.api import _as_4d

    if split == "1" and tma.split_head_dim(shapes[0][-1])[1] == 0:
        pytest.skip("a head dim that is not split")
    # The TMA path for both passes (the default), not the Gluon kernels (tests/test_flash_gluon.py).
    flash_settings(autotune=False, tma=True, gluon="off", tma_split_head_dim=split == "1")
    monkeypatch.setattr(common, "_CHOSEN", {})  # no launch cached from another setting
    sq, sk, fused_v = shapes
    q, k, v, do = _inputs(sq, sk, dtype=dtype, device="cuda", seed=12, fused_v=fused_v)
    plan = dispatch.select(dispatch.call_of(_as_4d(q), _as_4d(k), _as_4d(v)))
    assert (plan.fwd, plan.dq, plan.dkdv) == ("tma",) * 3, "these inputs should take the TMA path"
    out = launch_into_poisoned(q, k, v, do, causal)
    ref = _reference_results(q, k, v, do, causal, upcast=True)
    base = _reference_results(q, k, v, do, causal, upcast=False)
    assert_matches_reference(out, ref, base, dtype, f"TMA path {shapes} {dtype} causal={causal}")


@pytest.mark.gpu
@requires_hopper
def test_gpu_tma_path_chosen_only_where_it_applies(flash_settings):
    """fp32, head dim 256 or 20 and misaligned views go to the pointer kernels; the misaligned view still matches."""
    from lmtrain.kernels.flash import dispatch
    from lmtrain.kernels.flash.api import _as_4d, flash_attention

    flash_settings(autotune=False, gluon="off")

    def usable(*ts):
        views = [_as_4d(t) for t in ts]
        return dispatch.select(dispatch.call_of(views[0], views[0], *views[1:])).fwd == dispatch.TMA

    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    assert usable(torch.randn(2, 64, 64, **bf16))
    assert not usable(torch.randn(2, 64, 64, device="cuda"))  # fp32
    assert not usable(torch.randn(2, 64, 256, **bf16))  # head dim above 128
    assert not usable(torch.randn(2, 64, 20, **bf16))  # rows of 40 bytes: not a multiple of 16
    wide = torch.randn(1, 2, 200, 72, **bf16)
    q, k, v = (wide[..., i : i + 64] for i in (1, 3, 5))  # base pointers 2 bytes off 16-byte alignment
    assert not usable(q, k, v)
    assert not usable(torch.randn(1, 1, 64, 64, **bf16).expand(2, 3, 64, 64))  # stride 0: no descriptor
    odd = torch.randn(1, 3, 64, 64, **bf16).as_strided((1, 3, 64, 64), (7, 64 * 64, 64, 1))
    assert usable(odd), "the stride of a dimension of size 1 is never used"
    flash_settings(tma=False)
    assert not usable(wide)
    flash_settings(tma=True)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]  # clones are aligned: TMA path
    want = flash_attention(*leaves, causal=True)
    torch.testing.assert_close(flash_attention(q, k, v, causal=True), want.detach(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_pytorch_matches_reference(dtype):
    from lmtrain.kernels.flash_pytorch import flash_attention_pytorch, flash_forward

    q, k, v, do = _inputs((2, 3, 257, 80), (2, 3, 257, 80), dtype=dtype, device="cuda", seed=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = flash_attention_pytorch(*leaves, causal=True)
    o.backward(do)
    out = {"o": o.detach(), "lse": flash_forward(q, k, v, True)[1], "dq": leaves[0].grad, "dk": leaves[1].grad,
           "dv": leaves[2].grad}
    ref = _reference_results(q, k, v, do, True, upcast=True)
    base = _reference_results(q, k, v, do, True, upcast=False)
    assert_matches_reference(out, ref, base, dtype, f"flash_pytorch cuda {dtype}")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fused_v", [False, True], ids=["contiguous", "fused_qkv_view"])
def test_gpu_model_layout_bf16(fused_v):
    """The model's call: (B, H, N, hd) bf16, v possibly a strided view of a fused qkv projection."""
    from lmtrain.kernels.flash.api import flash_attention

    shape = (2, 5, 1000, 80)
    q, k, v, do = _inputs(shape, shape, torch.bfloat16, device="cuda", seed=4, fused_v=fused_v)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = flash_attention(*leaves, causal=True)
    assert o.shape == shape and o.dtype == torch.bfloat16
    o.backward(do)
    out = {"o": o.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    ref = _reference_results(q, k, v, do, True, upcast=True)
    base = _reference_results(q, k, v, do, True, upcast=False)
    assert_matches_reference(out, ref, base, torch.bfloat16, f"model layout fused_v={fused_v}")


@pytest.mark.gpu
@requires_cuda
def test_gpu_backward_is_deterministic():
    from lmtrain.kernels.flash.api import flash_attention

    q, k, v, do = _inputs((3, 4, 2000, 80), (3, 4, 2000, 80), torch.bfloat16, device="cuda", seed=5)
    runs = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        flash_attention(*leaves, causal=True).backward(do)
        runs.append([t.grad for t in leaves])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@requires_cuda
def test_gpu_autotuning_adds_at_most_an_l2_sized_buffer_to_the_peak(flash_settings):
    """Tuning runs inside the first call (in training: inside the first step's memory peak). Its cache-flush buffer
    must be the L2's size, not Triton's default 256 MB, which this test would see as a 256 MB higher first peak."""
    from lmtrain.kernels.flash import api as ft
    from lmtrain.kernels.flash import dispatch, pointer, tma

    flash_settings(autotune=True)
    # A tuning key (fp16, head dim 48, 4096-bucket, causal) that no other test uses, so this call tunes.
    q, k, v, do = _inputs((2, 3, 3000, 48), (2, 3, 3000, 48), torch.float16, device="cuda", seed=11)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    # The kernels this call dispatches to: the TMA ones on Hopper, the pointer ones elsewhere.
    tensors = [ft._as_4d(t) for t in (q, k, v)]
    module = tma if dispatch.select(dispatch.call_of(*tensors)).fwd == dispatch.TMA else pointer
    kernels = [getattr(module, name) for name in module.KERNEL_NAMES]
    tuned_before = {kern: len(kern.cache) for kern in kernels}
    peaks = []
    for _ in range(2):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ft.flash_attention(*leaves, causal=True).backward(do)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        for t in leaves:
            t.grad = None
    assert all(len(kern.cache) == n + 1 for kern, n in tuned_before.items()), "the first call did not tune"
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    assert peaks[0] - peaks[1] <= l2 + 2**20, (peaks, l2)


@pytest.mark.gpu
@requires_cuda
def test_gpu_tuning_bench_returns_ordered_quantiles():
    from lmtrain.kernels.flash.common import _tuning_bench

    x = torch.randn(4096, 4096, device="cuda")
    med, low, high = _tuning_bench(lambda: x @ x, quantiles=(0.5, 0.2, 0.8), warmup_ms=5, rep_ms=20)
    assert 0 < low <= med <= high


@pytest.mark.gpu
@requires_cuda
def test_gpu_seeds_interface_saves_only_logsumexp():
    from lmtrain.kernels.flash.api import FlashAttentionTriton

    batch, n, d = 4, 128, 64
    q, k, v, do = _inputs((batch, n, d), (batch, n, d), torch.float32, device="cuda")
    saved = []

    def pack(t):
        saved.append(t)
        return t

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o = FlashAttentionTriton.apply(*leaves, True)
    o.backward(do)
    row_shaped = [t for t in saved if tuple(t.shape) == (batch, n)]
    assert len(row_shaped) == 1 and row_shaped[0].dtype == torch.float32
    assert all(tuple(t.shape[-2:]) != (n, n) for t in saved)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n", [16384, 32768])
def test_gpu_long_sequence_one_head(n):
    """bf16, d 64, causal: errors within 3x of SDPA's (flash) against the fp32 tiled reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lmtrain.kernels.flash.api import flash_attention
    from lmtrain.kernels.flash_pytorch import flash_backward, flash_forward

    q, k, v, do = _inputs((1, 1, n, 64), (1, 1, n, 64), torch.bfloat16, device="cuda", seed=6)
    q32, k32, v32 = q.float(), k.float(), v.float()
    o_ref, lse_ref = flash_forward(q32, k32, v32, True, tile_q=2048, tile_k=2048)
    grads_ref = flash_backward(do.float(), q32, k32, v32, o_ref, lse_ref, True, tile_q=2048, tile_k=2048)

    def run(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o = fn(*leaves)
        o.backward(do)
        return [o.detach()] + [t.grad for t in leaves]

    ours = run(lambda a, b, c: flash_attention(a, b, c, causal=True))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa = run(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True))
    for name, got, base, want in zip(("o", "dq", "dk", "dv"), ours, sdpa, (o_ref, *grads_ref), strict=True):
        assert torch.isfinite(got).all()
        err = (got.float() - want).abs().max().item()
        base_err = (base.float() - want).abs().max().item()
        assert err <= 3 * base_err + 1e-3 * want.abs().max().item(), f"N={n} {name}: {err:.3e} vs sdpa {base_err:.3e}"


@pytest.mark.gpu
@requires_cuda
def test_gpu_batch_heads_beyond_grid_limit():
    """B*H = 70000 > 65535 (the limit of CUDA grid axes 1 and 2)."""
    from lmtrain.kernels.flash.api import _backward, _forward

    q, k, v, do = _inputs((70000, 48, 32), (70000, 48, 32), torch.bfloat16, device="cuda", seed=7)
    o, lse = _forward(q, k, v, True)
    dq, dk, dv = _backward(do, q, k, v, o, lse, True)
    ref = _reference_results(q, k, v, do, True, upcast=True)
    base = _reference_results(q, k, v, do, True, upcast=False)
    out = {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    assert_matches_reference(out, ref, base, torch.bfloat16, "B*H=70000")


@pytest.mark.gpu
@requires_cuda
def test_gpu_more_than_2_31_elements():
    """(BH, N, d) bf16 with BH*N*d > 2^31: offsets need int64. Checked on the last batch entries."""
    from lmtrain.kernels.flash.api import _backward, _forward

    bh, n, d = 16640, 2048, 64  # 2.18e9 elements, 4.4 GB per tensor
    free, _ = torch.cuda.mem_get_info()
    if free < 8 * bh * n * d * 2 + (4 << 30):
        pytest.skip("not enough GPU memory for eight 4.4 GB tensors")
    gen = torch.Generator(device="cuda").manual_seed(8)
    q, k, v, do = (torch.randn(bh, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    assert q.numel() > 2**31
    o, lse = _forward(q, k, v, True)
    dq, dk, dv = _backward(do, q, k, v, o, lse, True)
    tail = slice(bh - 3, bh)  # past 2^31 elements from the start
    ref = _reference_results(q[tail], k[tail], v[tail], do[tail], True, upcast=True)
    base = _reference_results(q[tail], k[tail], v[tail], do[tail], True, upcast=False)
    out = {"o": o[tail], "lse": lse[tail], "dq": dq[tail], "dk": dk[tail], "dv": dv[tail]}
    assert_matches_reference(out, ref, base, torch.bfloat16, ">2^31 elements")


@pytest.mark.gpu
@requires_cuda
def test_gpu_torch_compile_fullgraph():
    from lmtrain.kernels.flash.api import flash_attention

    def block(q, k, v):
        return flash_attention(q * 1.5, k, v, causal=True).float().square().mean()

    compiled = torch.compile(block, fullgraph=True)
    q, k, v, _ = _inputs((2, 4, 300, 64), (2, 4, 300, 64), torch.bfloat16, device="cuda", seed=9)
    results = []
    for fn in (block, compiled):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        loss = fn(*leaves)
        loss.backward()
        results.append([loss.detach()] + [t.grad for t in leaves])
    for eager, comp in zip(*results, strict=True):
        torch.testing.assert_close(comp, eager, rtol=2e-2, atol=2e-3)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _run_worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: test_flash_attention.py --worker CASES.pt RESULTS.pt (run by the test suite)")
