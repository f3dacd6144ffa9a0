"""``MasterWeightAdamW(params_are_masters=True)``: the optimizer of ``master_weights`` under FSDP2, whose fp32 shards
are the masters. The torch-operation path against ``torch.optim.AdamW``, the compact (bf16) moments, checkpoints,
and the Triton kernel's ``PARAM_IS_MASTER`` layout (under Triton's interpreter on CPU, and on a GPU). The DTensor
shards themselves are trained by ``tests/test_distributed_matrix.py``."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmtrain.optim import MasterWeightAdamW, _update_torch

SHAPES = ((97, 33), (5,), (64, 80))
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _train(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        for p, grad in zip(params, _grads(step), strict=True):
            p.grad = grad.clone()
        optimizer.step()


def test_fp32_masters_take_adamws_steps_and_stay_fp32() -> None:
    ours, reference = _params(), _params()
    optimizer = MasterWeightAdamW(ours, **HYPER, bf16_params=ours[::2], params_are_masters=True, fused=False)
    _train(optimizer, ours, 4)
    _train(torch.optim.AdamW(reference, **HYPER, foreach=False), reference, 4)
    for p, q in zip(ours, reference, strict=True):
        assert p.dtype == torch.float32
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    state = optimizer.state[ours[0]]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}  # no master of its own: the parameter is the master
    assert torch.equal(optimizer.master(ours[0]), ours[0].detach())


def test_compact_moments_on_fp32_masters_are_bf16_and_train_close_to_fp32_ones() -> None:
    compact, full = _params(), _params()
    compact_opt = MasterWeightAdamW(compact, **HYPER, bf16_params=compact, params_are_masters=True, fused=False,
                                    state_dtype=torch.bfloat16, seed=3)
    full_opt = MasterWeightAdamW(full, **HYPER, bf16_params=full, params_are_masters=True, fused=False)
    _train(compact_opt, compact, 5)
    _train(full_opt, full, 5)
    for p, q in zip(compact, full, strict=True):
        state = compact_opt.state[p]
        assert p.dtype == torch.float32 and "master_low" not in state
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        # Stochastically rounded moments: the weights move as with fp32 moments, within bf16's resolution of
        # the moments (5 steps of lr 1e-2).
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=2e-3)
        assert not torch.equal(p.detach(), q.detach())  # a different optimizer, not the same arithmetic


def test_checkpoint_of_fp32_masters_resumes_exactly() -> None:
    first = _params()
    optimizer = MasterWeightAdamW(first, **HYPER, bf16_params=first, params_are_masters=True, fused=False,
                                  state_dtype=torch.bfloat16)
    _train(optimizer, first, 2)
    saved_state, saved_weights = copy.deepcopy(optimizer.state_dict()), [p.detach().clone() for p in first]
    _train(optimizer, first, 2, first=2)

    resumed = [torch.nn.Parameter(w.clone()) for w in saved_weights]
    again = MasterWeightAdamW(resumed, **HYPER, bf16_params=resumed, params_are_masters=True, fused=False,
                              state_dtype=torch.bfloat16)
    again.load_state_dict(saved_state)
    for p in resumed:
        assert set(again.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
        assert again.state[p]["exp_avg"].dtype == torch.bfloat16
    _train(again, resumed, 2, first=2)
    for p, q in zip(resumed, first, strict=True):
        assert torch.equal(p.detach(), q.detach())  # the CPU's rounding bits depend on seed and step only
    assert again.state[resumed[0]]["step"].item() == 4.0


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_masters_kept_by_an_early_conversion_give_the_same_steps(state_dtype: torch.dtype) -> None:
    """DDP's path: the weights turned bf16 before the optimizer exists (``bf16_with_masters``), their fp32 values
    handed to it as ``masters``, against the optimizer converting fp32 parameters itself."""
    from lmtrain.optim import bf16_with_masters

    early, own = _params(), _params()
    masters = bf16_with_masters(early)
    assert all(p.dtype == torch.bfloat16 for p in early)
    early_opt = MasterWeightAdamW(early, **HYPER, bf16_params=early, masters=masters, fused=False,
                                  state_dtype=state_dtype, seed=1)
    own_opt = MasterWeightAdamW(own, **HYPER, bf16_params=own, fused=False, state_dtype=state_dtype, seed=1)
    for opt, params in ((early_opt, early), (own_opt, own)):
        for step in range(3):
            for p, grad in zip(params, _grads(step), strict=True):
                p.grad = grad.bfloat16()
            opt.step()
    for p, q in zip(early, own, strict=True):
        assert torch.equal(p.detach(), q.detach())
        assert torch.equal(early_opt.master(p), own_opt.master(q))
    with pytest.raises(ValueError, match="bf16_with_masters"):
        fp32 = _params()
        MasterWeightAdamW(fp32, **HYPER, bf16_params=fp32, masters={fp32[0]: fp32[0].detach().clone()})


def _kernel_items(state_dtype: torch.dtype, device: str) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
    """(fp32 param, fp32 grad, moments and step) per shape, step already counted (3)."""
    g = torch.Generator().manual_seed(9)
    items = []
    for shape in SHAPES:
        state = {"exp_avg": (0.1 * torch.randn(shape, generator=g)).bfloat16().float().to(state_dtype),
                 "exp_avg_sq": (0.01 * torch.rand(shape, generator=g)).bfloat16().float().to(state_dtype),
                 "step": torch.tensor(3.0)}
        items.append((torch.randn(shape, generator=g), torch.randn(shape, generator=g), state))
    return [(p.to(device), gr.to(device), {k: v.to(device) for k, v in s.items()}) for p, gr, s in items]


def _assert_kernel_matches_torch(kernel: list, reference: list) -> None:
    for (p, _, state), (q, _, ref) in zip(kernel, reference, strict=True):
        torch.testing.assert_close(p.cpu(), q.cpu(), rtol=1e-6, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            if state[key].dtype == torch.float32:
                scale = ref[key].abs().max().item()
                torch.testing.assert_close(state[key].cpu(), ref[key].cpu(), rtol=1e-6, atol=1e-6 * scale)
            else:  # stochastically rounded: within one bf16 unit of the fp32 value (one of its two neighbours)
                exact, stored = ref[key].float().cpu(), state[key].float().cpu()
                bits = exact.view(torch.int32) & -65536
                unit = ((bits + 65536).view(torch.float32) - bits.view(torch.float32)).abs()
                assert torch.all((stored - exact).abs() <= unit * (1 + 1e-5)), key
                assert not torch.equal(stored, exact.bfloat16().float()) or exact.numel() < 8  # not nearest


_INTERPRETED = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
import triton.language as tl
from triton.language.extra import libdevice
libdevice.expm1 = lambda x: tl.exp(x) - 1.0  # the interpreter has no expm1; exact enough for this check
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from test_distributed_optim import _kernel_items
from lmtrain import optim
results = []
for dtype in (torch.float32, torch.bfloat16):
    items = _kernel_items(dtype, "cpu")
    optim._update_triton(items, 1e-2, 0.9, 0.95, 1e-8, 0.1, seed=4)
    results.append(items)
torch.save(results, sys.argv[2])
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter on CPU)")
def test_kernel_updates_fp32_masters_in_place_under_the_interpreter(tmp_path: Path) -> None:
    """``PARAM_IS_MASTER``: the fp32 parameter read and written as the master, fp32 or bf16 moments (in a fresh
    process: the interpreter is chosen when Triton is first imported)."""
    out = tmp_path / "kernel.pt"
    root = str(Path(__file__).resolve().parents[1])
    subprocess.run([sys.executable, "-c", _INTERPRETED, root, str(out)], check=True, timeout=600,
                   env={**os.environ, "TRITON_INTERPRET": "1"})
    for dtype, kernel in zip((torch.float32, torch.bfloat16), torch.load(out), strict=True):
        reference = _kernel_items(torch.float32, "cpu")
        for param, grad, state in reference:
            _update_torch(param, grad, state, torch.tensor(1e-2), 0.9, 0.95, 1e-8, 0.1)
        _assert_kernel_matches_torch(kernel, reference)
        assert all(state["exp_avg"].dtype == dtype for _, _, state in kernel)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_kernel_updates_fp32_masters_on_the_gpu(state_dtype: torch.dtype) -> None:
    from lmtrain.optim import _update_triton

    kernel = _kernel_items(state_dtype, "cuda")
    _update_triton(kernel, torch.tensor(1e-2, device="cuda"), 0.9, 0.95, 1e-8, 0.1, seed=4)
    reference = _kernel_items(torch.float32, "cuda")
    for param, grad, state in reference:
        _update_torch(param, grad, state, torch.tensor(1e-2, device="cuda"), 0.9, 0.95, 1e-8, 0.1)
    _assert_kernel_matches_torch(kernel, reference)
