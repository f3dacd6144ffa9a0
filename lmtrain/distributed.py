"""FSDP2 sharding of ``TransformerLM`` for Lightning's ``ModelParallelStrategy``, and its precision policy.

``LMModule.configure_model`` calls :func:`shard_model` when the strategy hands it a device mesh
(``ModelParallelStrategy`` does; ``ddp`` and single-device runs do not). The order of the steps is
torchtitan's: per transformer block, activation checkpointing first (the checkpointed region sits inside
the FSDP unit, so the recomputation in the backward pass finds the block's parameters already
all-gathered), then ``torch.compile`` (so FSDP's all-gather and reduce-scatter hooks stay outside the
compiled graph), then ``fully_shard`` with the block's ``reshard_after_forward`` (``model.fsdp_reshard_after_forward``);
the root module last, which shards what is left (embedding, final norm, output head) and stays gathered from
forward to backward. Then each unit is told which unit to prefetch (``model.fsdp_prefetch``, :func:`set_prefetch`).

:func:`check_strategy_options` refuses the options a strategy cannot work with and :func:`check_fsdp_precision` the
precisions FSDP2 cannot train in (``LMModule.check_settings`` calls both: the command line when it parses, a fit when
it starts); :func:`ddp_strategy` is what ``trainer.strategy: ddp`` builds.

Precision. Under ``ModelParallelStrategy`` Lightning 2.6 accepts ``32-true``, ``bf16-mixed``,
``bf16-true`` and ``16-true`` (it refuses ``16-mixed`` when the trainer is built). For ``bf16-mixed`` it
installs its usual autocast plugin and nothing else: the sharded parameters stay fp32, so FSDP would
all-gather fp32 weights (twice the traffic and the unsharded memory) and autocast would cast each of them
to bf16 again at every use. lmtrain makes ``bf16-mixed`` mean FSDP2's mixed precision instead
(:func:`mixed_precision_policy`): fp32 sharded master weights, gradients and AdamW state; parameters
all-gathered in bf16 and every block computed in bf16; gradients reduce-scattered in fp32. Lightning's
autocast context stays around the step, where it changes nothing but the ops autocast always runs in
fp32 (the loss already is). The residual stream is then bf16 (the embedding's output is), as under
``bf16-true``, and the memory planner plans the activations that way.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmtrain.config import RESHARD_POLICIES, compile_kwargs
from lmtrain.errors import LmtrainError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

#: Precisions FSDP2 runs in lmtrain. ``16-true`` is left out on purpose: fp16 gradients reduced without
#: loss scaling underflow; ``16-mixed`` needs a gradient scaler that sharded parameters do not get.
FSDP_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")

#: Name of the data-parallel dimension of the mesh that ``ModelParallelStrategy`` builds.
DATA_PARALLEL_DIM = "data_parallel"
TENSOR_PARALLEL_DIM = "tensor_parallel"


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's ``MixedPrecisionPolicy`` for a Lightning precision string.

    Args:
        precision: ``32-true`` (fp32 everywhere), ``bf16-mixed`` (bf16 all-gather and compute, fp32 master
            weights and fp32 gradient reduce-scatter) or ``bf16-true`` (bf16 everywhere: the parameters
            already are bf16, Lightning converts the module).

    Raises:
        LmtrainError: for a precision FSDP2 does not run here (``16-mixed``, ``16-true``, ``64-true``, ...).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    check_fsdp_precision(precision)
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # 32-true and bf16-true: all-gather, compute and reduce in the parameters' own dtype.
    return MixedPrecisionPolicy()


def check_fsdp_precision(precision: str) -> None:
    """Stop with one clear message when FSDP2 cannot train in ``precision``.

    The command line calls it (``LMModule.check_settings``) before it builds the trainer, so that ``16-mixed``
    (which Lightning itself rejects under ``ModelParallelStrategy`` with a message about Fabric) gets lmtrain's
    message.

    Raises:
        LmtrainError: ``precision`` is not one of :data:`FSDP_PRECISIONS`.
    """
    if str(precision) not in FSDP_PRECISIONS:
        raise LmtrainError(
            "trainer.precision",
            f"{precision!r} is not supported with FSDP2 (ModelParallelStrategy): fp16 gradients are reduced "
            "without loss scaling.",
            f"use one of {', '.join(FSDP_PRECISIONS)} (bf16-mixed: bf16 compute, fp32 weights and reductions), "
            "or trainer.strategy ddp for 16-mixed.",
        )


#: ``DDPStrategy`` arguments of ``trainer.strategy: ddp`` on lmtrain's command line (:func:`ddp_strategy`):
#: gradients as views into the buckets (one copy of the gradients less), larger buckets (fewer all-reduces), and a
#: static graph (LMModule's step uses every parameter in the same order every step). Measured together: 2.4% over
#: Lightning's defaults for 2.7B on 2 H200 (docs/distributed.md).
DDP_DEFAULTS: dict[str, Any] = {"gradient_as_bucket_view": True, "bucket_cap_mb": 100, "static_graph": True}


def ddp_arguments(accumulate_grad_batches: int = 1, **overrides: Any) -> dict[str, Any]:
    """``DDPStrategy`` arguments: :data:`DDP_DEFAULTS`, without ``static_graph`` under gradient accumulation, then
    ``overrides``.

    Lightning accumulates under DDP's ``no_sync``, and a static graph with ``no_sync`` fails its first backward pass
    or stops all-reducing after the first step in the PyTorch versions lmtrain runs on (pytorch/pytorch#187732).
    """
    static = {} if accumulate_grad_batches <= 1 else {"static_graph": False}
    return {**DDP_DEFAULTS, **static, **overrides}


def builds_lmtrain_ddp(strategy: Any) -> bool:
    """Whether a parsed ``trainer.strategy`` is the name ``ddp``, in any case (Lightning reads names in lower case),
    which lmtrain's command line builds with :func:`ddp_strategy` (``ddp_spawn``, a class path or an object are
    taken as written)."""
    return isinstance(strategy, str) and strategy.lower() == "ddp"


def ddp_strategy(accumulate_grad_batches: int = 1, **overrides: Any) -> Any:
    """A Lightning ``DDPStrategy`` with :func:`ddp_arguments` that wraps the model on the stream the training steps
    run on (:func:`same_stream_ddp_class`; what ``trainer.strategy: ddp`` builds on lmtrain's command line; a
    ``class_path`` strategy is taken as written)."""
    return same_stream_ddp_class()(**ddp_arguments(accumulate_grad_batches, **overrides))


@functools.cache
def same_stream_ddp_class() -> type:
    """``DDPStrategy`` whose ``DistributedDataParallel`` is built on the current CUDA stream.

    Lightning 2.6 builds it inside ``torch.cuda.stream(torch.cuda.Stream())``, a side stream that only a whole step
    captured as one CUDA graph needs (lmtrain refuses ``cuda_graphs`` under DDP). DDP keeps a reference to each
    parameter's gradient accumulator, made on that side stream, while every backward pass runs on the default
    stream; PyTorch then warns at the first backward pass ("The AccumulateGrad node's stream does not match ...")
    that this may add synchronisation, and asks for DDP to be built on the stream of the forward passes, as
    Lightning's own fix (Lightning-AI/pytorch-lightning#21746) does.
    """
    from lightning.pytorch.strategies import DDPStrategy

    class SameStreamDDPStrategy(DDPStrategy):
        def _setup_model(self, model: nn.Module) -> nn.Module:
            return torch.nn.parallel.DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(),
                                                             **self._ddp_kwargs)

    SameStreamDDPStrategy.__qualname__ = SameStreamDDPStrategy.__name__
    SameStreamDDPStrategy.__module__ = __name__  # found by name (pickling) through this module's __getattr__
    return SameStreamDDPStrategy


def __getattr__(name: str) -> Any:
    """``lmtrain.distributed.SameStreamDDPStrategy``, made on first use (this module does not import Lightning)."""
    if name == "SameStreamDDPStrategy":
        return same_stream_ddp_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_strategy_options(config: Any, strategy: str, world_size: int | None, training: bool = True) -> None:
    """Refuse model options that cannot work under the trainer's strategy, with one line naming both.

    The command line calls this right after parsing (before anything is built or written); ``LMModule`` again
    when a fit starts. Options that work under every strategy are not mentioned here.

    Args:
        config: the ``ModelConfig``.
        strategy: ``single``, ``ddp``, ``fsdp`` or ``other`` (``lmtrain.module.strategy_kind_of``).
        world_size: processes of the run (None: not known yet, e.g. ``devices: auto``; checks that need it pass).
        training: the run trains; validate and test take no training step, so the training step's options
            (``cuda_graphs``, ``optimizer_in_backward``, e.g. from a checkpoint's hyperparameters) pass.

    Raises:
        LmtrainError: FSDP2 with ``cuda_graphs``, per-layer or selective/offloaded checkpointing; DDP on several
            ranks with ``cuda_graphs`` or ``optimizer_in_backward``.
    """
    fsdp = "under FSDP2 (trainer.strategy: ModelParallelStrategy)"
    if strategy == "fsdp":
        if config.cuda_graphs and training:
            raise LmtrainError("model.cuda_graphs", f"is not available {fsdp}: FSDP2 allocates and frees each "
                               "block's gathered parameters and issues its all-gathers and reduce-scatters from "
                               "host-side hooks at every step, which a replayed graph would not repeat.",
                               "set model.cuda_graphs: false (per-block compile and prefetching hide the launches "
                               "and the communication) or train on one device.")
        if config.checkpoint_layers is not None:
            raise LmtrainError("model.checkpoint_layers", f"is not available {fsdp}, which checkpoints every "
                               "sharded block.", "leave model.checkpoint_layers null with this strategy.")
        if config.activation_checkpointing not in ("none", "full"):
            raise LmtrainError("model.activation_checkpointing", f"policy {config.activation_checkpointing!r} is "
                               f"not available {fsdp}; each sharded block is checkpointed whole.",
                               "use model.activation_checkpointing: full (or none) with this strategy.")
    several = world_size is not None and world_size > 1
    if strategy == "ddp" and several and training:
        ddp = f"under DDP (trainer.strategy: ddp) on {world_size} ranks"
        if config.cuda_graphs:
            raise LmtrainError("model.cuda_graphs", f"is not available {ddp}: DDP's reducer launches each bucket's "
                               "all-reduce from host-side autograd hooks, which a replayed graph would not repeat.",
                               "set model.cuda_graphs: false (compile with DDP's larger buckets instead), or use "
                               "one device.")
        if config.optimizer_in_backward:
            raise LmtrainError("model.optimizer_in_backward", f"is not available {ddp}: each rank would update "
                               "from its own gradient before the all-reduce has averaged it, and the replicas "
                               "would drift apart.", "use FSDP2 (trainer.strategy: lightning.pytorch.strategies."
                               "ModelParallelStrategy, which runs the update after each gradient's reduce-scatter) "
                               "or model.optimizer_in_backward: false.")


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D data-parallel mesh that FSDP2 shards over, from ``ModelParallelStrategy``'s 2-D mesh.

    lmtrain has no tensor parallelism: the ``tensor_parallel`` dimension must have size 1, i.e. the
    strategy is built with ``data_parallel_size`` equal to the world size and ``tensor_parallel_size: 1``.
    (Lightning's defaults, ``auto``/``auto``, mean one data-parallel group per node and tensor
    parallelism inside the node, which would leave the GPUs of one node with the same batch.)

    Raises:
        LmtrainError: the mesh has a tensor-parallel dimension larger than 1.
    """
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 1:
        return mesh
    if DATA_PARALLEL_DIM not in names:
        raise LmtrainError("trainer.strategy", f"the device mesh has no {DATA_PARALLEL_DIM!r} dimension "
                           f"(dimensions: {names}).", "use lightning.pytorch.strategies.ModelParallelStrategy.")
    check_tensor_parallel_size(mesh[TENSOR_PARALLEL_DIM].size() if TENSOR_PARALLEL_DIM in names else 1, mesh.size())
    return mesh[DATA_PARALLEL_DIM]


def mesh_sizes(data_parallel_size: int | str, tensor_parallel_size: int | str, num_nodes: int,
               devices: int) -> tuple[int, int]:
    """The data- and tensor-parallel sizes of the mesh that ``ModelParallelStrategy`` builds from its arguments, as
    Lightning resolves them in ``setup_environment``: ``auto`` data-parallel is the number of nodes, ``auto``
    tensor-parallel the processes of one node.

    Args:
        data_parallel_size: the strategy's ``data_parallel_size`` (an integer or ``auto``).
        tensor_parallel_size: the strategy's ``tensor_parallel_size`` (an integer or ``auto``).
        num_nodes: ``trainer.num_nodes``.
        devices: processes per node (``trainer.devices`` as Lightning counts them).
    """
    data = num_nodes if data_parallel_size == "auto" else int(data_parallel_size)
    tensor = devices if tensor_parallel_size == "auto" else int(tensor_parallel_size)
    return data, tensor


def check_mesh_sizes(data_parallel_size: int | str, tensor_parallel_size: int | str, num_nodes: int,
                     devices: int) -> None:
    """Refuse ``ModelParallelStrategy`` sizes that lmtrain cannot train with, before any process starts: a mesh
    whose size is not the number of processes (Lightning's ``RuntimeError`` once every process has started), or one
    with a tensor-parallel dimension (:func:`check_tensor_parallel_size`).

    The command line calls it with the parsed ``trainer.strategy.init_args`` (``lmtrain.cli_config.check_parsed_mesh``).

    Args:
        data_parallel_size: the strategy's ``data_parallel_size`` (an integer or ``auto``, :func:`mesh_sizes`).
        tensor_parallel_size: the strategy's ``tensor_parallel_size`` (an integer or ``auto``).
        num_nodes: ``trainer.num_nodes``.
        devices: processes per node (``trainer.devices`` as Lightning counts them).

    Raises:
        LmtrainError: data_parallel_size x tensor_parallel_size is not nodes x devices (naming
            ``tensor_parallel_size`` where it is not 1, ``data_parallel_size`` otherwise), or tensor_parallel_size
            is not 1.
    """
    data, tensor = mesh_sizes(data_parallel_size, tensor_parallel_size, num_nodes, devices)
    world_size = num_nodes * devices
    if data * tensor != world_size:
        shown = {"data": f"auto ({data}: the nodes)" if data_parallel_size == "auto" else str(data),
                 "tensor": f"auto ({tensor}: the devices of a node)" if tensor_parallel_size == "auto" else str(tensor)}
        field = "tensor_parallel_size" if tensor != 1 else "data_parallel_size"
        # A larger data-parallel size than processes may mean the devices were meant to grow, not the size to shrink.
        grow = tensor == 1 and data > world_size
        more = f", or give the run {data} processes (trainer.num_nodes x trainer.devices)" if grow else ""
        raise LmtrainError(
            f"trainer.strategy.init_args.{field}",
            f"data_parallel_size {shown['data']} x tensor_parallel_size {shown['tensor']} makes a device mesh of size "
            f"{data * tensor}, but the run's process count is {world_size} (nodes x devices: {num_nodes} x {devices}).",
            f"set trainer.strategy.init_args.data_parallel_size: {world_size} (nodes x devices) and "
            f"tensor_parallel_size: 1{more}.",
        )
    check_tensor_parallel_size(tensor, world_size)


def check_tensor_parallel_size(tensor_parallel_size: int, world_size: int) -> None:
    """Refuse a ``ModelParallelStrategy`` mesh with a tensor-parallel dimension: lmtrain shards data-parallel only.

    Called with the strategy's mesh (:func:`data_parallel_mesh`) and, before any process starts, by
    :func:`check_mesh_sizes` with the sizes the parsed ``trainer.strategy`` will give it.

    Raises:
        LmtrainError: ``tensor_parallel_size`` is not 1.
    """
    if tensor_parallel_size != 1:
        raise LmtrainError(
            "trainer.strategy.init_args.tensor_parallel_size",
            f"the device mesh has tensor_parallel size {tensor_parallel_size}; lmtrain shards data-parallel only "
            "(FSDP2).",
            f"set trainer.strategy.init_args.data_parallel_size: {world_size} (nodes x devices) and "
            "tensor_parallel_size: 1.",
        )


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    precision: str = "32-true",
    activation_checkpointing: bool = False,
    compile: bool = False,
    compile_mode: str = "default",
    *,
    compile_fullgraph: bool = False,
    reshard_after_forward: str = "blocks",
    prefetch: bool = True,
) -> nn.Module:
    """Apply activation checkpointing, ``torch.compile`` and FSDP2 to a ``TransformerLM``, in place.

    Args:
        model: a ``TransformerLM`` (any module with a ``blocks`` ``nn.ModuleList``) built *without* its own
            activation checkpointing: here each block is wrapped instead, before it is sharded.
        mesh: the strategy's device mesh (``LightningModule.device_mesh``); see :func:`data_parallel_mesh`.
        precision: the trainer's precision string (:func:`mixed_precision_policy`).
        activation_checkpointing: recompute each block in the backward pass (non-reentrant checkpoint).
        compile: compile each block (``nn.Module.compile``, in place: parameter names stay those of the
            eager model) before sharding it.
        compile_mode: ``torch.compile``'s mode (``lmtrain.config.COMPILE_MODES``).
        compile_fullgraph: compile each block as one graph (``fullgraph=True``).
        reshard_after_forward: which blocks free their gathered parameters after the forward pass
            (``lmtrain.config.RESHARD_POLICIES``, :func:`reshard_after_forward_of`); the root never does.
        prefetch: set each block's explicit forward and backward prefetch (:func:`set_prefetch`).

    Returns:
        ``model``, now an ``FSDPModule`` whose blocks are ``FSDPModule`` s too.
    """
    from torch.distributed.fsdp import fully_shard

    dp_mesh = data_parallel_mesh(mesh)
    policy = mixed_precision_policy(precision)
    blocks = model.blocks
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(blocks):
            # The wrapper's state-dict hooks drop its "_checkpoint_wrapped_module." prefix, so checkpoints keep
            # the eager model's keys.
            blocks[i] = checkpoint_wrapper(block)
    if compile:
        for block in blocks:
            block.compile(**compile_kwargs(compile_mode, compile_fullgraph))
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=dp_mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward_of(reshard_after_forward, i, len(blocks)))
    # The root takes the embedding, final norm and output head. Its parameters stay unsharded from forward to
    # backward: the backward pass starts with the output head.
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)
    if prefetch:
        set_prefetch(model, list(blocks), backward=reshard_after_forward != "none")
    return model


def reshard_after_forward_of(policy: str, index: int, num_blocks: int) -> bool:
    """Whether block ``index`` of ``num_blocks`` frees its gathered parameters after its forward pass.

    ``blocks``: every block but the last, whose parameters the backward pass, which starts with it, would
    all-gather again at once (torchtitan's default); ``all``: every block; ``none``: no block (no all-gathers in
    the backward pass, the whole model gathered in memory from forward to backward).

    Raises:
        LmtrainError: an unknown policy.
    """
    if policy == "blocks":
        return index < num_blocks - 1
    if policy in ("all", "none"):
        return policy == "all"
    raise LmtrainError("model.fsdp_reshard_after_forward", f"unknown policy {policy!r}.",
                       f"use one of {', '.join(RESHARD_POLICIES)}.")


def set_prefetch(root: nn.Module, blocks: list[nn.Module], backward: bool = True) -> None:
    """Explicit FSDP2 prefetching, torchtitan's: the root's forward and each block's forward start the next
    block's all-gather; with ``backward``, each block's backward starts the previous block's.

    Under per-block compile the CPU reaches a block's pre-forward hook only when it has launched the previous
    compiled block, and FSDP2's implicit backward prefetch follows the order recorded in the forward pass. With
    the next unit named explicitly, its all-gather is issued (on FSDP2's all-gather stream) as soon as the
    current unit's has been, one block ahead of the compute. The last block prefetches nothing in the forward
    pass (the root is already gathered) and block 0 nothing in the backward pass (the root stays gathered).

    Args:
        root: the root ``FSDPModule`` (embedding, final norm, output head).
        blocks: the transformer blocks, each an ``FSDPModule``, in forward order.
        backward: set the backward prefetch too (False when no block reshards after forward: nothing to gather).
    """
    if not blocks:
        return
    root.set_modules_to_forward_prefetch([blocks[0]])
    for block, following in zip(blocks, blocks[1:], strict=False):
        block.set_modules_to_forward_prefetch([following])
        if backward:
            following.set_modules_to_backward_prefetch([block])


def fsdp_modules(model: nn.Module) -> list[str]:
    """Names of the submodules of ``model`` that are FSDP2 units (``""`` for the root), in module order."""
    from torch.distributed.fsdp import FSDPModule

    return [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]


def end_process_group() -> None:
    """End the process group of a finished multi-process run: a barrier, then ``destroy_process_group``.

    Call it after a run that finished on every rank (after a failure a rank may still wait in a collective, and
    the barrier would hang). Without the barrier the ranks leave at different moments, and gloo's worker threads
    can still be finishing a collective while the interpreter shuts down; they then abort the process
    ("terminate called without an active exception") after a run that succeeded. With it, 24 two-process FSDP2
    fits on the CPU ended cleanly where about one in five had aborted without it.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def build_sharded_model(module: Any) -> nn.Module:
    """The model of ``module``, built on its device and sharded over ``module.device_mesh`` with FSDP2.

    ``ModelParallelStrategy`` does not place the tensors that ``configure_model`` creates (its init context
    sets no device), so the model is built on the rank's device explicitly: the same device and seed as a
    single-device or DDP run, hence the same initial weights. Activation checkpointing and compile are
    applied per block by ``lmtrain.distributed.shard_model``, so the model itself is built without its own
    checkpointing (that would checkpoint each block twice).
    """
    from lmtrain.float8 import convert_model
    from lmtrain.model import TransformerLM

    precision = str(module.trainer.precision)
    check_fsdp_precision(precision)  # before building: a 2.7B model takes a while to initialise
    from lightning.pytorch.trainer.states import TrainerFn

    check_strategy_options(module.config, "fsdp", None, training=module.trainer.state.fn == TrainerFn.FITTING)
    policy = module.config.activation_checkpointing
    with torch.device(module.trainer.strategy.root_device):
        model = TransformerLM(replace(module.config, activation_checkpointing="none"))
    config = module.config
    convert_model(model, module.config, fsdp=True)  # float8 layers before compile and fully_shard (lmtrain.float8)
    return shard_model(model, module.device_mesh, precision, activation_checkpointing=policy == "full",
                       compile=config.compile, compile_mode=config.compile_mode,
                       compile_fullgraph=config.compile_fullgraph,
                       reshard_after_forward=config.fsdp_reshard_after_forward, prefetch=config.fsdp_prefetch)
