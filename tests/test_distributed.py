"""DDP and FSDP2 (ModelParallelStrategy) fits on CPU, 2 processes over gloo, against a 1-process run.

Each fit runs in its own Python process (this file is also the script: ``python tests/test_distributed.py
STRATEGY OUT.json``), so that Lightning's launcher starts rank 1 from a script and pytest is never forked.
The data is this file's own, not ``LMDataModule``'s: one fixed global order of windows, and at step i rank r
of W reads windows [i*G + r*G/W, i*G + (r+1)*G/W) of it (G the global batch), so every run, whatever its
world size, trains on the same global batches.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from subprocs import own_job_env

STEPS = 5
GLOBAL_BATCH = 8
CONTEXT = 32
VOCAB = 256
TOLERANCE = 1e-5


# -- the script ---------------------------------------------------------------------------------------------


def _windows() -> torch.Tensor:
    """The fixed global order of training windows: (STEPS * GLOBAL_BATCH, CONTEXT + 1) token ids.

    Counting sequences from random starts (each id is the previous one plus 1): learnable in a few steps,
    so the losses of the runs fall and a run that did not update its weights shows.
    """
    g = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, VOCAB, (STEPS * GLOBAL_BATCH, 1), generator=g)
    return (starts + torch.arange(CONTEXT + 1)) % VOCAB


def _rank_indices(rank: int, world: int) -> list[int]:
    """The windows rank ``rank`` of ``world`` reads, in order: its slice of every global batch."""
    per_rank = GLOBAL_BATCH // world
    return [i * GLOBAL_BATCH + rank * per_rank + j for i in range(STEPS) for j in range(per_rank)]


def run_fit(strategy: str, out: Path) -> None:
    """Fit the tiny model for STEPS steps under ``strategy`` (``single``, ``ddp``, ``fsdp`` or ``fsdp_ac``, FSDP2
    with activation checkpointing); rank 0 writes the rank-averaged loss of every step (and, under FSDP2, what
    the sharding did) to ``out``."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lmtrain.distributed import fsdp_modules
    from lmtrain.module import LMModule

    class SeededLM(LMModule):
        def configure_model(self) -> None:
            # Same initial weights in every process and every run, whatever consumed random numbers before.
            torch.manual_seed(0)
            super().configure_model()

    class Windows(pl.LightningDataModule):
        def train_dataloader(self) -> torch.utils.data.DataLoader:
            rank, world = self.trainer.global_rank, self.trainer.world_size
            subset = torch.utils.data.Subset(_windows(), _rank_indices(rank, world))
            return torch.utils.data.DataLoader(subset, batch_size=GLOBAL_BATCH // world, shuffle=False)

    class RecordLoss(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs, batch, idx) -> None:
            # Each rank's loss is the mean over its windows; equal shares make their mean the global batch's.
            loss = trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")
            self.losses.append(float(loss))

    devices = 1 if strategy == "single" else 2
    strategies = {
        "single": "auto",
        "ddp": "ddp",
        "fsdp": ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        "fsdp_ac": ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        "fsdp_in_backward": ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    }
    module = SeededLM(size="tiny", vocab_size=VOCAB, context_length=CONTEXT, lr=1e-2, warmup_steps=0,
                      fused_adamw=False, activation_checkpointing=strategy == "fsdp_ac",
                      optimizer_in_backward=strategy == "fsdp_in_backward")
    record = RecordLoss()
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategies[strategy], precision="32-true",
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, use_distributed_sampler=False, callbacks=[record],
    )
    trainer.fit(module, datamodule=Windows())
    result: dict = {"strategy": strategy, "world_size": trainer.world_size, "losses": record.losses}
    if strategy.startswith("fsdp"):
        from torch.distributed.tensor import DTensor

        model = module.model
        qkv = model.blocks[0].attn.qkv.weight
        result.update(
            fsdp_units=fsdp_modules(model),
            block_types=[type(b).__name__ for b in model.blocks],
            qkv_is_dtensor=isinstance(qkv, DTensor),
            qkv_local_shape=list(qkv.to_local().shape) if isinstance(qkv, DTensor) else list(qkv.shape),
            qkv_global_shape=list(qkv.shape),
        )
    if trainer.global_rank == 0:
        out.write_text(json.dumps(result))


# -- the tests ----------------------------------------------------------------------------------------------


def _fit(strategy: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{strategy}.json"
    env = own_job_env()
    proc = subprocess.run([sys.executable, __file__, strategy, str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    print(f"{strategy}: {result['losses']}")  # per-step losses, for the record (pytest -s)
    return result


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _fit("single", tmp_path_factory.mktemp("single"))


def test_rank_slices_cover_each_global_batch_once() -> None:
    for world in (1, 2, 4):
        seen = sorted(i for r in range(world) for i in _rank_indices(r, world))
        assert seen == list(range(STEPS * GLOBAL_BATCH))
        # Step i of every rank lies inside global batch i.
        per_rank = GLOBAL_BATCH // world
        for r in range(world):
            steps = [i // GLOBAL_BATCH for i in _rank_indices(r, world)]
            assert steps == [s for s in range(STEPS) for _ in range(per_rank)]


@pytest.mark.slow
def test_ddp_two_processes_match_one(single_run: dict, tmp_path: Path) -> None:
    ddp = _fit("ddp", tmp_path)
    assert ddp["world_size"] == 2 and single_run["world_size"] == 1
    assert len(ddp["losses"]) == len(single_run["losses"]) == STEPS
    assert ddp["losses"] == pytest.approx(single_run["losses"], abs=TOLERANCE, rel=0)
    assert ddp["losses"][-1] < ddp["losses"][0]  # the steps did train


@pytest.mark.slow
def test_fsdp2_two_processes_match_one(single_run: dict, tmp_path: Path) -> None:
    fsdp = _fit("fsdp", tmp_path)
    assert fsdp["world_size"] == 2
    assert fsdp["losses"] == pytest.approx(single_run["losses"], abs=TOLERANCE, rel=0)
    # One FSDP unit per block and one for the root, nothing else.
    assert fsdp["fsdp_units"] == ["", *(f"blocks.{i}" for i in range(4))]
    assert all(name.startswith("FSDP") for name in fsdp["block_types"])
    # Parameters are sharded along dim 0 over the 2 ranks: qkv is (3 * 128, 128) globally.
    assert fsdp["qkv_is_dtensor"]
    assert fsdp["qkv_global_shape"] == [384, 128] and fsdp["qkv_local_shape"] == [192, 128]


@pytest.mark.slow
def test_fsdp2_with_activation_checkpointing_matches_one(single_run: dict, tmp_path: Path) -> None:
    fsdp = _fit("fsdp_ac", tmp_path)
    assert fsdp["losses"] == pytest.approx(single_run["losses"], abs=TOLERANCE, rel=0)
    # Each block is checkpoint-wrapped, then sharded: the FSDP unit is the wrapper.
    assert fsdp["fsdp_units"] == ["", *(f"blocks.{i}" for i in range(4))]
    assert fsdp["block_types"] == ["FSDPCheckpointWrapper"] * 4
    assert fsdp["qkv_local_shape"] == [192, 128]


def _trainer_like(strategy: object, world_size: int) -> SimpleNamespace:
    """What ``LMModule.check_trainer`` reads of a trainer, for a bf16-mixed fit without accumulation or clipping
    (the strategy's devices set, as the trainer sets them, for its root device)."""
    strategy.parallel_devices = [torch.device("cpu")] * world_size
    return SimpleNamespace(strategy=strategy, world_size=world_size, accumulate_grad_batches=1,
                           gradient_clip_val=None, precision="bf16-mixed")


@pytest.mark.slow
def test_fsdp2_with_the_optimizer_in_backward_matches_one(single_run: dict, tmp_path: Path) -> None:
    """FSDP2 runs each sharded parameter's post-accumulate-grad hook after its reduce-scatter, so the update
    inside the backward pass reads the averaged gradient: the losses are the one-process run's."""
    fsdp = _fit("fsdp_in_backward", tmp_path)
    assert fsdp["losses"] == pytest.approx(single_run["losses"], abs=TOLERANCE, rel=0)
    assert fsdp["losses"][-1] < fsdp["losses"][0]


def test_optimizer_in_backward_is_refused_under_ddp() -> None:
    """Under DDP the hook fires on the rank's own gradient, before the all-reduce (two gloo processes drifted
    apart that way): refused, with FSDP2 named as the way to have it on several ranks."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lmtrain.errors import LmtrainError
    from lmtrain.module import LMModule

    module = LMModule(size="tiny", vocab_size=VOCAB, context_length=CONTEXT, optimizer_in_backward=True)

    with pytest.raises(LmtrainError, match="all-reduce") as info:
        module.check_trainer(_trainer_like(DDPStrategy(), 2))
    assert "model.optimizer_in_backward" in str(info.value) and "ModelParallelStrategy" in str(info.value)
    module.check_trainer(_trainer_like(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), 2))
    module.check_trainer(_trainer_like(DDPStrategy(), 1))  # one process: nothing to average


def test_master_weights_pass_the_trainer_checks_under_fsdp2_and_ddp() -> None:
    """Checked from the strategy, before it has set up (FSDP2's device mesh does not exist yet when a fit starts).
    Under FSDP2 the fp32 shards are the masters; under DDP the linear weights turn bf16 before DDP wraps the model
    (tests/test_distributed_matrix.py trains both)."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lmtrain.module import LMModule

    module = LMModule(size="tiny", vocab_size=VOCAB, context_length=CONTEXT, master_weights=True)

    assert module.device_mesh is None
    module.check_trainer(_trainer_like(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), 2))
    module.check_trainer(_trainer_like(DDPStrategy(), 2))
    module.check_trainer(_trainer_like(DDPStrategy(), 1))


def test_fsdp_rejects_fp16() -> None:
    from lmtrain.distributed import check_fsdp_precision, mixed_precision_policy
    from lmtrain.errors import LmtrainError

    with pytest.raises(LmtrainError, match="trainer.precision"):
        check_fsdp_precision("16-mixed")
    policy = mixed_precision_policy("bf16-mixed")
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert mixed_precision_policy("32-true").param_dtype is None


# -- the device mesh of ModelParallelStrategy, checked before any process starts -----------------------------


def _mesh_refusal(*sizes: object) -> tuple[str, str, str]:
    from lmtrain.distributed import check_mesh_sizes
    from lmtrain.errors import LmtrainError

    with pytest.raises(LmtrainError) as info:
        check_mesh_sizes(*sizes)
    return info.value.field, info.value.problem, info.value.fix


def test_mesh_sizes_resolve_auto_as_lightning_does() -> None:
    """``auto`` data-parallel is the number of nodes, ``auto`` tensor-parallel the processes of a node (Lightning's
    ModelParallelStrategy.setup_environment)."""
    from lmtrain.distributed import mesh_sizes

    assert mesh_sizes("auto", "auto", 2, 8) == (2, 8)
    assert mesh_sizes(16, "auto", 2, 8) == (16, 8)
    assert mesh_sizes("auto", 1, 2, 8) == (2, 1)
    assert mesh_sizes(4, 2, 1, 8) == (4, 2)


def test_mesh_of_every_process_passes() -> None:
    from lmtrain.distributed import check_mesh_sizes

    check_mesh_sizes(16, 1, 2, 8)
    check_mesh_sizes("auto", "auto", 4, 1)  # one process a node: the data-parallel size is the nodes
    check_mesh_sizes(1, "auto", 1, 1)


def test_mesh_smaller_than_the_processes_is_refused() -> None:
    field, problem, fix = _mesh_refusal(1, 1, 1, 2)
    assert field == "trainer.strategy.init_args.data_parallel_size"
    assert problem == ("data_parallel_size 1 x tensor_parallel_size 1 makes a device mesh of size 1, but the run's "
                       "process count is 2 (nodes x devices: 1 x 2).")
    assert fix == "set trainer.strategy.init_args.data_parallel_size: 2 (nodes x devices) and tensor_parallel_size: 1."


def test_mesh_larger_than_the_processes_is_refused() -> None:
    field, problem, fix = _mesh_refusal(16, 1, 1, 8)
    assert field == "trainer.strategy.init_args.data_parallel_size"
    assert problem == ("data_parallel_size 16 x tensor_parallel_size 1 makes a device mesh of size 16, but the run's "
                       "process count is 8 (nodes x devices: 1 x 8).")
    assert fix == ("set trainer.strategy.init_args.data_parallel_size: 8 (nodes x devices) and tensor_parallel_size: "
                   "1, or give the run 16 processes (trainer.num_nodes x trainer.devices).")


def test_mesh_refusal_names_the_resolved_auto_sizes() -> None:
    field, problem, fix = _mesh_refusal("auto", 1, 2, 8)
    assert field == "trainer.strategy.init_args.data_parallel_size"
    assert problem == ("data_parallel_size auto (2: the nodes) x tensor_parallel_size 1 makes a device mesh of size "
                       "2, but the run's process count is 16 (nodes x devices: 2 x 8).")
    assert fix == ("set trainer.strategy.init_args.data_parallel_size: 16 (nodes x devices) and "
                   "tensor_parallel_size: 1.")
    field, problem, fix = _mesh_refusal(2, "auto", 1, 2)
    assert field == "trainer.strategy.init_args.tensor_parallel_size"
    assert problem == ("data_parallel_size 2 x tensor_parallel_size auto (2: the devices of a node) makes a device "
                       "mesh of size 4, but the run's process count is 2 (nodes x devices: 1 x 2).")
    assert fix == "set trainer.strategy.init_args.data_parallel_size: 2 (nodes x devices) and tensor_parallel_size: 1."


def test_mesh_of_every_process_with_tensor_parallelism_is_refused() -> None:
    """Lightning's defaults on one node of 2: a mesh of the right size, tensor-parallel (lmtrain shards data-parallel
    only)."""
    field, problem, fix = _mesh_refusal("auto", "auto", 1, 2)
    assert field == "trainer.strategy.init_args.tensor_parallel_size"
    assert problem == "the device mesh has tensor_parallel size 2; lmtrain shards data-parallel only (FSDP2)."
    assert fix == "set trainer.strategy.init_args.data_parallel_size: 2 (nodes x devices) and tensor_parallel_size: 1."


@pytest.mark.parametrize(("trainer", "processes"), [
    ({"accelerator": "gpu", "num_nodes": 2, "devices": 1}, 2),
    ({"accelerator": "gpu", "devices": [0, 1, 2]}, 3),
    ({"accelerator": "gpu", "devices": "0,1"}, 2),
    ({"accelerator": "cpu", "devices": "auto"}, 1),  # one process on the CPU
], ids=["nodes", "device-list", "device-string", "auto-on-cpu"])
def test_parsed_mesh_counts_the_processes_as_lightning_does(trainer: dict, processes: int) -> None:
    from lmtrain.cli_config import check_parsed_mesh, parsed_trainer_settings
    from lmtrain.errors import LmtrainError

    def section(data_parallel_size: int) -> dict:
        strategy = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                    "init_args": {"data_parallel_size": data_parallel_size, "tensor_parallel_size": 1}}
        return {"num_nodes": 1, **trainer, "strategy": strategy}

    def check(parsed: dict) -> None:
        check_parsed_mesh(parsed, parsed_trainer_settings(parsed))

    check(section(processes))
    with pytest.raises(LmtrainError) as info:
        check(section(processes + 1))
    assert info.value.field == "trainer.strategy.init_args.data_parallel_size"
    assert f"the run's process count is {processes} (nodes x devices: " in info.value.problem


def test_strategy_class_named_alone_is_its_class_path() -> None:
    """A Strategy class given as a string, by import path or by its name in lightning.pytorch.strategies, is built
    as its class_path entry; Lightning's names stay names; anything else is refused."""
    from lmtrain.cli_config import strategy_class_path
    from lmtrain.errors import LmtrainError

    path = "lightning.pytorch.strategies.ModelParallelStrategy"
    assert strategy_class_path(path) == path
    assert strategy_class_path("ModelParallelStrategy") == path
    assert strategy_class_path("lightning.pytorch.strategies.DDPStrategy") == "lightning.pytorch.strategies.DDPStrategy"
    for name in ("auto", "ddp", "DDP", "fsdp", "ddp_spawn"):
        assert strategy_class_path(name) is None
    assert strategy_class_path({"class_path": path}) is None
    for bogus in ("bogus", "lightning.pytorch.strategies.NoSuch", "torch.nn.Linear", "no_such_module.Strategy"):
        with pytest.raises(LmtrainError) as info:
            strategy_class_path(bogus)
        assert info.value.field == "trainer.strategy"
        assert info.value.problem == (f"{bogus!r} is neither a strategy name of Lightning's nor the import path of a "
                                      "Strategy class.")


# -- the planner ---------------------------------------------------------------------------------------------


def _tiny(**overrides: object):
    from lmtrain.config import ModelConfig

    return ModelConfig.from_size("tiny", vocab_size=VOCAB, context_length=128, **overrides)


def test_parameter_shapes_add_up_to_the_parameter_count() -> None:
    from lmtrain.flops import parameter_count
    from lmtrain.memory_plan import parameter_shapes, parameter_tensor_count

    for size in ("tiny", "small", "2.7B"):
        from lmtrain.config import ModelConfig

        cfg = ModelConfig.from_size(size)
        shapes = parameter_shapes(cfg)
        assert len(shapes) == parameter_tensor_count(cfg)
        assert sum(torch.Size(s).numel() for s in shapes) == parameter_count(cfg)


def test_parameter_shapes_are_the_models_own_in_registration_order() -> None:
    from lmtrain.config import ModelConfig
    from lmtrain.memory_plan import parameter_shapes
    from lmtrain.model import TransformerLM

    # d_ff unlike 3 d_model and unlike d_model, so a swapped or transposed width shows
    cfg = ModelConfig(vocab_size=97, context_length=16, d_model=48, num_layers=2, num_heads=4, d_ff=136)
    assert parameter_shapes(cfg) == [tuple(p.shape) for p in TransformerLM(cfg).parameters()]


def test_fsdp_plan_shards_parameters_gradients_and_optimizer_exactly() -> None:
    from lmtrain.memory_plan import estimate_memory

    cfg = _tiny()  # 1,115,264 parameters, 31 tensors; every dim 0 even
    two = estimate_memory(cfg, 2, 128, "32-true", strategy="fsdp", world_size=2, device_type="cpu")
    rope = 128 * 32 * 4
    assert two.components["parameters"] == 1_115_264 // 2 * 4 + rope
    assert two.components["optimizer_states"] == 2 * 1_115_264 // 2 * 4 + 31 * 4
    # Three GPUs: each dim 0 padded to a multiple of 3. Per rank: embedding and head 86 * 128 rows each,
    # per layer 43 + 128*128 + 43*128 + 43 + 171*128 + 43*512 + 171*128 = 87,766, final norm 43.
    sharded = 2 * 86 * 128 + 4 * 87_766 + 43
    assert sharded == 373_123
    three = estimate_memory(cfg, 2, 128, "32-true", strategy="fsdp", world_size=3, device_type="cpu")
    assert three.details["sharded_numel"] == sharded
    assert three.components["parameters"] == sharded * 4 + rope
    assert three.components["optimizer_states"] == 2 * sharded * 4 + 31 * 4
    # Short sequences: the sharded gradients set the peak, by the first block's backward (every other block's, with
    # two blocks gathered) or at the end of the backward pass (all of them, with the root's buffers).
    from lmtrain.config import ModelConfig

    big = ModelConfig.from_size("2.7B")
    short = estimate_memory(big, 1, 16, "32-true", strategy="fsdp", world_size=3, device_type="cpu")
    block_shard = short.details["block_unsharded_numel"] // 3
    assert short.moment == "first layer backward"
    assert short.components["gradients"] == (big.num_layers - 1) * block_shard * 4
    # with the optimizer in the backward pass two parameters' shards at most: the gradients no longer set it
    oib = estimate_memory(replace(big, optimizer_in_backward=True), 1, 16, "32-true", strategy="fsdp",
                          world_size=3, device_type="cpu")
    from lmtrain.memory_plan import parameter_shapes, shard_numel

    largest = max(shard_numel(shape, 3) for shape in parameter_shapes(big))
    assert largest == 854 * 10240  # w2, (2560, 10240): 2560 rows padded to 3 x 854
    assert oib.peak < short.peak and oib.components["gradients"] in (0, 2 * largest * 4)


def test_fsdp_plan_gathers_bf16_blocks_and_reduces_in_fp32() -> None:
    from lmtrain.memory_plan import estimate_memory

    plan = estimate_memory(_tiny(), 2, 128, "bf16-mixed", strategy="fsdp", world_size=2, device_type="cpu")
    # Root (embedding, final norm, head) and two blocks unsharded in bf16; a block is 4 D^2 + 3 D F + 2 D.
    block = 4 * 128**2 + 3 * 128 * 512 + 2 * 128
    assert block == 262_400
    assert plan.components["root_unsharded"] == (2 * 256 * 128 + 128) * 2
    assert plan.details["block_unsharded_numel"] == block
    assert plan.moment == "last layer backward"
    # Two blocks in flight plus one block's bf16 gradients and its fp32 reduce-scatter input.
    assert plan.components["fsdp_buffers"] == 2 * block * 2 + block * (2 + 4)
    # fp32 master weights: the shards stay 4 bytes per parameter.
    assert plan.components["parameters"] == 1_115_264 // 2 * 4 + 128 * 32 * 4


def test_ddp_plan_is_the_single_gpu_plan_plus_the_buckets() -> None:
    from lmtrain.memory_plan import _train_moments, estimate_memory

    for precision in ("32-true", "bf16-mixed"):
        for cfg, batch in ((_tiny(), 2), (_tiny(), 64), (_tiny(attention="naive"), 8),
                           (_tiny(activation_checkpointing=True), 16)):
            single = estimate_memory(cfg, batch, 128, precision, device_type="cpu")
            ddp = estimate_memory(cfg, batch, 128, precision, strategy="ddp", world_size=4, device_type="cpu")
            # Buckets cover every parameter in its own dtype (fp32 under both precisions here).
            assert ddp.components["ddp_buckets"] == 1_115_264 * 4
            assert ddp.peak == single.peak + 1_115_264 * 4
            assert ddp.moment == single.moment
            view = estimate_memory(cfg, batch, 128, precision, strategy="ddp", world_size=4, device_type="cpu",
                                   gradient_as_bucket_view=True)
            # gradient_as_bucket_view: the gradients are the buckets, so the peak is the largest moment without
            # them (at small batches the end of the backward pass is not it any more)
            moments, _ = _train_moments(cfg, batch, 128, precision, "train", "cpu")
            peak_moment = max(moments, key=lambda k: moments[k][1] + moments[k][2])
            static = sum(single.components[k] for k in ("parameters", "optimizer_states", "workspace"))
            assert view.components["gradients"] == 0 and view.moment == peak_moment
            assert view.peak == static + 1_115_264 * 4 + sum(moments[peak_moment][1:])


def test_fsdp_fits_longer_contexts_than_one_gpu() -> None:
    from lmtrain.config import ModelConfig
    from lmtrain.memory_plan import GIB, estimate_memory, max_fitting

    cfg = ModelConfig.from_size("2.7B", context_length=1 << 17, activation_checkpointing=True)
    budget = 80 * GIB
    one = max_fitting(cfg, budget, batch_size=1, precision="bf16-mixed")
    two = max_fitting(cfg, budget, batch_size=1, precision="bf16-mixed", strategy="fsdp", world_size=2)
    assert two > one > 0
    assert estimate_memory(cfg, 1, two, "bf16-mixed", strategy="fsdp", world_size=2).needed <= budget
    assert estimate_memory(cfg, 1, two + 1, "bf16-mixed", strategy="fsdp", world_size=2).needed > budget


def test_strategy_kind_maps_lightning_names() -> None:
    from lmtrain.memory_plan import strategy_kind

    assert strategy_kind("ddp") == strategy_kind("ddp_spawn") == strategy_kind("DDPStrategy") == "ddp"
    assert strategy_kind("lightning.pytorch.strategies.ModelParallelStrategy") == "fsdp"
    assert strategy_kind("auto") == "single"
    with pytest.raises(ValueError):
        strategy_kind("deepspeed")


def test_strategy_kind_follows_an_importable_class_path_to_its_base() -> None:
    """A class path is known by its class's bases: lmtrain's own DDP strategy (a DDPStrategy subclass whose name
    does not start with ddp) is DDP, so master weights pass under it; a path that does not import is unknown."""
    from lmtrain.cli_config import strategy_of
    from lmtrain.memory_plan import strategy_kind

    assert strategy_kind("lmtrain.distributed.SameStreamDDPStrategy") == "ddp"
    assert strategy_kind("lightning.pytorch.strategies.DDPStrategy") == "ddp"
    with pytest.raises(ValueError):
        strategy_kind("lightning.pytorch.strategies.NoSuchStrategy")
    with pytest.raises(ValueError):
        strategy_kind("no_such_package.SameStreamStrategy")
    # a name that says its kind is taken without importing it
    assert strategy_kind("no_such_package.ModelParallelStrategy") == "fsdp"
    # Lightning's DeepSpeed and XLA strategies derive from DDPStrategy but are not DDP: not planned, as path or object
    for path in ("lightning.pytorch.strategies.DeepSpeedStrategy", "lightning.pytorch.strategies.XLAStrategy"):
        with pytest.raises(ValueError):
            strategy_kind(path)
    from lightning.pytorch.strategies import DeepSpeedStrategy

    class Stub(DeepSpeedStrategy):
        def __init__(self) -> None:  # no DeepSpeed needed to ask for the kind
            pass

    with pytest.raises(ValueError):
        strategy_kind(Stub())
    trainer = {"strategy": {"class_path": "lmtrain.distributed.SameStreamDDPStrategy",
                            "init_args": {"bucket_cap_mb": 400}}, "devices": 4}
    assert strategy_of(trainer) == ("ddp", 4)
    # single_device runs one process whatever devices says (master weights are not refused as "2 ranks")
    assert strategy_of({"strategy": "single_device", "devices": 2}) == ("single", 1)
    assert strategy_of({"strategy": "auto", "devices": 2}) == ("ddp", 2)


if __name__ == "__main__":
    from lmtrain.distributed import end_process_group

    run_fit(sys.argv[1], Path(sys.argv[2]))
    end_process_group()


def test_the_name_ddp_in_any_case_gets_lmtrains_ddp_arguments() -> None:
    """Lightning reads strategy names in lower case, so DDP and Ddp are DDP too and get lmtrain's DDP arguments
    (they got Lightning's defaults); ddp_spawn, class paths and objects are taken as written."""
    from lmtrain.distributed import builds_lmtrain_ddp

    assert all(builds_lmtrain_ddp(name) for name in ("ddp", "DDP", "Ddp"))
    assert not any(builds_lmtrain_ddp(s) for s in ("ddp_spawn", "auto", None, {"class_path": "x.DDPStrategy"},
                                                   "lightning.pytorch.strategies.DDPStrategy"))


def test_ddp_plan_with_bucket_views_grows_with_the_batch() -> None:
    """With the gradients in the buckets the plan grows with the batch (it jumped by 6.5 GiB between batches 4 and
    5 at 2.7B when the one-GPU peak moment was kept with its gradients taken off)."""
    from lmtrain.config import ModelConfig
    from lmtrain.memory_plan import estimate_memory

    cfg = ModelConfig.from_size("2.7B", context_length=256, master_weights=True)
    peaks = [estimate_memory(cfg, b, 256, "bf16-mixed", strategy="ddp", world_size=2,
                             gradient_as_bucket_view=True).peak for b in range(1, 7)]
    steps = [b - a for a, b in zip(peaks, peaks[1:], strict=False)]
    assert all(d > 0 for d in steps) and max(steps) - min(steps) < 0.01 * peaks[0], steps
