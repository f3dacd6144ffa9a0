"""The memory planner against what PyTorch really allocates and saves (CPU: saved-tensor hooks, AdamW state)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmtrain.cli import main
from lmtrain.config import ModelConfig
from lmtrain.errors import LmtrainError
from lmtrain.flops import parameter_count
from lmtrain.memory_plan import (
    GIB,
    MemoryEstimate,
    estimate_memory,
    linear_parameter_count,
    max_fitting,
    parameter_tensor_count,
    saved_activation_bytes,
    warn_if_too_large,
)
from lmtrain.model import TransformerLM
from lmtrain.optim import MasterWeightAdamW, linear_weights, weight_decay_groups

B, T = 2, 64


def tiny(attention: str = "sdpa", checkpointing: bool = False, layers: int = 2) -> ModelConfig:
    return ModelConfig.from_size("tiny", vocab_size=256, context_length=T, num_layers=layers, attention=attention,
                                 activation_checkpointing=checkpointing)


def measured_saved_bytes(cfg: ModelConfig, precision: str, device: str = "cpu") -> int:
    """Bytes of the distinct storages autograd saves in one forward + loss (parameters and buffers excluded)."""
    torch.manual_seed(0)
    model = TransformerLM(cfg).to(device)
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)
    if cfg.master_weights:  # the linear weights in bf16, as the master-weight optimizer stores them
        MasterWeightAdamW(model.parameters(), bf16_params=linear_weights(model))
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    batch = torch.randint(0, cfg.vocab_size, (B, T + 1), device=device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()  # the saved tensors were usable
    return sum(seen.values())


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("attention", ["naive", "sdpa", "flash_pytorch"])
def test_saved_activations_match_autograd(attention: str, precision: str, checkpointing: bool) -> None:
    cfg = tiny(attention, checkpointing)
    measured = measured_saved_bytes(cfg, precision)
    planned = saved_activation_bytes(cfg, B, T, precision, device_type="cpu")
    # The task asks for 15%; every term is derived from the model's code, so the plan is held to 2%.
    assert planned == pytest.approx(measured, rel=0.02)


def test_saved_activations_bf16_true_close() -> None:
    cfg = tiny("sdpa")
    assert saved_activation_bytes(cfg, B, T, "bf16-true", "cpu") == pytest.approx(
        measured_saved_bytes(cfg, "bf16-true"), rel=0.15)


def test_naive_attention_term_grows_quadratically() -> None:
    naive, sdpa = tiny("naive"), tiny("sdpa")
    a = saved_activation_bytes(naive, 1, 4096) - saved_activation_bytes(sdpa, 1, 4096)
    b = saved_activation_bytes(naive, 1, 8192) - saved_activation_bytes(sdpa, 1, 8192)
    assert 3.9 < b / a < 4.1  # the B*H*T^2 score terms dominate


def step_and_check_static_bytes(cfg: ModelConfig, model: TransformerLM, opt: torch.optim.Optimizer,
                                precision: str) -> tuple[MemoryEstimate, int]:
    """One training step of ``model`` (bf16 autocast under bf16-mixed), then the plan's parameter, gradient and
    optimizer-state bytes against the tensors that exist. Returns (the plan, the gradient bytes)."""
    batch = torch.randint(0, cfg.vocab_size, (B, T + 1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        logits = model(batch[:, :-1])
    F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).backward()
    opt.step()
    plan = estimate_memory(cfg, B, T, precision, "train", device_type="cpu")
    params = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    grads = sum(p.grad.nbytes for p in model.parameters())
    states = sum(v.nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    assert plan.components["parameters"] == params
    assert plan.details["gradients"]["all"] == grads
    assert plan.components["optimizer_states"] == states
    return plan, grads


def test_parameters_gradients_and_adamw_state_are_exact() -> None:
    cfg = tiny("sdpa")
    model = TransformerLM(cfg)
    plan, grads = step_and_check_static_bytes(cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-3), "32-true")
    # Gradients exist only from the backward pass on (LMModule frees them after each optimizer step).
    assert plan.components["gradients"] == (grads if plan.moment == "end of backward" else 0)
    assert parameter_tensor_count(cfg) == len(list(model.parameters()))
    assert parameter_count(cfg) * 4 == grads


@pytest.mark.parametrize("state", ["float32", "bfloat16"])
def test_master_weights_parameters_gradients_and_state_are_exact(state: str) -> None:
    cfg = tiny("sdpa").replace(master_weights=True, optimizer_state_dtype=state)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    opt = MasterWeightAdamW(weight_decay_groups(model, 0.1), lr=1e-3, bf16_params=linear_weights(model),
                            state_dtype=torch.bfloat16 if state == "bfloat16" else torch.float32)
    plan, grads = step_and_check_static_bytes(cfg, model, opt, "bf16-mixed")
    assert linear_parameter_count(cfg) == sum(p.numel() for p in linear_weights(model))
    # Against the fp32-weight plan: the static state is as large with fp32 masters, 6 bytes per linear-layer
    # parameter smaller with the compact state (measured at 2.7B on an H100: 52.6 and 33.6 GiB peaks, 19.0 GiB
    # apart; this plan's difference there: 6 * P_mm = 18.9 GiB).
    plain = estimate_memory(cfg.replace(master_weights=False, optimizer_state_dtype="float32"), B, T, "bf16-mixed",
                            "train", device_type="cpu")
    static = ("parameters", "optimizer_states")
    saved = 6 * linear_parameter_count(cfg) if state == "bfloat16" else 0
    assert sum(plan.components[k] for k in static) + grads == (
        sum(plain.components[k] for k in static) + plain.details["gradients"]["all"] - saved)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_master_weights_saved_activations_match_autograd(checkpointing: bool) -> None:
    """bf16 weights: autocast casts none of them, so no weight copies are saved."""
    cfg = tiny("sdpa", checkpointing).replace(master_weights=True)
    measured = measured_saved_bytes(cfg, "bf16-mixed")
    assert saved_activation_bytes(cfg, B, T, "bf16-mixed", device_type="cpu") == pytest.approx(measured, rel=0.02)
    assert measured < measured_saved_bytes(cfg.replace(master_weights=False), "bf16-mixed")


def test_master_weights_plans_are_refused_where_the_run_is() -> None:
    cfg = tiny("sdpa").replace(master_weights=True)
    with pytest.raises(LmtrainError, match="bf16-mixed"):
        estimate_memory(cfg, B, T, "32-true", "train")
    with pytest.raises(LmtrainError, match="bf16-mixed"):
        estimate_memory(cfg, B, T, "32-true", strategy="fsdp", world_size=2)
    # Under FSDP2 the run takes master weights (the fp32 shards are the masters), and so does the plan.
    assert estimate_memory(cfg, B, T, "bf16-mixed", strategy="fsdp", world_size=2).peak_gib > 0
    with pytest.raises(LmtrainError, match="model.optimizer_state_dtype"):
        tiny("sdpa").replace(optimizer_state_dtype="bfloat16")


def test_modes_order_and_no_autocast_weight_cache() -> None:
    cfg = ModelConfig.from_size("2.7B", context_length=512)
    fwd = estimate_memory(cfg, 4, 512, "32-true", "forward").peak
    fb = estimate_memory(cfg, 4, 512, "32-true", "forward_backward").peak
    train = estimate_memory(cfg, 4, 512, "32-true", "train").peak
    assert fwd < fb < train
    # Lightning's autocast has cache_enabled=False: a bf16-mixed forward holds the fp32 weights and one weight's
    # bf16 copy at a time, not a cached bf16 copy of every weight (H100: 12.98 GiB bf16 vs 13.08 GiB fp32).
    bf16 = estimate_memory(cfg, 4, 512, "bf16-mixed", "forward")
    weights_bf16 = 2 * estimate_memory(cfg, 4, 512, "32-true", "forward").components["parameters"] / 4
    assert abs(bf16.peak - fwd) < 0.05 * fwd and bf16.peak < fwd + weights_bf16 / 10
    assert bf16.components["weight_cast"] == 2 * cfg.d_model * cfg.d_ff
    ckpt = ModelConfig.from_size("2.7B", context_length=512, activation_checkpointing=True)
    assert estimate_memory(ckpt, 4, 512, "32-true", "train").peak < train


def test_max_context_search_is_monotone_and_tight() -> None:
    cfg = ModelConfig.from_size("small", context_length=1024, attention="naive")
    previous = 0
    for gib in (4, 8, 16, 32, 64):
        budget = gib * GIB
        t = max_fitting(cfg, budget, batch_size=4, precision="bf16-mixed")
        assert t >= previous
        assert estimate_memory(cfg, 4, t, "bf16-mixed").needed <= budget < estimate_memory(
            cfg, 4, t + 1, "bf16-mixed").needed
        previous = t
    b = max_fitting(cfg, 16 * GIB, seq_len=512, precision="32-true")
    assert estimate_memory(cfg, b, 512).needed <= 16 * GIB < estimate_memory(cfg, b + 1, 512).needed
    assert max_fitting(cfg, 1024, batch_size=1) == 0  # the parameters alone do not fit


def test_warn_if_too_large_is_silent_without_cuda() -> None:
    class Trainer:
        precision = "32-true"

        class strategy:  # noqa: N801 (mimics trainer.strategy)
            root_device = torch.device("cpu")

    class Module:
        config = tiny()
        step_mode = "train"

    assert warn_if_too_large(Module(), None, Trainer()) is None


def _cpu_trainer(strategy: object, devices: int = 2) -> object:
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision="bf16-mixed", logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def test_the_fit_start_plan_is_that_of_the_trainers_strategy() -> None:
    """The plan ``warn_if_too_large`` judges is per GPU under the trainer's strategy and world size: lmtrain's DDP
    (buckets, gradients as views into them), Lightning's ``auto`` on 2 devices (DDP with PyTorch's defaults: the
    gradients copied into the buckets), FSDP2 (shards); one device: the one-GPU plan."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from lmtrain.distributed import ddp_strategy
    from lmtrain.memory_plan import fit_plan

    class Module:
        config = tiny()
        step_mode = "train"

    class Data:
        batch_size = B

    def planned(**parallel: object) -> MemoryEstimate:
        return estimate_memory(tiny(), B, None, "bf16-mixed", "train", **parallel)

    single = planned()
    assert fit_plan(Module(), Data(), _cpu_trainer("auto", devices=1)).components == single.components
    ours = fit_plan(Module(), Data(), _cpu_trainer(ddp_strategy()))
    assert ours.details["strategy"] == "ddp" and ours.details["world_size"] == 2
    assert ours.components == planned(strategy="ddp", world_size=2, gradient_as_bucket_view=True).components
    assert ours.components["ddp_buckets"] > 0 and ours.components["gradients"] == 0
    auto = fit_plan(Module(), Data(), _cpu_trainer("auto"))
    assert auto.components == planned(strategy="ddp", world_size=2).components
    assert auto.components["gradients"] > 0 and auto.needed > single.needed
    fsdp = fit_plan(Module(), Data(), _cpu_trainer(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)))
    assert fsdp.details["strategy"] == "fsdp" and fsdp.details["world_size"] == 2
    assert fsdp.components == planned(strategy="fsdp", world_size=2).components
    # A strategy the planner has no plan for (Lightning's FSDP1) is not judged.
    unplanned = type("Trainer", (), {"precision": "bf16-mixed", "strategy": FSDPStrategy(), "world_size": 2})()
    assert fit_plan(Module(), Data(), unplanned) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_fit_start_warning_plans_ddp_on_a_gpu() -> None:
    """On a CUDA trainer under lmtrain's DDP the warning judges the DDP plan (buckets included) and says so."""
    import lightning.pytorch as pl

    from lmtrain.distributed import ddp_strategy

    class Module:
        config = ModelConfig.from_size("2.7B", context_length=16384, attention="sdpa")
        step_mode = "train"

    class Data:
        batch_size = 4

    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=ddp_strategy(), precision="bf16-mixed",
                         logger=False, enable_checkpointing=False)
    with pytest.warns(UserWarning, match=r"per GPU \(ddp over 1 GPUs\)"):
        plan = warn_if_too_large(Module(), Data(), trainer)
    assert plan.details["strategy"] == "ddp" and plan.components["ddp_buckets"] > 0


def test_estimate_reads_the_strategy_and_device_count_as_the_trainer_would(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``auto`` on 2 devices is Lightning's DDP (PyTorch's 25 MiB buckets, gradients copied into them); a device
    list counts its devices; ``ddp`` is lmtrain's DDP (100 MiB buckets, gradients as views), a ``class_path``
    DDPStrategy its own arguments; Lightning's ``fsdp`` has no plan: one line, exit 2."""
    base = ["estimate", "--config", "configs/tiny.yaml", "--trainer.precision", "bf16-mixed"]
    assert main([*base, "--trainer.devices", "2"]) == 0
    out = capsys.readouterr().out
    assert "per GPU, ddp over 2 GPUs" in out and "prediction: ddp on 2 GPU(s)" in out
    assert "| ddp_buckets |" in out and "the last 25 MiB bucket" in out
    assert main([*base, "--trainer.devices", "0,1", "--trainer.strategy", "ddp"]) == 0
    out = capsys.readouterr().out
    assert "per GPU, ddp over 2 GPUs" in out and "prediction: ddp on 2 GPU(s)" in out
    assert "the last 100 MiB bucket" in out
    strategy = tmp_path / "ddp.yaml"
    strategy.write_text("trainer:\n  strategy:\n    class_path: lightning.pytorch.strategies.DDPStrategy\n"
                        "    init_args:\n      bucket_cap_mb: 50\n")
    assert main([*base, "--config", str(strategy), "--trainer.devices", "2"]) == 0
    out = capsys.readouterr().out
    assert "per GPU, ddp over 2 GPUs" in out and "the last 50 MiB bucket" in out
    assert main([*base, "--trainer.devices", "0,1,2", "--trainer.strategy",
                 "lightning.pytorch.strategies.ModelParallelStrategy"]) == 0
    assert "per GPU, fsdp over 3 GPUs" in capsys.readouterr().out
    assert main([*base, "--trainer.strategy", "fsdp", "--trainer.devices", "2"]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: trainer.strategy:") and "Fix:" in errors[0]
    assert "Traceback" not in captured.err


def test_estimate_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--config", "configs/tiny.yaml", "--model.context_length", "256",
                 "--trainer.precision", "bf16-mixed", "--gpu-memory-gib", "2"]) == 0
    out = capsys.readouterr().out
    assert "| optimizer_states |" in out and "**peak**" in out
    assert "batch 16 x context 256, bf16-mixed" in out
    assert "Largest context at batch 16:" in out
    assert main(["estimate", "--model.size", "nope"]) == 2


def test_estimate_command_plans_the_memory_options_and_strategies(capsys: pytest.CaptureFixture[str]) -> None:
    """The 2.7B step at 16k that ran out of memory on an 80 GB H100 does not fit; with the options it does."""
    base = ["estimate", "--config", "configs/2.7B_bf16.yaml", "--model.context_length", "16384",
            "--model.activation_checkpointing", "full"]
    assert main(base) == 0
    assert "does NOT fit" in capsys.readouterr().out
    assert main([*base, "--model.optimizer_in_backward", "true", "--model.loss_chunk_tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert " fits in 74." in out and "optimizer in the backward pass" in out and "chunks of 4096" in out
    assert main(["estimate", "--config", "configs/2.7B_bf16.yaml", "--trainer.strategy", "ddp",
                 "--trainer.devices", "2"]) == 0
    assert "per GPU, ddp over 2 GPUs" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("attention", ["naive", "sdpa", "flash_triton"])
def test_saved_activations_match_autograd_cuda(attention: str, precision: str) -> None:
    cfg = tiny(attention)
    measured = measured_saved_bytes(cfg, precision, "cuda")
    planned = saved_activation_bytes(cfg, B, T, precision, device_type="cuda")
    print(f"{attention} {precision}: planned {planned} measured {measured}")
    assert planned == pytest.approx(measured, rel=0.02)


# -- long-context options (docs/long_context.md) -----------------------------------------------------------------


def test_capacity_subtracts_the_context_and_fragmentation_allowances() -> None:
    from lmtrain.errors import LmtrainError
    from lmtrain.memory_plan import CUDA_CONTEXT_BYTES, FRAGMENTATION_FRACTION, device_capacity_bytes

    if torch.cuda.is_available():
        pytest.skip("a visible GPU's own size is used")
    assert device_capacity_bytes(80) == int(80 * GIB - CUDA_CONTEXT_BYTES - FRAGMENTATION_FRACTION * 80 * GIB)
    with pytest.raises(LmtrainError) as info:
        device_capacity_bytes()
    assert info.value.field == "--gpu-memory-gib"


def test_the_16k_case_that_ran_out_of_memory_does_not_fit_and_the_options_make_it_fit() -> None:
    from lmtrain.memory_plan import device_capacity_bytes, fits

    capacity = device_capacity_bytes(80) if not torch.cuda.is_available() else 75 * GIB

    def plan(t: int, **options: object) -> object:
        cfg = ModelConfig.from_size("2.7B", context_length=t, attention="flash_triton", **options)
        return estimate_memory(cfg, 4, None, "bf16-mixed")

    # Measured on an H100: context 8192 trains (57.6 GiB peak), 16384 runs out of memory.
    assert fits(plan(8192, activation_checkpointing="full"), capacity)
    assert not fits(plan(16384, activation_checkpointing="full"), capacity)
    assert fits(plan(16384, activation_checkpointing="full", optimizer_in_backward=True, loss_chunk_tokens=4096),
                capacity)
    assert fits(plan(16384, activation_checkpointing="offload"), capacity)


def test_optimizer_in_backward_keeps_at_most_two_parameter_gradients() -> None:
    from lmtrain.memory_plan import largest_parameter_elements

    cfg = ModelConfig.from_size("2.7B", context_length=4096, activation_checkpointing="full")
    ordinary = estimate_memory(cfg, 4, None, "bf16-mixed")
    in_backward = estimate_memory(cfg.replace(optimizer_in_backward=True), 4, None, "bf16-mixed")
    assert in_backward.components["gradients"] <= 2 * largest_parameter_elements(cfg) * 4
    assert in_backward.components["optimizer_states"] == ordinary.components["optimizer_states"]
    assert in_backward.peak < ordinary.peak


def test_offload_keeps_the_layer_inputs_on_the_host() -> None:
    from lmtrain.memory_plan import head_activation_bytes

    cfg = tiny(checkpointing=True).replace(activation_checkpointing="offload")
    plan = estimate_memory(cfg, B, T, "bf16-mixed")
    assert saved_activation_bytes(cfg, B, T, "bf16-mixed") == sum(head_activation_bytes(cfg, B, T, "bf16-mixed")
                                                                   .values())
    assert plan.details["host_bytes"] == cfg.num_layers * B * T * cfg.d_model * 4


def test_partial_checkpointing_plans_between_full_and_none() -> None:
    """Blocks past checkpoint_layers keep everything (rest none) or their selective outputs (rest selective)."""
    cfg = tiny().replace(activation_checkpointing="full")
    full, none = (saved_activation_bytes(cfg.replace(activation_checkpointing=p), B, T, "bf16-mixed")
                  for p in ("full", "none"))
    layers = cfg.num_layers
    one_whole = saved_activation_bytes(cfg.replace(checkpoint_layers=layers - 1), B, T, "bf16-mixed")
    one_selective = saved_activation_bytes(cfg.replace(checkpoint_layers=layers - 1, checkpoint_rest="selective"),
                                           B, T, "bf16-mixed")
    assert one_whole - full == (none - full) // layers
    assert full < one_selective < one_whole


def test_selective_keeps_more_than_full_and_less_than_none() -> None:
    saved = {p: saved_activation_bytes(tiny().replace(activation_checkpointing=p), B, T, "bf16-mixed")
             for p in ("none", "full", "selective")}
    assert saved["full"] < saved["selective"] < saved["none"]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_chunked_loss_saved_activations_match_autograd(precision: str) -> None:
    cfg = tiny().replace(loss_chunk_tokens=24)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in own:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    batch = torch.randint(0, cfg.vocab_size, (B, T + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        loss = model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    planned = saved_activation_bytes(cfg, B, T, precision, device_type="cpu")
    assert planned == pytest.approx(sum(seen.values()), rel=0.02)
    # ... and far less than the unchunked head's, which keeps the (n, V) log-softmax.
    assert planned < saved_activation_bytes(tiny(), B, T, precision, device_type="cpu")


def test_the_last_layers_backward_holds_no_loss_buffers_and_fits_counts_them_cached() -> None:
    """Measured on an H100 (2.7B, bf16-mixed, batch 4, context 16384, full checkpointing, optimizer in the
    backward pass): the same 71.49 GiB peak with and without loss chunks, and without chunks 6.6 GiB reserved
    beyond it; the step without the optimizer in the backward pass and without chunks ran out of memory with
    8.1 GiB reserved but free."""
    from lmtrain.memory_plan import LOSS_MOMENTS, device_capacity_bytes, fits

    def plan(**options: object):
        cfg = ModelConfig.from_size("2.7B", context_length=16384, attention="sdpa", activation_checkpointing="full",
                                    **options)
        return estimate_memory(cfg, 4, None, "bf16-mixed")

    whole, chunked = plan(optimizer_in_backward=True), plan(optimizer_in_backward=True, loss_chunk_tokens=4096)
    assert whole.moment == chunked.moment == "last layer backward" and whole.moment not in LOSS_MOMENTS
    assert abs(whole.peak - chunked.peak) < 0.005 * chunked.peak
    assert abs(whole.peak_gib - 71.49) < 0.05 * 71.49
    n, v = 4 * 16384, 10_000
    assert whole.cached == n * v * (2 * 4 + 2) and whole.needed == whole.peak + whole.cached  # logits, fp32 grads
    assert chunked.cached == 0 and chunked.needed == chunked.peak
    capacity = device_capacity_bytes(79.18) if not torch.cuda.is_available() else int(74.22 * GIB)
    assert fits(chunked, capacity) and whole.peak < capacity and not fits(whole, capacity)
    assert not fits(plan(), capacity) and fits(plan(loss_chunk_tokens=4096), capacity)
    assert "| **needed** |" in whole.table() and "needed" not in chunked.table()
