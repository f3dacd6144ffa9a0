"""The step-time model behind ``estimate --trainer.devices N`` (``lmtrain.step_time``), on constructed inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmtrain.cli import main
from lmtrain.config import ModelConfig
from lmtrain.errors import LmtrainError
from lmtrain.estimate import OVERLAP_SLOWDOWN
from lmtrain.flops import flops_per_step, parameter_count
from lmtrain.model import TransformerLM
from lmtrain.optim import bf16_with_masters, linear_weights
from lmtrain.step_time import (
    BusBandwidth,
    Network,
    Units,
    collective_ms,
    ddp_bucket_bytes,
    describe,
    network_from_record,
    one_gpu_from_flops,
    one_gpu_from_record,
    predict,
    slowed_ms,
    units,
)

ROOT = Path(__file__).resolve().parents[1]


def _network(gbps: float, inter: float = 1.0) -> Network:
    flat = BusBandwidth.constant(gbps)
    return Network(flat, flat, flat, inter)


def test_collective_times_follow_the_bus_bandwidth_definition() -> None:
    # 1 GB over 4 ranks at 100 GB/s: each rank's link carries 3/4 of it (all-reduce: twice).
    assert collective_ms("all_gather", 10**9, 4, 100.0) == pytest.approx(7.5)
    assert collective_ms("reduce_scatter", 10**9, 4, 100.0) == pytest.approx(7.5)
    assert collective_ms("all_reduce", 10**9, 4, 100.0) == pytest.approx(15.0)
    assert collective_ms("all_gather", 10**9, 1, 100.0) == 0.0


def test_bandwidth_is_interpolated_on_log_size_and_clamped() -> None:
    curve = BusBandwidth((1000, 100_000), (10.0, 30.0))
    assert curve.at(10_000) == pytest.approx(20.0)
    assert curve.at(10) == 10.0 and curve.at(10**9) == 30.0
    network = Network(curve, curve, curve, inter_node_gbps=12.0)
    assert network.busbw("all_gather", 10**9, nodes=1) == 30.0
    assert network.busbw("all_gather", 10**9, nodes=2) == 12.0  # across nodes the network interface limits


# Three blocks of 1000 parameters (30% of the FLOPs each), a root of 500; bf16 gathers, fp32 gradients. At 1e-3 GB/s
# on 2 ranks an all-gather or reduce-scatter of S bytes takes S * (1/2) / 1e6 s = S * 0.5e-3 ms: of a block (2000
# bytes) 1 ms, of the root 0.5 ms; reduce-scatter of a block (4000 bytes) 2 ms, of the root 1 ms.
SMALL = Units(layers=3, block_params=1000, root_params=500, block_flops_share=0.3, gather_bytes=2, grad_bytes=4)


def test_fsdp_step_when_compute_hides_the_collectives() -> None:
    p = predict(SMALL, forward_ms=10.0, backward_ms=20.0, optimizer_ms=8.0, strategy="fsdp", world_size=2, nodes=1,
                network=_network(1e-3), tokens_per_step=1000)
    assert p.terms == pytest.approx({"all_gather_block": 1.0, "all_gather_root": 0.5, "reduce_scatter_block": 2.0,
                                     "reduce_scatter_root": 1.0})
    # Forward: root + first block exposed (1.5); blocks of 3 ms hide the next 1 ms gathers. Backward: blocks of 6 ms
    # hide 2, 3 and 1 ms; block 0's and the root's reduce-scatters (2 + 1) are exposed.
    assert p.exposed_ms == pytest.approx(4.5)
    # Gathers: root, 3 blocks forward, 2 blocks again backward; 3 block and one root reduce-scatters.
    assert p.communication_ms == pytest.approx(0.5 + 3 + 2 + 6 + 1)
    assert p.optimizer_ms == 4.0  # the shard's half
    assert p.step_ms == pytest.approx(10 + 20 + 4 + 4.5)
    assert p.tokens_per_s == pytest.approx(2 * 1000 / 38.5e-3)


def test_hidden_communication_slows_the_compute_beside_it() -> None:
    """The case above with compute 1.5x as long beside hidden communication: of 12.5 ms of collectives 4.5 are
    exposed and 8 hidden, which cost 8 * (1 - 1/1.5) = 8/3 ms more. Nothing hidden, nothing slowed."""
    kwargs = dict(forward_ms=10.0, backward_ms=20.0, optimizer_ms=8.0, strategy="fsdp", world_size=2, nodes=1,
                  network=_network(1e-3), tokens_per_step=1000)
    plain, slowed = predict(SMALL, **kwargs), predict(SMALL, **kwargs, overlap_slowdown=1.5)
    assert slowed.hidden_ms == pytest.approx(8.0) and slowed.slowed_ms == pytest.approx(8 / 3)
    assert slowed.step_ms == pytest.approx(plain.step_ms + 8 / 3) and plain.slowed_ms == 0.0
    assert "compute slowed beside communication 2.67 ms (8.00 ms hidden at 1.5x)" in describe(slowed, [])
    # Communication outlasts the compute beside it (blocks of 0.3 / 0.6 ms against 1 / 3 ms): the slowed compute
    # still fits under it, and the step does not grow.
    outlasting = predict(SMALL, **{**kwargs, "forward_ms": 1.0, "backward_ms": 2.0}, overlap_slowdown=1.5)
    assert outlasting.hidden_ms > 0 and outlasting.slowed_ms == 0.0
    one = predict(SMALL, **{**kwargs, "world_size": 1}, overlap_slowdown=2.0)
    assert one.slowed_ms == 0.0 and one.step_ms == 38.0
    with pytest.raises(ValueError, match="at least 1"):
        predict(SMALL, **kwargs, overlap_slowdown=0.9)


@pytest.mark.parametrize("compute, comm, extra", [
    (12.0, 6.0, 2.0),  # compute longer: comm * (1 - 1/s) = 6 / 3
    (5.0, 6.0, 1.0),  # in between: during the 6 ms the compute does 4 ms of its 5, then 1 ms more; max was 6
    (3.0, 6.0, 0.0),  # the slowed compute (4.5 ms) fits under the communication
    (5.0, 0.0, 0.0),  # nothing beside it
])
def test_slowed_stretch(compute: float, comm: float, extra: float) -> None:
    assert slowed_ms(compute, comm, 1.5) == pytest.approx(extra)
    assert slowed_ms(compute, comm, 1.0) == 0.0


def test_ddp_slowed_backward_is_the_stretch_beside_all_but_the_last_bucket() -> None:
    """1 GB/s on 2 ranks: an all-reduce of S bytes takes S / 1e6 ms. 16 MiB of fp32 gradients in 4 MiB buckets:
    16.8 ms in all, the last bucket 4.2 ms, so 12.6 ms beside a 10 ms backward at 1.5x: 10 - 12.6 / 1.5 = 1.6 ms."""
    big = Units(layers=1, block_params=4 * 2**20 - 100, root_params=100, block_flops_share=0.9, gather_bytes=2,
                grad_bytes=4)
    p = predict(big, 1.0, 10.0, 0.0, "ddp", 2, 1, _network(1.0), 1000, bucket_bytes=4 * 2**20, overlap_slowdown=1.5)
    total, last = 16 * 2**20 / 1e6, 4 * 2**20 / 1e6
    assert p.communication_ms == pytest.approx(total) and p.exposed_ms == pytest.approx(total - 10.0)
    assert p.slowed_ms == pytest.approx(10.0 - (total - last) / 1.5)


def test_estimate_refuses_a_slowdown_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    for text in ("0.8", "abc", "nan", "inf"):
        assert main(["estimate", "--config", str(ROOT / "configs" / "tiny.yaml"), "--overlap-slowdown", text]) == 2
        assert f"--overlap-slowdown: must be a finite number of at least 1 (1: compute not slowed), got {text}" in \
            capsys.readouterr().err


def test_fsdp_step_when_the_collectives_outlast_the_compute() -> None:
    p = predict(SMALL, forward_ms=1.0, backward_ms=2.0, optimizer_ms=0.0, strategy="fsdp", world_size=2, nodes=1,
                network=_network(1e-3), tokens_per_step=1000)
    # Forward blocks of 0.3 ms: 0.7 ms of each later gather shows. Backward blocks of 0.6 ms under 2, 3 and 1 ms.
    forward = 0.5 + 1.0 + 2 * 0.7
    backward = (2 - 0.6) + (3 - 0.6) + (1 - 0.6) + 2 + 1
    assert p.exposed_ms == pytest.approx(forward + backward)


def test_ddp_step_exposes_what_the_backward_does_not_hide() -> None:
    big = Units(layers=3, block_params=10_000_000, root_params=5_000_000, block_flops_share=0.3, gather_bytes=2,
                grad_bytes=4)
    p = predict(big, forward_ms=1.0, backward_ms=1.0, optimizer_ms=8.0, strategy="ddp", world_size=2, nodes=1,
                network=_network(100.0), tokens_per_step=1000)
    # 35M fp32 gradients, 140 MB: an all-reduce over 2 ranks at 100 GB/s takes 1.4 ms. lmtrain's DDP buckets are
    # 100 MiB (104,857,600 bytes): the last one takes 1.048576 ms, more than the 0.4 ms the backward leaves.
    assert p.communication_ms == pytest.approx(1.4)
    assert p.terms["all_reduce_last_bucket"] == pytest.approx(1.048576)
    assert p.exposed_ms == pytest.approx(1.048576)
    assert p.optimizer_ms == 8.0  # every rank updates every parameter
    # PyTorch's default bucket (Lightning's `auto` on several GPUs), 25 MiB: 0.262144 ms; the backward leaves 0.4 ms.
    torch_default = predict(big, 1.0, 1.0, 8.0, "ddp", 2, 1, _network(100.0), 1000, bucket_bytes=25 * 2**20)
    assert torch_default.exposed_ms == pytest.approx(0.4)
    slow = predict(big, 1.0, 10.0, 8.0, "ddp", 2, 1, _network(100.0), 1000, bucket_bytes=25 * 2**20)
    assert slow.exposed_ms == pytest.approx(0.262144)  # only the last bucket


def test_ddp_bucket_is_that_of_the_strategys_arguments() -> None:
    """lmtrain's ``strategy: ddp`` buckets 100 MiB (``DDP_DEFAULTS``); DDPStrategy without ``bucket_cap_mb`` gets
    DistributedDataParallel's 25 MiB."""
    assert ddp_bucket_bytes() == 100 * 2**20
    assert ddp_bucket_bytes({}) == ddp_bucket_bytes({"bucket_cap_mb": None}) == 25 * 2**20
    assert ddp_bucket_bytes({"bucket_cap_mb": 50}) == 50 * 2**20


def test_one_gpu_and_inter_node_cases() -> None:
    one = predict(SMALL, 10.0, 20.0, 8.0, "fsdp", world_size=1, nodes=1, network=_network(1e-3), tokens_per_step=100)
    assert one.step_ms == 38.0 and one.exposed_ms == 0.0
    # Two nodes: the inter-node ceiling (half the bandwidth here) doubles every collective.
    across = predict(SMALL, 10.0, 20.0, 8.0, "fsdp", 2, nodes=2, network=_network(1e-3, inter=0.5e-3),
                     tokens_per_step=1000)
    assert across.terms["all_gather_block"] == pytest.approx(2.0)


def test_units_are_the_models_own_blocks_and_root() -> None:
    """The units' sizes are those of the parameters of ``TransformerLM(cfg)``: one block, and the embedding, final
    norm and output head that the root unit shards."""
    cfg = ModelConfig.from_size("tiny", vocab_size=256)
    model = TransformerLM(cfg)
    u = units(cfg, 4, 64, "bf16-mixed")
    assert u.layers == len(model.blocks)
    assert u.block_params == sum(p.numel() for p in model.blocks[0].parameters())
    root = (model.embedding, model.final_norm, model.lm_head)
    assert u.root_params == sum(p.numel() for m in root for p in m.parameters())
    assert (u.gather_bytes, u.grad_bytes) == (2, 4)
    assert units(cfg, 4, 64, "32-true").gather_bytes == 4 and units(cfg, 4, 64, "bf16-true").grad_bytes == 2
    head = 6 * 4 * 64 * cfg.d_model * 256
    assert u.layers * u.block_flops_share == pytest.approx(1 - head / flops_per_step(cfg, 4, 64))


def test_collective_dtypes_are_those_the_code_builds() -> None:
    """FSDP2 gathers and reduce-scatters in its policy's dtypes (fp32 reduce-scatter under master weights too: the
    shards are the fp32 masters); DDP all-reduces each gradient in its parameter's dtype, and under master weights
    ``configure_model`` has made the linear weights bf16 before DDP wraps the model."""
    from lmtrain.distributed import mixed_precision_policy

    cfg = ModelConfig.from_size("tiny", vocab_size=256, master_weights=True)
    u = units(cfg, 4, 64, "bf16-mixed")
    policy = mixed_precision_policy("bf16-mixed")
    assert (u.gather_bytes, u.grad_bytes) == (policy.param_dtype.itemsize, policy.reduce_dtype.itemsize)
    model = TransformerLM(cfg)
    bf16_with_masters(linear_weights(model))  # what LMModule.configure_model does under DDP with master weights
    assert u.ddp_gradient_bytes() == sum(p.numel() * p.element_size() for p in model.parameters())
    assert u.ddp_bf16_grads == sum(p.numel() for p in model.parameters() if p.dtype == torch.bfloat16)
    plain = units(ModelConfig.from_size("tiny", vocab_size=256), 4, 64, "bf16-mixed")
    assert plain.ddp_bf16_grads == 0 and plain.ddp_gradient_bytes() == 4 * parameter_count(cfg)
    # The DDP prediction moves those bytes: 2 ranks at 1 GB/s, all-reduce factor 1.
    p = predict(u, 1.0, 1.0, 0.0, "ddp", 2, 1, _network(1.0), 100)
    assert p.terms["all_reduce"] == pytest.approx(u.ddp_gradient_bytes() / 1e9 * 1e3)


def test_one_gpu_step_from_flops() -> None:
    cfg = ModelConfig.from_size("tiny", vocab_size=256)
    one = one_gpu_from_flops(cfg, 4, 64, peak_flops=1e12, mfu=0.5, memory_gbps=100.0)
    compute = flops_per_step(cfg, 4, 64) / 0.5e12 * 1e3
    assert one.forward_ms == pytest.approx(compute / 3) and one.backward_ms == pytest.approx(2 * compute / 3)
    assert one.optimizer_ms == pytest.approx(28 * parameter_count(cfg) / 100e9 * 1e3)
    assert "MFU 0.5" in one.source


def _row(**kw: object) -> dict:
    return {"status": "ok", "mode": "train", "size": "tiny", "batch_size": 4, "context": 64, "precision": "bf16-mixed",
            "attention": "sdpa", "compile": "off", "forward_ms_mean": 1.0, "backward_ms_mean": 2.0,
            "optimizer_ms_mean": 3.0, "key": "k", **kw}


def test_one_gpu_step_from_a_bench_model_record() -> None:
    record = {"meta": {}, "rows": [_row(context=128, forward_ms_mean=9.0), _row(attention="naive", key="naive"),
                                   _row(forward_ms_mean=5.0, key="sdpa")]}
    one = one_gpu_from_record(record, "r.json", "tiny", 4, 64, "bf16-mixed", attention="sdpa", compile=False)
    assert (one.forward_ms, one.backward_ms, one.optimizer_ms) == (5.0, 2.0, 3.0) and "sdpa" in one.source
    with pytest.raises(LmtrainError, match="no timed training step of tiny at batch 8") as info:
        one_gpu_from_record(record, "r.json", "tiny", 8, 64, "bf16-mixed")
    assert "tiny batch 4 context 64 bf16-mixed" in str(info.value)
    given = one_gpu_from_record({"forward_ms": 1, "backward_ms": 2, "optimizer_ms": 0.5}, "c.json", "tiny", 4, 64,
                                "bf16-mixed")
    assert (given.forward_ms, given.backward_ms, given.optimizer_ms) == (1.0, 2.0, 0.5)


def test_network_from_a_bench_comm_record() -> None:
    rows = [{"op": "all_gather", "bytes": 1000, "busbw_gbps": 10.0}, {"op": "all_gather", "bytes": 100_000,
                                                                      "busbw_gbps": 30.0}]
    network = network_from_record({"meta": {"world_size": 2}, "rows": rows}, "c.json", 99.0, 7.0)
    assert network.all_gather.at(10_000) == pytest.approx(20.0)
    assert network.reduce_scatter.at(10_000) == 99.0  # not measured: the assumed value
    assert network.inter_node_gbps == 7.0


def test_estimate_prints_the_prediction_with_its_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    calibration = tmp_path / "one.json"
    calibration.write_text(json.dumps({"forward_ms": 10.0, "backward_ms": 20.0, "optimizer_ms": 8.0}))
    comm = tmp_path / "comm.json"
    comm.write_text(json.dumps({"meta": {"world_size": 2, "device": "X"}, "rows": [
        {"op": op, "bytes": 10**6, "busbw_gbps": 1.0} for op in ("all_gather", "reduce_scatter", "all_reduce")]}))
    args = ["estimate", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.devices", "4",
            "--trainer.strategy", "ddp", "--trainer.num_nodes", "2", "--calibrate", str(calibration), "--comm",
            str(comm), "--inter-node-gbps", "0.5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    cfg = ModelConfig.from_size("tiny", vocab_size=256, context_length=128)
    u = units(cfg, 16, 128, "32-true")
    flat = BusBandwidth.constant(1.0)
    expected = predict(u, 10.0, 20.0, 8.0, "ddp", 8, 2, Network(flat, flat, flat, 0.5), 16 * 128,
                       overlap_slowdown=OVERLAP_SLOWDOWN)
    assert f"= step {expected.step_ms:.2f} ms" in out
    assert f"compute beside hidden communication: {OVERLAP_SLOWDOWN:g}x as long as alone" in out
    assert f"from {calibration}" in out and f"{comm} (X, 2 ranks)" in out
    assert "between nodes: 0.5 GB/s per GPU (assumed)" in out
    assert "| fsdp " in out and "| ddp " in out and "on 8 GPUs" in out


def test_estimate_at_64_gpus_states_its_assumptions(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--config", str(ROOT / "configs" / "2.7B_bf16_fsdp.yaml"), "--trainer.devices", "8",
            "--trainer.num_nodes", "8", "--mfu", "0.5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "per GPU, fsdp over 64 GPUs" in out and "prediction: fsdp on 64 GPU(s) over 8 nodes" in out
    assert "from assumed: the step's FLOPs at MFU 0.5" in out
    assert "assumed 350 GB/s for every collective" in out and "45 GB/s per GPU (assumed)" in out


def test_fsdp_reshard_policy_changes_the_backward_gathers() -> None:
    """``none`` keeps every block gathered (no all-gather in the backward); ``all`` gathers the last block again too,
    before any backward compute can hide it."""
    kwargs = dict(forward_ms=1.0, backward_ms=2.0, optimizer_ms=0.0, strategy="fsdp", world_size=2, nodes=1,
                  network=_network(1e-3), tokens_per_step=1000)
    blocks = predict(SMALL, **kwargs)
    none = predict(SMALL, **kwargs, reshard="none")
    every = predict(SMALL, **kwargs, reshard="all")
    forward = 0.5 + 1.0 + 2 * 0.7
    # none: blocks 0 and 1 hide only a 2 ms reduce-scatter each, block 2 nothing; then 2 + 1 ms exposed.
    assert none.exposed_ms == pytest.approx(forward + 2 * (2 - 0.6) + 2 + 1)
    assert none.communication_ms == pytest.approx(0.5 + 3 + 0 + 6 + 1)
    assert every.exposed_ms == pytest.approx(blocks.exposed_ms + 1.0)
    assert every.communication_ms == pytest.approx(blocks.communication_ms + 1.0)
    with pytest.raises(ValueError, match="reshard"):
        predict(SMALL, **kwargs, reshard="sometimes")


def test_fsdp_memory_plan_of_master_weights_and_reshard_none() -> None:
    """Under FSDP2 the fp32 shards are the masters: the compact state halves the linear weights' moments; reshard
    ``none`` holds every block's gathered weights."""
    from lmtrain.memory_plan import estimate_memory, linear_parameter_count

    base = ModelConfig.from_size("tiny", vocab_size=512, context_length=64)
    plain = estimate_memory(base, 2, 64, "bf16-mixed", strategy="fsdp", world_size=2, device_type="cpu")
    fp32 = estimate_memory(ModelConfig.from_size("tiny", vocab_size=512, context_length=64, master_weights=True),
                           2, 64, "bf16-mixed", strategy="fsdp", world_size=2, device_type="cpu")
    compact = estimate_memory(ModelConfig.from_size("tiny", vocab_size=512, context_length=64, master_weights=True,
                                                    optimizer_state_dtype="bfloat16"),
                              2, 64, "bf16-mixed", strategy="fsdp", world_size=2, device_type="cpu")
    assert fp32.components["optimizer_states"] == plain.components["optimizer_states"]  # fp32 moments either way
    sharded = plain.details["sharded_numel"]
    linear = sharded * linear_parameter_count(base) // parameter_count(base)
    assert plain.components["optimizer_states"] - compact.components["optimizer_states"] == 2 * linear * 2
    held = estimate_memory(ModelConfig.from_size("tiny", vocab_size=512, context_length=64,
                                                 fsdp_reshard_after_forward="none"),
                           2, 64, "bf16-mixed", strategy="fsdp", world_size=2, device_type="cpu")
    block = plain.details["block_unsharded_numel"] * 2  # bf16 gathers
    assert held.details["blocks_held_bytes"] == (base.num_layers - 1) * block
    assert held.components["fsdp_buffers"] - plain.components["fsdp_buffers"] == (base.num_layers - 1) * block
    with pytest.raises(LmtrainError, match="bf16-mixed"):
        estimate_memory(ModelConfig.from_size("tiny", vocab_size=512, master_weights=True), 2, 64, "32-true",
                        strategy="fsdp", world_size=2, device_type="cpu")
