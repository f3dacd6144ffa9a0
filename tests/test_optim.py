"""MasterWeightAdamW: the same steps as torch.optim.AdamW under bf16 autocast, checkpoints, the Triton kernel."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmtrain.config import ModelConfig
from lmtrain.model import TransformerLM
from lmtrain.optim import (
    MasterWeightAdamW,
    _update_torch,
    _update_triton,
    join_master,
    linear_weights,
    round_bf16_stochastic,
    split_master,
    weight_decay_groups,
)

VOCAB, DIM, HIDDEN = 11, 16, 24


class Tiny(nn.Module):
    """Embedding (fp32 under autocast), two bias-free linears (bf16 under autocast), a gain (fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, VOCAB))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(self.embedding(tokens)))) * self.gain

    def groups(self) -> list[dict]:
        return [{"params": [self.up.weight, self.down.weight, self.embedding.weight], "weight_decay": 0.1},
                {"params": [self.gain], "weight_decay": 0.0}]

    def matrices(self) -> list[nn.Parameter]:
        return [self.up.weight, self.down.weight]


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (4, 9), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / 3 if s < 3 else 0.5)


def _master_model(fused: bool | None = None) -> tuple[Tiny, MasterWeightAdamW]:
    torch.manual_seed(0)
    model = Tiny()
    optimizer = MasterWeightAdamW(model.groups(), lr=3e-2, betas=(0.9, 0.95), bf16_params=model.matrices(),
                                  fused=fused)
    return model, optimizer


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, steps: range) -> None:
    for step in steps:
        _loss(model, step).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()


def test_same_steps_as_adamw_under_bf16_autocast() -> None:
    torch.manual_seed(0)
    ref = Tiny()  # fp32 weights, cast by autocast
    ref_opt = torch.optim.AdamW(ref.groups(), lr=3e-2, betas=(0.9, 0.95))
    ref_sched = _schedule(ref_opt)
    model, optimizer = _master_model()
    sched = _schedule(optimizer)
    assert all(p.dtype == torch.bfloat16 for p in model.matrices())
    assert model.gain.dtype == model.embedding.weight.dtype == torch.float32
    for m, r in zip(model.matrices(), ref.matrices(), strict=True):
        assert torch.equal(optimizer.state[m]["master"], r.detach())  # the fp32 value, kept at conversion

    for step in range(5):
        _loss(ref, step).backward()
        _loss(model, step).backward()
        for m, r in zip(model.matrices(), ref.matrices(), strict=True):
            assert m.grad.dtype == torch.bfloat16
            r.grad = r.grad.bfloat16().float()  # bf16 matmul gradients: rounding changes nothing...
            assert torch.equal(m.grad.float(), r.grad)  # ...and they are the bf16 weights' gradients
        for opt, schedule in ((ref_opt, ref_sched), (optimizer, sched)):
            opt.step()
            opt.zero_grad(set_to_none=True)
            schedule.step()

    for m, r in zip(model.matrices(), ref.matrices(), strict=True):
        torch.testing.assert_close(optimizer.state[m]["master"], r.detach(), rtol=1e-6, atol=0)
        assert torch.equal(m.detach(), r.detach().bfloat16())
    assert torch.equal(model.gain.detach(), ref.gain.detach())
    assert torch.equal(model.embedding.weight.detach(), ref.embedding.weight.detach())
    assert optimizer.state[model.up.weight]["step"].item() == 5
    assert optimizer.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


def test_tensor_lr_on_cpu_gives_the_same_steps() -> None:
    runs = []
    for lr in (3e-2, torch.tensor(3e-2)):
        torch.manual_seed(0)
        model = Tiny()
        optimizer = MasterWeightAdamW(model.groups(), lr=lr, bf16_params=model.matrices())
        for step in range(3):
            _loss(model, step).backward()
            optimizer.step()
            optimizer.zero_grad()
        runs.append(model)
    for a, b in zip(runs[0].parameters(), runs[1].parameters(), strict=True):  # AdamW's tensor-lr arithmetic
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # differs in the last bit (float32, not double)


def test_state_dict_round_trip_resumes_exactly() -> None:
    model, optimizer = _master_model()
    sched = _schedule(optimizer)
    _train(model, optimizer, sched, range(3))
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict(), sched.state_dict()))
    assert saved[1]["state"][0]["master"].dtype == torch.float32

    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    resumed = Tiny()
    resumed_opt = MasterWeightAdamW(resumed.groups(), lr=3e-2, betas=(0.9, 0.95), bf16_params=resumed.matrices())
    resumed_sched = _schedule(resumed_opt)
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    resumed_sched.load_state_dict(saved[2])
    _train(resumed, resumed_opt, resumed_sched, range(3, 5))

    _train(model, optimizer, sched, range(3, 5))  # uninterrupted
    for p, q in zip(resumed.parameters(), model.parameters(), strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q)
        s, t = resumed_opt.state[p], optimizer.state[q]
        assert s.keys() == t.keys()
        for key in s:
            assert s[key].dtype == t[key].dtype and torch.equal(s[key], t[key]), key


def test_fp32_parameters_have_adamws_state_before_the_first_step() -> None:
    """The fp32 parameters' AdamW state exists from construction (step 0, zero moments), as a distributed checkpoint
    needs: ``torch.distributed.checkpoint`` loads into the state an optimizer has, and takes any state as
    initialized. Loaded that way into a fresh optimizer, a state gives the same next steps as the uninterrupted run."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model, optimizer = _master_model()
    fp32 = [p for p in model.parameters() if p.dtype == torch.float32]
    assert fp32
    for p in fp32:
        state = optimizer.state[p]
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"] and float(state["step"]) == 0.0
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    sched = _schedule(optimizer)
    _train(model, optimizer, sched, range(3))
    saved = copy.deepcopy((model.state_dict(), get_optimizer_state_dict(model, optimizer), sched.state_dict()))

    torch.manual_seed(1)
    resumed = Tiny()
    resumed_opt = MasterWeightAdamW(resumed.groups(), lr=3e-2, betas=(0.9, 0.95), bf16_params=resumed.matrices())
    resumed_sched = _schedule(resumed_opt)
    resumed.load_state_dict(saved[0])
    # what torch.distributed.checkpoint does: fill the optimizer's own state dict (the template), then set it
    template = get_optimizer_state_dict(resumed, resumed_opt)
    assert template["state"].keys() == saved[1]["state"].keys()
    for fqn, entry in template["state"].items():
        assert entry.keys() == saved[1]["state"][fqn].keys(), fqn
    set_optimizer_state_dict(resumed, resumed_opt, saved[1])
    resumed_sched.load_state_dict(saved[2])
    _train(resumed, resumed_opt, resumed_sched, range(3, 5))
    _train(model, optimizer, sched, range(3, 5))
    for p, q in zip(resumed.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
        assert float(resumed_opt.state[p]["step"]) == float(optimizer.state[q]["step"]) == 5.0


def test_missing_master_starts_from_the_bf16_value_with_a_warning() -> None:
    model, optimizer = _master_model()
    _train(model, optimizer, _schedule(optimizer), range(2))
    saved = copy.deepcopy(optimizer.state_dict())
    del saved["state"][0]["master"]
    with pytest.warns(UserWarning, match="no fp32 master"):
        optimizer.load_state_dict(saved)
    state = optimizer.state[model.up.weight]
    assert state["master"].dtype == torch.float32 and torch.equal(state["master"], model.up.weight.float())
    assert torch.equal(state["exp_avg"], saved["state"][0]["exp_avg"])
    assert torch.equal(optimizer.state[model.down.weight]["master"], saved["state"][1]["master"])


def test_parameter_without_gradient_is_skipped() -> None:
    model, optimizer = _master_model()
    before = model.up.weight.detach().clone()
    _loss(model, 0).backward()
    model.up.weight.grad = None
    optimizer.step()
    assert torch.equal(model.up.weight, before)
    assert optimizer.state[model.up.weight]["step"].item() == 0
    assert optimizer.state[model.down.weight]["step"].item() == 1


def test_which_parameters_decay_and_which_get_masters() -> None:
    model = TransformerLM(ModelConfig.from_size("tiny", vocab_size=300))
    named = dict(model.named_parameters())
    names = {id(p): n for n, p in named.items()}
    decay, no_decay = weight_decay_groups(model, 0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert {names[id(p)] for p in decay["params"]} == {n for n, p in named.items() if p.ndim == 2}
    assert all(n.endswith("norm.weight") for n in (names[id(p)] for p in no_decay["params"]))
    assert len(decay["params"]) + len(no_decay["params"]) == len(named)
    linear = {names[id(p)] for p in linear_weights(model)}
    # Every nn.Linear weight (blocks and output head); not the embedding table, which F.embedding reads in fp32.
    assert linear == {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert "embedding.weight" not in linear


def test_clear_errors() -> None:
    model = Tiny()
    with pytest.raises(ValueError, match="betas"):
        MasterWeightAdamW(model.parameters(), lr=1e-3, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        MasterWeightAdamW(model.parameters(), lr=-1.0)
    with pytest.raises(ValueError, match="block_size=3000"):
        MasterWeightAdamW(model.parameters(), block_size=3000)
    with pytest.raises(ValueError, match="num_warps=3"):
        MasterWeightAdamW(model.parameters(), num_warps=3)
    optimizer = MasterWeightAdamW(model.parameters())
    with pytest.raises(ValueError, match="block_size=100"):
        optimizer.block_size = 100  # checked when set, not at every step
    with pytest.raises(ValueError, match="num_warps=5"):
        optimizer.num_warps = 5
    assert (optimizer.block_size, optimizer.num_warps) == (2048, 8)
    with pytest.raises(ValueError, match="state_dtype"):
        MasterWeightAdamW(model.parameters(), state_dtype=torch.float16)
    with pytest.raises(ValueError, match="seed"):
        MasterWeightAdamW(model.parameters(), seed=1.5)
    with pytest.raises(ValueError, match="not among"):
        MasterWeightAdamW([model.gain], bf16_params=[model.up.weight])
    with pytest.raises(ValueError, match="bf16_params"):
        MasterWeightAdamW([nn.Parameter(torch.ones(3, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="fp32 value would be lost"):
        bf16 = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
        MasterWeightAdamW([bf16], bf16_params=[bf16])
    with pytest.raises(ValueError, match="CUDA"):
        MasterWeightAdamW(model.parameters(), bf16_params=[model.up.weight], fused=True)
    optimizer = MasterWeightAdamW(model.parameters())
    with pytest.raises(NotImplementedError):
        optimizer.add_param_group({"params": [nn.Parameter(torch.ones(2))]})


# -- bf16 moments (state_dtype=torch.bfloat16) --------------------------------------------------------


def assert_stochastically_rounded(stored: torch.Tensor, exact: torch.Tensor, sigmas: float = 5.0) -> None:
    """Each bf16 value of ``stored`` is one of the two bf16 neighbours of its fp32 ``exact`` (exact itself where
    that is a bf16 number), and over all elements the rounding is unbiased: the fraction rounded away from zero
    matches the mean dropped fraction within ``sigmas`` standard deviations."""
    assert stored.dtype == torch.bfloat16 and exact.dtype == torch.float32
    exact_bits = exact.contiguous().view(torch.int32).long().flatten()
    truncated = exact_bits >> 16  # the bf16 neighbour nearer zero, as bits (sign included)
    stored_bits = stored.contiguous().view(torch.int16).long().flatten()
    up = stored_bits - truncated
    assert ((up == 0) | (up == 1)).all(), "a value is not a bf16 neighbour of its fp32 value"
    fraction = (exact_bits & 0xFFFF).double() / 65536
    assert (up[fraction == 0] == 0).all(), "a bf16-exact value was changed"
    sigma = (fraction * (1 - fraction)).mean().sqrt().item() / len(up) ** 0.5
    assert abs(up.double().mean().item() - fraction.mean().item()) <= sigmas * sigma + 1e-12


def test_round_bf16_stochastic_is_unbiased_and_picks_a_neighbour() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=gen) * torch.logspace(-6, 6, 200_000)
    x[:1000] = x[:1000].bfloat16().float()  # already bf16 numbers: unchanged
    rounded = round_bf16_stochastic(x, generator=gen)
    assert_stochastically_rounded(rounded, x)
    assert torch.equal(rounded[:1000].float(), x[:1000])
    # Rounding one value many times: the mean is the value (not its nearest bf16 neighbour).
    value = torch.full((100_000,), 1.0 + 3 / 1024)  # 3/8 of the way from 1 to the next bf16 number, 1 + 1/128
    mean = round_bf16_stochastic(value, generator=gen).double().mean().item()
    assert abs(mean - value[0].item()) < 2e-5 and value[0].bfloat16().item() == 1.0


def test_bf16_moments_keep_moving_where_nearest_rounding_freezes() -> None:
    """exp_avg_sq with beta2 = 0.999 and a constant gradient: rounded to nearest in bf16 it stops growing once
    its step (0.001 of the gap to g**2) drops below half a bf16 unit; stochastically rounded it follows fp32."""
    beta2, steps = 0.999, 2000
    exact = 1 - beta2**steps  # fp32/exact value of exp_avg_sq for g = 1 (0.865)
    nearest = torch.zeros((), dtype=torch.bfloat16)
    for _ in range(steps):
        nearest = (nearest.float() * beta2 + (1 - beta2)).bfloat16()
    assert exact - nearest.item() > 0.1  # the premise: nearest rounding freezes far below

    torch.manual_seed(0)
    p = nn.Parameter(torch.zeros(4096))
    optimizer = MasterWeightAdamW([p], lr=1e-4, betas=(0.9, beta2), weight_decay=0.0, bf16_params=[p],
                                  state_dtype=torch.bfloat16)
    for _ in range(steps):
        p.grad = torch.ones(4096, dtype=torch.bfloat16)
        optimizer.step()
    v = optimizer.state[p]["exp_avg_sq"]
    assert v.dtype == torch.bfloat16 and optimizer.state[p]["master_low"].dtype == torch.int16
    assert abs(v.double().mean().item() - exact) < 2e-3
    assert (optimizer.state[p]["exp_avg"].float() - 1).abs().max().item() <= 2**-8  # m -> g, within a unit


def test_bf16_moments_train_close_to_fp32_moments() -> None:
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = Tiny()
        initial = [m.detach().clone() for m in model.matrices()]
        optimizer = MasterWeightAdamW(model.groups(), lr=3e-2, betas=(0.9, 0.95), bf16_params=model.matrices(),
                                      state_dtype=dtype)
        scheduler, losses = _schedule(optimizer), []
        for step in range(10):
            loss = _loss(model, step)
            losses.append(loss.item())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        runs[dtype] = (model, optimizer, torch.tensor(losses))
    (ref, ref_opt, ref_losses), (model, optimizer, losses) = runs[torch.float32], runs[torch.bfloat16]
    torch.testing.assert_close(losses, ref_losses, rtol=1e-3, atol=0)  # measured: 1e-4
    for m, r, start in zip(model.matrices(), ref.matrices(), initial, strict=True):
        state, ref_master, master = optimizer.state[m], ref_opt.state[r]["master"], optimizer.master(m)
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        assert "master" not in state and state["master_low"].dtype == torch.int16 and master.dtype == torch.float32
        assert torch.equal(split_master(master)[0], m.detach())  # the weight is the master's top half
        # Adam's sign-like steps amplify any perturbation where a gradient is near zero, so single elements may
        # part by a step or two (lr 3e-2); the typical one stays within 1% of the distance moved.
        moved = (ref_master - start).abs().max().item()
        assert moved > 0.05
        assert (master - ref_master).abs().median().item() < 0.01 * moved
        assert not torch.equal(master, ref_master)  # a different optimizer, not the same arithmetic
    # The fp32 parameters' moments stay fp32 (the inner torch.optim.AdamW steps them).
    assert optimizer.state[model.gain]["exp_avg"].dtype == torch.float32


def test_bf16_moment_checkpoints_round_trip_and_convert() -> None:
    torch.manual_seed(0)
    model = Tiny()
    optimizer = MasterWeightAdamW(model.groups(), lr=3e-2, bf16_params=model.matrices(), state_dtype=torch.bfloat16)
    _train(model, optimizer, _schedule(optimizer), range(3))
    saved = copy.deepcopy(optimizer.state_dict())
    assert saved["state"][0]["exp_avg"].dtype == torch.bfloat16

    def fresh(dtype: torch.dtype) -> tuple[Tiny, MasterWeightAdamW]:
        torch.manual_seed(1)
        other = Tiny()
        opt = MasterWeightAdamW(other.groups(), lr=3e-2, bf16_params=other.matrices(), state_dtype=dtype)
        other.load_state_dict(model.state_dict())  # the weights first: they hold the masters' top halves
        opt.load_state_dict(saved)
        return other, opt

    assert "master" not in saved["state"][0] and saved["state"][0]["master_low"].dtype == torch.int16
    for dtype in (torch.bfloat16, torch.float32):  # into the compact state as saved, and widened to fp32 exactly
        other, opt = fresh(dtype)
        for p, q in zip(other.matrices(), model.matrices(), strict=True):
            for key in ("exp_avg", "exp_avg_sq"):
                assert opt.state[p][key].dtype == dtype
                assert torch.equal(opt.state[p][key].float(), optimizer.state[q][key].float())
            assert torch.equal(opt.master(p), optimizer.master(q)) and opt.master(p).dtype == torch.float32
            assert ("master_low" in opt.state[p]) == (dtype == torch.bfloat16)
    # An fp32 state (fp32 master) into the compact one: the master survives exactly, split.
    torch.manual_seed(0)
    full = Tiny()
    full_opt = MasterWeightAdamW(full.groups(), lr=3e-2, bf16_params=full.matrices())
    _train(full, full_opt, _schedule(full_opt), range(3))
    torch.manual_seed(1)
    compact = Tiny()
    compact_opt = MasterWeightAdamW(compact.groups(), lr=3e-2, bf16_params=compact.matrices(),
                                    state_dtype=torch.bfloat16)
    compact.load_state_dict(full.state_dict())
    compact_opt.load_state_dict(copy.deepcopy(full_opt.state_dict()))
    for p, q in zip(compact.matrices(), full.matrices(), strict=True):
        assert torch.equal(compact_opt.master(p), full_opt.master(q))
        assert torch.equal(p.detach(), split_master(full_opt.master(q))[0])


def test_split_master_is_exact_and_rounds_to_nearest() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1_000_000, generator=gen) * torch.logspace(-30, 30, 1_000_000)
    x[:8] = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0e38, -3.0e38, 1e-40, -1e-40])  # zeros, extremes, subnormals
    ties = (torch.randint(0, 0x7F00, (10_000,), generator=gen, dtype=torch.int32) << 16) | 0x8000  # finite
    x = torch.cat([x, ties.view(torch.float32), -ties.view(torch.float32)])
    weight, low = split_master(x)
    assert weight.dtype == torch.bfloat16 and low.dtype == torch.int16
    assert torch.equal(join_master(weight, low).view(torch.int32), x.view(torch.int32))  # bit for bit
    nearest_even = x.bfloat16()
    off = weight.view(torch.int16).int() - nearest_even.view(torch.int16).int()
    half_way = (x.view(torch.int32) & 0xFFFF) == 0x8000
    assert (off[~half_way] == 0).all()  # rounded to nearest everywhere but at ties...
    assert (weight[half_way].float().abs() <= nearest_even[half_way].float().abs()).all()  # ...where toward zero
    assert (off[half_way] != 0).any()


# -- GPU: the Triton kernel ---------------------------------------------------------------------------


def _random_state(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, ...]:
    """Grad (bf16), master, exp_avg, exp_avg_sq: random, none zero."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def nonzero(*s: int) -> torch.Tensor:
        x = torch.randn(*s, device="cuda", generator=gen)
        return x + torch.where(x >= 0, 0.05, -0.05)

    return (nonzero(*shape).bfloat16(), nonzero(*shape), nonzero(*shape) * 0.1,
            torch.rand(*shape, device="cuda", generator=gen) * 0.01 + 1e-4)


def _optimizer_with_state(shape, seed, lr, fused, weight_decay=0.1):
    grad, master, exp_avg, exp_avg_sq = _random_state(shape, seed)
    p = nn.Parameter(master.clone())
    optimizer = MasterWeightAdamW([p], lr=lr, weight_decay=weight_decay, bf16_params=[p], fused=fused)
    state = optimizer.state[p]
    state["exp_avg"].copy_(exp_avg)
    state["exp_avg_sq"].copy_(exp_avg_sq)
    state["step"].fill_(4.0)
    p.grad = grad
    with torch.no_grad():
        p.fill_(float("nan"))  # poisoned: the step must write every element
    return p, optimizer


def _assert_within_one_bf16_ulp(a: torch.Tensor, b: torch.Tensor) -> None:
    assert not a.isnan().any() and not b.isnan().any()
    diff = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
    assert diff.max().item() <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(97, 1025), (2560, 80), (3,)])
@pytest.mark.parametrize("lr_on_device", [False, True])
def test_triton_kernel_matches_torch_operations(shape: tuple[int, ...], lr_on_device: bool) -> None:
    lr = torch.tensor(1e-2, device="cuda") if lr_on_device else 1e-2
    kernel_p, kernel_opt = _optimizer_with_state(shape, 7, lr, fused=True)
    torch_p, torch_opt = _optimizer_with_state(shape, 7, lr, fused=False)
    cpu_p, cpu_opt = _optimizer_with_state(shape, 7, 1e-2, fused=False)  # then moved: host scalars, AdamW's own
    cpu_p.data = cpu_p.data.cpu()
    cpu_p.grad = cpu_p.grad.cpu()
    cpu_opt.state[cpu_p] = {k: v.cpu() for k, v in cpu_opt.state.pop(cpu_p).items()}
    for optimizer in (kernel_opt, torch_opt, cpu_opt):
        optimizer.step()
    kernel, torch_ops, cpu = kernel_opt.state[kernel_p], torch_opt.state[torch_p], cpu_opt.state[cpu_p]
    for key in ("master", "exp_avg", "exp_avg_sq"):
        scale = kernel[key].abs().max().item()
        torch.testing.assert_close(kernel[key], torch_ops[key], rtol=1e-6, atol=1e-6 * scale)
        torch.testing.assert_close(kernel[key].cpu(), cpu[key], rtol=1e-6, atol=1e-6 * scale)
    assert kernel["step"].item() == 5.0
    assert torch.equal(kernel_p.detach(), kernel["master"].bfloat16())  # round to nearest even, as .to() does
    _assert_within_one_bf16_ulp(kernel_p.detach(), torch_p.detach())


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_captured_step_replays_equal_eager_steps(state_dtype: torch.dtype) -> None:
    def build():
        torch.manual_seed(0)
        model = Tiny().cuda()
        lr = torch.tensor(1e-2, device="cuda")
        return model, MasterWeightAdamW(model.groups(), lr=lr, bf16_params=model.matrices(), capturable=True,
                                        state_dtype=state_dtype)

    def grads(step: int, model: Tiny) -> list[torch.Tensor]:
        gen = torch.Generator(device="cuda").manual_seed(step)
        return [torch.randn(p.shape, device="cuda", generator=gen).to(p.dtype) for p in model.parameters()]

    def set_grads(model: Tiny, values: list[torch.Tensor]) -> None:
        for p, g in zip(model.parameters(), values, strict=True):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)

    eager, eager_opt = build()
    graphed, graphed_opt = build()
    for model, opt in ((eager, eager_opt), (graphed, graphed_opt)):  # warm-up: compile, AdamW state
        set_grads(model, grads(0, model))
        opt.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed_opt.step()
    for step in (1, 2, 3):
        lr = 1e-2 / step
        for model, opt in ((eager, eager_opt), (graphed, graphed_opt)):
            set_grads(model, grads(step, model))
            opt.param_groups[0]["lr"].fill_(lr)
            opt.param_groups[1]["lr"].fill_(lr)
        eager_opt.step()
        graph.replay()
    torch.cuda.synchronize()
    for p, q in zip(eager.parameters(), graphed.parameters(), strict=True):
        assert torch.equal(p, q)
        for key, value in eager_opt.state[p].items():
            assert torch.equal(value, graphed_opt.state[q][key]), key
    assert graphed_opt.state[graphed.up.weight]["step"].item() == 4


# Shapes across two launches of the kernel (eight tensors each): odd sizes, one element, exact blocks.
_GROUP_SHAPES = [(97, 33), (5000,), (3,), (4096,), (17, 300), (2, 2), (9000,), (1,), (123, 45), (10,)]


def _grouped_items(device: str, kernel_state: torch.dtype = torch.float32) -> tuple[list, list]:
    """Two copies of (bf16 param, bf16 grad, state) per shape of ``_GROUP_SHAPES``, step already counted (5); the
    moments hold bf16 numbers. The second copy's state is full (fp32) and its param NaN-poisoned; the first's is
    ``kernel_state``: full the same way, or compact (bf16 moments, the master split into the param, which the
    kernel reads, and ``master_low``)."""
    gen = torch.Generator().manual_seed(3)
    kernel_items, torch_items = [], []
    for shape in _GROUP_SHAPES:
        state = {"master": torch.randn(shape, generator=gen),
                 "exp_avg": (0.1 * torch.randn(shape, generator=gen)).bfloat16().float(),
                 "exp_avg_sq": (0.01 * torch.rand(shape, generator=gen)).bfloat16().float(),
                 "step": torch.tensor(5.0)}
        grad = torch.randn(shape, generator=gen).bfloat16()
        for items, dtype in ((kernel_items, kernel_state), (torch_items, torch.float32)):
            copy_ = {k: v.clone().to(device) for k, v in state.items()}
            param = torch.full(shape, float("nan"), device=device).bfloat16()
            if dtype == torch.bfloat16:
                param, copy_["master_low"] = split_master(copy_.pop("master"))
                for key in ("exp_avg", "exp_avg_sq"):
                    copy_[key] = copy_[key].bfloat16()
            items.append((param, grad.to(device), copy_))
    return kernel_items, torch_items


_INTERPRETED_GROUP = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
import triton.language as tl
from triton.language.extra import libdevice
libdevice.expm1 = lambda x: tl.exp(x) - 1.0  # the interpreter has no expm1; exact enough for this check
sys.path.insert(0, sys.argv[1])
from tests.test_optim import _grouped_items
from lmtrain import optim
results = []
for lr in (torch.tensor(1e-2), 1e-2):  # read by the kernel, or passed as a number
    kernel_items, _ = _grouped_items("cpu")
    optim._update_triton(kernel_items, lr, 0.9, 0.95, 1e-8, 0.1)
    results.append([(p, s) for p, _, s in kernel_items])
bf16_items, fp32_items = _grouped_items("cpu", torch.bfloat16)  # bf16 moments, and the same kernel in fp32
optim._update_triton(bf16_items, 1e-2, 0.9, 0.95, 1e-8, 0.1, seed=5)
optim._update_triton(fp32_items, 1e-2, 0.9, 0.95, 1e-8, 0.1)
results.append(list(zip(bf16_items, fp32_items, strict=True)))
torch.save(results, sys.argv[2])
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter on CPU)")
def test_grouped_kernel_launches_update_every_tensor_under_the_interpreter(tmp_path) -> None:
    """Ten tensors of odd sizes in two launches: each slot's block range and offsets, under Triton's interpreter
    (in a fresh process: the interpreter is chosen when Triton is first imported)."""
    out = tmp_path / "kernel.pt"
    root = str(Path(__file__).resolve().parents[1])
    subprocess.run([sys.executable, "-c", _INTERPRETED_GROUP, root, str(out)], check=True, timeout=600,
                   env={**os.environ, "TRITON_INTERPRET": "1"})
    tensor_lr, number_lr, bf16_moments = torch.load(out)
    _, torch_items = _grouped_items("cpu")
    for param, grad, state in torch_items:
        _update_torch(param, grad, state, torch.tensor(1e-2), 0.9, 0.95, 1e-8, 0.1)
    pairs = list(zip(tensor_lr, torch_items, strict=True)) + list(zip(number_lr, torch_items, strict=True))
    for (kernel_param, kernel_state), (torch_param, _, torch_state) in pairs:
        for key in ("master", "exp_avg", "exp_avg_sq"):
            scale = torch_state[key].abs().max().item()
            torch.testing.assert_close(kernel_state[key], torch_state[key], rtol=1e-6, atol=1e-6 * scale)
        # Every element written; the interpreter's bf16 rounding may differ from the GPU's by one unit.
        _assert_within_one_bf16_ulp(kernel_param, torch_param)
    _assert_compact_state_follows(bf16_moments)


def _assert_compact_state_follows(pairs: list[tuple[tuple, tuple]]) -> None:
    """Pairs of (param, grad, state) after one kernel step from the same values, the first with the compact state
    (split master, bf16 moments), the second with the full one: the same fp32 masters bit for bit, each weight
    the master's top half, and each bf16 moment stochastically rounded from the fp32 one (checked over all tensors
    at once)."""
    for (weight, _, compact), (_, _, full) in pairs:
        assert torch.equal(join_master(weight, compact["master_low"]), full["master"])
        assert torch.equal(weight, split_master(full["master"])[0])
    for key in ("exp_avg", "exp_avg_sq"):
        stored = torch.cat([b[2][key].flatten() for b, _ in pairs]).cpu()
        exact = torch.cat([f[2][key].flatten() for _, f in pairs]).cpu()
        assert_stochastically_rounded(stored, exact)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_bf16_moments_round_stochastically() -> None:
    """One step of the kernel with the compact state against the same kernel with the full one (same start): equal
    masters, each weight the master's top half, moments stochastically rounded; the same seed repeats the bits,
    another step or seed draws new ones."""
    runs = []
    for seed in (11, 11, 12):
        bf16_items, fp32_items = _grouped_items("cuda", torch.bfloat16)
        _update_triton(bf16_items, 1e-2, 0.9, 0.95, 1e-8, 0.1, seed=seed)
        _update_triton(fp32_items, 1e-2, 0.9, 0.95, 1e-8, 0.1)
        _assert_compact_state_follows(list(zip(bf16_items, fp32_items, strict=True)))
        runs.append(torch.cat([s["exp_avg_sq"].flatten() for _, _, s in bf16_items]))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    bf16_items, _ = _grouped_items("cuda", torch.bfloat16)
    for _, _, state in bf16_items:
        state["step"].fill_(6.0)  # another step count: other bits with the same seed
    _update_triton(bf16_items, 1e-2, 0.9, 0.95, 1e-8, 0.1, seed=11)
    assert not torch.equal(runs[0], torch.cat([s["exp_avg_sq"].flatten() for _, _, s in bf16_items]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("block", "num_warps"), [(2048, 8), (1024, 4), (16384, 16)])
def test_grouped_kernel_launches_match_torch_operations(block: int, num_warps: int) -> None:
    kernel_items, torch_items = _grouped_items("cuda")
    lr = torch.tensor(1e-2, device="cuda")
    _update_triton(kernel_items, lr, 0.9, 0.95, 1e-8, 0.1, block=block, num_warps=num_warps)
    for param, grad, state in torch_items:
        _update_torch(param, grad, state, lr, 0.9, 0.95, 1e-8, 0.1)
    for (kernel_param, _, kernel_state), (torch_param, _, torch_state) in zip(kernel_items, torch_items,
                                                                              strict=True):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            scale = torch_state[key].abs().max().item()
            torch.testing.assert_close(kernel_state[key], torch_state[key], rtol=1e-6, atol=1e-6 * scale)
        assert torch.equal(kernel_param, kernel_state["master"].bfloat16())
        _assert_within_one_bf16_ulp(kernel_param, torch_param)
