"""Long-context memory options: in-backward AdamW, checkpointing policies, chunked loss (CPU, fp32).

Tolerances: the policies recompute the same fp32 operations in the same order, and the in-backward optimizer runs
the same AdamW arithmetic per parameter, so results agree to fp32 rounding (1e-6 absolute on parameters of
magnitude ~1e-1 after 5 steps; 1e-6 relative / 1e-7 absolute on losses and gradients). The chunked loss sums the
cross-entropy chunk by chunk, a different summation order: 1e-6 relative.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from fitting import cpu_fit
from torch.utils._python_dispatch import TorchDispatchMode

from lmtrain.config import ModelConfig
from lmtrain.errors import LmtrainError
from lmtrain.model import TransformerLM
from lmtrain.module import LMModule
from lmtrain.optim import InBackwardAdamW

VOCAB, CONTEXT, BATCH = 64, 16, 2
GRAD_TOL = dict(rtol=1e-6, atol=1e-7)


def small_module(**kwargs: Any) -> LMModule:
    defaults = dict(size="tiny", vocab_size=VOCAB, context_length=CONTEXT, d_model=32, num_layers=2, num_heads=2,
                    d_ff=64, warmup_steps=2, lr=1e-2, weight_decay=0.1)
    module = LMModule(**{**defaults, **kwargs})
    torch.manual_seed(0)
    module.configure_model()
    return module


def fit(module: LMModule, steps: int, callbacks: list[pl.Callback] | None = None, **trainer_kwargs: Any) -> pl.Trainer:
    return cpu_fit(module, steps, batch=BATCH, context=CONTEXT, vocab=VOCAB, callbacks=callbacks, **trainer_kwargs)


class GradsAfterBackward(pl.Callback):
    """How many parameters hold a gradient right after each backward pass."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.counts.append(sum(p.grad is not None for p in pl_module.parameters()))


# -- optimizer in the backward pass ------------------------------------------------------------------------------


def test_optimizer_in_backward_matches_the_ordinary_step() -> None:
    ordinary, in_backward = small_module(), small_module(optimizer_in_backward=True)
    start = {k: v.clone() for k, v in ordinary.state_dict().items()}
    seen = GradsAfterBackward()
    trainer_a = fit(ordinary, steps=5)
    trainer_b = fit(in_backward, steps=5, callbacks=[seen])
    assert trainer_b.global_step == 5  # Lightning counts the steps (max_steps ends the run)
    a, b = ordinary.state_dict(), in_backward.state_dict()
    for name in a:
        assert not torch.equal(a[name], start[name]), name  # every tensor moved, the norm gains included
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)
    assert seen.counts == [0] * 5  # each gradient was freed as soon as its update was made
    # Same schedule: the groups' learning rates after 5 steps (warmup 2, cosine to max_steps).
    (opt_a,), (opt_b,) = trainer_a.optimizers, trainer_b.optimizers
    assert [g["lr"] for g in opt_b.param_groups] == pytest.approx([g["lr"] for g in opt_a.param_groups])
    assert [g["weight_decay"] for g in opt_b.param_groups] == [0.1, 0.0]


def test_in_backward_groups_are_the_weight_decay_groups() -> None:
    module = small_module(optimizer_in_backward=True)
    optimizer = module.configure_optimizers()["optimizer"]
    assert isinstance(optimizer, InBackwardAdamW)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.ndim == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.ndim == 1 for p in no_decay["params"])
    assert {id(p) for p in decay["params"] + no_decay["params"]} == {id(p) for p in module.parameters()}


def test_in_backward_updates_only_inside_step_and_state_round_trips() -> None:
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.from_size("tiny", vocab_size=VOCAB, context_length=CONTEXT, num_layers=1))
    params = list(model.parameters())
    optimizer = InBackwardAdamW([{"params": params, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1))

    def closure() -> torch.Tensor:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        return loss

    before = [p.detach().clone() for p in params]
    closure()  # a backward pass outside step: an ordinary gradient, no update
    assert all(p.grad is not None for p in params)
    assert all(torch.equal(p, q) for p, q in zip(params, before, strict=True))
    model.zero_grad(set_to_none=True)
    optimizer.step(closure)
    assert all(p.grad is None for p in params)
    assert not any(torch.equal(p, q) for p, q in zip(params, before, strict=True))
    state = optimizer.state_dict()
    assert len(state["state"]) == len(params) and int(state["state"][0]["step"]) == 1

    again = InBackwardAdamW([{"params": params, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    optimizer.remove_hooks()
    again.load_state_dict(state)
    again.step(closure)
    assert int(again.state_dict()["state"][0]["step"]) == 2  # the restored state is the one that stepped


@pytest.mark.parametrize("trainer_kwargs, problem", [
    (dict(accumulate_grad_batches=2), "accumulate_grad_batches=2"),
    (dict(gradient_clip_val=1.0), "gradient_clip_val=1.0"),
    (dict(precision="16-mixed"), "precision=16-mixed"),
])
def test_in_backward_refuses_incompatible_trainer_settings(trainer_kwargs: dict, problem: str) -> None:
    module = small_module(optimizer_in_backward=True)
    trainer = SimpleNamespace(**{"accumulate_grad_batches": 1, "gradient_clip_val": None, "precision": "32-true",
                                 **trainer_kwargs})
    with pytest.raises(LmtrainError) as info:
        module.check_trainer(trainer)
    assert info.value.field == "model.optimizer_in_backward"
    assert problem in str(info.value) and "Fix:" in str(info.value) and "\n" not in str(info.value)


def test_in_backward_refuses_gradient_accumulation_in_fit() -> None:
    module = small_module(optimizer_in_backward=True)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(LmtrainError, match="accumulate_grad_batches"):
        fit(module, steps=2, accumulate_grad_batches=2)
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())  # stopped before any step


@pytest.mark.parametrize("mode", ["forward", "forward_backward"])
def test_in_backward_refuses_step_modes_without_a_step(mode: str) -> None:
    with pytest.raises(LmtrainError) as info:
        small_module(optimizer_in_backward=True, step_mode=mode)
    assert info.value.field == "model.optimizer_in_backward" and mode in str(info.value)


def test_overlap_needs_in_backward() -> None:
    with pytest.raises(LmtrainError) as info:
        ModelConfig(optimizer_overlap=True)
    assert info.value.field == "model.optimizer_overlap"


def test_overlap_on_cpu_is_the_in_backward_step() -> None:
    plain, overlap = small_module(optimizer_in_backward=True), small_module(optimizer_in_backward=True,
                                                                            optimizer_overlap=True)
    fit(plain, steps=3)
    fit(overlap, steps=3)
    for name, value in plain.state_dict().items():
        assert torch.equal(overlap.state_dict()[name], value), name


# -- checkpointing policies --------------------------------------------------------------------------------------


def tiny_config(**kwargs: Any) -> ModelConfig:
    return ModelConfig.from_size("tiny", vocab_size=VOCAB, context_length=CONTEXT, num_layers=2, **kwargs)


def loss_and_grads(cfg: ModelConfig, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = TransformerLM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(1))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("attention", ["naive", "sdpa", "flash_pytorch"])
@pytest.mark.parametrize("policy", ["full", "selective", "offload"])
def test_checkpointing_policy_gives_the_plain_loss_and_gradients(policy: str, attention: str) -> None:
    loss, grads = loss_and_grads(tiny_config(attention=attention))
    loss_p, grads_p = loss_and_grads(tiny_config(attention=attention, activation_checkpointing=policy))
    torch.testing.assert_close(loss_p, loss, **GRAD_TOL)
    for name, g in grads.items():
        torch.testing.assert_close(grads_p[name], g, **GRAD_TOL, msg=name)


@pytest.mark.parametrize(("layers", "rest"), [(0, "none"), (1, "none"), (1, "selective"), (0, "selective")])
def test_partial_checkpointing_gives_the_plain_loss_and_gradients(layers: int, rest: str) -> None:
    """The first ``checkpoint_layers`` blocks checkpointed, the others whole or selective: the plain numbers."""
    loss, grads = loss_and_grads(tiny_config(attention="sdpa"))
    cfg = tiny_config(attention="sdpa", activation_checkpointing="full", checkpoint_layers=layers, checkpoint_rest=rest)
    loss_p, grads_p = loss_and_grads(cfg)
    torch.testing.assert_close(loss_p, loss, **GRAD_TOL)
    for name, g in grads.items():
        torch.testing.assert_close(grads_p[name], g, **GRAD_TOL, msg=name)


def test_partial_checkpointing_recomputes_only_the_checkpointed_blocks() -> None:
    """One of two blocks checkpointed: the backward pass runs half the extra matrix products of ``full``."""
    def extra_mm(**kwargs: Any) -> int:
        torch.manual_seed(0)
        model = TransformerLM(tiny_config(attention="sdpa", **kwargs))
        tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(1))
        with CountOps() as ops:
            model(tokens[:, :-1], tokens[:, 1:]).backward()
        return ops.counts.get("aten.mm", 0)

    plain, full = extra_mm(), extra_mm(activation_checkpointing="full")
    half = extra_mm(activation_checkpointing="full", checkpoint_layers=1)
    assert full > plain
    assert half - plain == (full - plain) // 2


def test_bad_partial_checkpointing_is_refused() -> None:
    with pytest.raises(LmtrainError, match="model.checkpoint_layers"):
        tiny_config(checkpoint_layers=-1)
    with pytest.raises(LmtrainError, match="model.checkpoint_rest"):
        tiny_config(checkpoint_rest="offload")


class CountOps(TorchDispatchMode):
    """Counts calls of each ATen operation."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = str(func.overloadpacket)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def backward_op_counts(policy: str) -> dict[str, int]:
    torch.manual_seed(0)
    model = TransformerLM(tiny_config(activation_checkpointing=policy))
    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    with CountOps() as counter:
        loss.backward()
    return counter.counts


def test_selective_keeps_matmul_and_attention_outputs_and_recomputes_the_rest() -> None:
    plain, full, selective = (backward_op_counts(p) for p in ("none", "full", "selective"))
    # Full checkpointing runs every block's products and attention again; selective runs none of them again.
    sdpa = "aten._scaled_dot_product_flash_attention_for_cpu"
    assert full["aten.mm"] > plain["aten.mm"] and full.get(sdpa, 0) == 2  # once per block
    assert selective["aten.mm"] == plain["aten.mm"] and selective.get(sdpa, 0) == plain.get(sdpa, 0) == 0
    # ... but the elementwise work (RMSNorm's rsqrt, SiLU) is recomputed.
    assert selective["aten.rsqrt"] > plain.get("aten.rsqrt", 0)
    assert selective["aten.silu"] > plain.get("aten.silu", 0)


def test_checkpointing_booleans_are_aliases() -> None:
    assert tiny_config(activation_checkpointing=True).activation_checkpointing == "full"
    assert tiny_config(activation_checkpointing=False).activation_checkpointing == "none"
    assert tiny_config(activation_checkpointing="true").activation_checkpointing == "full"
    assert ModelConfig().activation_checkpointing == "none"
    with pytest.raises(LmtrainError) as info:
        tiny_config(activation_checkpointing="sometimes")
    assert info.value.field == "model.activation_checkpointing" and "selective" in info.value.fix


# -- chunked loss ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 32, 1000])  # one token, not a divisor of B*T=32, exactly B*T, above it
def test_chunked_loss_gives_the_plain_loss_and_gradients(chunk: int) -> None:
    loss, grads = loss_and_grads(tiny_config())
    loss_c, grads_c = loss_and_grads(tiny_config(loss_chunk_tokens=chunk))
    torch.testing.assert_close(loss_c, loss, rtol=1e-6, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(grads_c[name], g, **GRAD_TOL, msg=name)


class LargestLogits(TorchDispatchMode):
    """Largest number of token rows of any tensor whose last dimension is the vocabulary (logits and their kin);
    the head weight's transposed view (D, V) is not a logits tensor and is skipped."""

    def __init__(self, vocab: int, d_model: int) -> None:
        super().__init__()
        self.vocab, self.d_model, self.rows = vocab, d_model, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if (isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[-1] == self.vocab
                    and tuple(t.shape) != (self.d_model, self.vocab)):
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("chunk", [0, 8])
def test_chunked_loss_never_makes_the_whole_logits(chunk: int) -> None:
    torch.manual_seed(0)
    vocab = 97  # no other dimension of the tiny model has this size
    model = TransformerLM(ModelConfig.from_size("tiny", vocab_size=vocab, context_length=CONTEXT, num_layers=1,
                                                loss_chunk_tokens=chunk))
    tokens = torch.randint(0, vocab, (BATCH, CONTEXT + 1))
    with LargestLogits(vocab, model.cfg.d_model) as largest:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert largest.rows == (chunk or BATCH * CONTEXT)


def test_chunked_loss_under_no_grad_and_bf16_autocast() -> None:
    torch.manual_seed(0)
    plain = TransformerLM(tiny_config())
    chunked = TransformerLM(tiny_config(loss_chunk_tokens=5))
    chunked.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1))
    with torch.no_grad():
        torch.testing.assert_close(chunked(tokens[:, :-1], tokens[:, 1:]), plain(tokens[:, :-1], tokens[:, 1:]),
                                   rtol=1e-6, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = plain(tokens[:, :-1], tokens[:, 1:]), chunked(tokens[:, :-1], tokens[:, 1:])
    assert a.dtype == b.dtype == torch.float32
    # Same bf16 logits per row, fp32 cross-entropy: only the order of the fp32 sum differs.
    torch.testing.assert_close(b, a, rtol=1e-5, atol=0)


def test_bad_loss_chunk_is_refused() -> None:
    with pytest.raises(LmtrainError) as info:
        tiny_config(loss_chunk_tokens=-1)
    assert info.value.field == "model.loss_chunk_tokens"


# -- everything at once, through Lightning -----------------------------------------------------------------------


def test_all_options_together_train_like_the_plain_module() -> None:
    plain = small_module()
    combined = small_module(optimizer_in_backward=True, activation_checkpointing="selective", loss_chunk_tokens=7)
    fit(plain, steps=3)
    fit(combined, steps=3)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(combined.state_dict()[name], value, rtol=0, atol=1e-6, msg=name)


# -- GPU ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["selective", "offload"])
def test_policies_on_cuda_match_full_and_save_device_memory(policy: str) -> None:
    cfg = ModelConfig.from_size("small", vocab_size=1000, context_length=1024, num_layers=4)
    tokens = torch.randint(0, 1000, (2, 1025), device="cuda")
    results = {}
    for name in ("none", "full", policy):
        torch.manual_seed(0)
        model = TransformerLM(cfg.replace(activation_checkpointing=name)).cuda()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        saved = torch.cuda.memory_allocated() - base  # what the forward pass left for the backward pass
        loss.backward()
        results[name] = (loss.detach(), [p.grad.float() for p in model.parameters()], saved)
    loss_n, grads_n, saved_n = results["none"]
    loss_p, grads_p, saved_p = results[policy]
    torch.testing.assert_close(loss_p, loss_n, rtol=1e-3, atol=0)  # bf16 kernels may differ between re-runs
    for g_p, g_n in zip(grads_p, grads_n, strict=True):
        torch.testing.assert_close(g_p, g_n, rtol=2e-2, atol=2e-3)
    assert saved_p < saved_n
    if policy == "offload":
        assert saved_p < results["full"][2]
