"""Memory plan and step time of a config: memory per GPU, the largest context that fits, step time and tokens/s.

    python -m lmtrain estimate --config configs/tiny.yaml [--model.context_length 1024] [--data.batch_size 8]
        [--trainer.precision bf16-mixed] [--model.attention naive] [--gpu-memory-gib 80] [--mode train]
        [--model.activation_checkpointing full] [--model.optimizer_in_backward true] [--model.loss_chunk_tokens 4096]
        [--model.float8 tensorwise]
        [--trainer.strategy ddp --trainer.devices 2] [--trainer.num_nodes 2]
        [--calibrate bench_model.json] [--comm bench_comm.json] [--mfu 0.4] [--inter-node-gbps 45]

"Fits" is judged against the device's usable capacity: its total memory (``torch.cuda.mem_get_info`` when a GPU
is visible, else ``--gpu-memory-gib``) less 1 GiB for the CUDA context and kernel images and 5% for the caching
allocator's fragmentation (``lmtrain.memory_plan.device_capacity_bytes``). Under ``--trainer.strategy ddp`` or
FSDP2 (``ModelParallelStrategy``) the plan is per GPU, with ``--trainer.devices`` x ``--trainer.num_nodes`` GPUs
(``data.batch_size`` is per GPU).

The step time (``lmtrain.step_time``; the model is stated in ``docs/distributed.md``, "Predicting step time") scales a
one-GPU step (``--calibrate``: a ``bench model`` record or a calibration file; otherwise the step's FLOPs at
``--mfu``, printed as an assumption) to the GPUs of the trainer with the bus bandwidths of a ``bench comm`` record
(``--comm``; otherwise ``--intra-node-gbps``), and under several GPUs compares FSDP2 with DDP.

The config is resolved by the parser of ``python -m lmtrain fit`` (``lmtrain.cli_config``): the same
sections, links, defaults and dotted overrides, so any option of ``fit`` is accepted here. The formula is in
``lmtrain.memory_plan``; no model is built and no GPU is needed.
"""

from __future__ import annotations

import argparse
import math

from lmtrain.cli_config import ResolvedConfig, resolve_args, strategy_of
from lmtrain.config import ModelConfig
from lmtrain.errors import LmtrainError, positive_number
from lmtrain.float8 import block_linear_shapes, converts_shape
from lmtrain.flops import STEP_MODES, compute_dtype, parameter_count
from lmtrain.memory_plan import (
    GIB,
    PRECISIONS,
    device_capacity_bytes,
    estimate_memory,
    fits,
    max_fitting,
)

#: Total memory CUDA reports for an 80 GB H100 ("GPU 0 has a total capacity of 79.18 GiB" in its out-of-memory
#: message, 2026-11-23): the default device to plan for when no GPU is visible.
H100_80GB_GIB = 79.18

#: Arguments this command does not know itself go to the ``fit`` parser.
PASS_UNKNOWN_ARGUMENTS = True


def help_epilog() -> str:
    """The end of ``--help``: the ``fit`` options and the registered attention backends."""
    from lmtrain.attention import available_backends, backend_info

    lines = ["Every option of `python -m lmtrain fit` is accepted too: --config FILE, --model.*, --data.*, --trainer.*",
             "(e.g. --model.context_length 1024, --data.batch_size 8, --trainer.precision bf16-mixed).",
             f"Precisions the planner knows: {', '.join(PRECISIONS)}.", "", "attention backends (--model.attention):"]
    for name in available_backends():
        info = backend_info(name)
        notes = [text for flag, text in ((info.needs_gpu, "CUDA GPU"), (info.materializes_scores,
                                                                        "stores the N x N scores")) if flag]
        lines.append(f"  {name:<14} {info.description}" + (f" ({'; '.join(notes)})" if notes else ""))
    return "\n".join(lines)


#: Compute beside hidden communication runs this many times as long as alone: KernelShare's
#: ``kernels/compute_beside_comm_slowdown`` on the four ranks of compiled FSDP2, 2.7B on 4 H200s, was 1.37-1.44
#: (benchmarks/2026-11-28-H200x2-comm-interference.md).
OVERLAP_SLOWDOWN = 1.4


def _slowdown(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 1.0 and math.isfinite(value)):  # also NaN, infinity and what is no number
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 1 (1: compute not slowed), got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``python -m lmtrain estimate`` (the ``fit`` options are parsed by the ``fit`` parser)."""
    parser.add_argument("--mode", choices=STEP_MODES, default=None,
                        help="step to plan: train, forward_backward or forward (default: model.step_mode, train)")
    parser.add_argument("--gpu-memory-gib", type=float, default=H100_80GB_GIB,
                        help="total memory of the GPU to plan for, GiB, used when no GPU is visible (default "
                             f"{H100_80GB_GIB}, what CUDA reports for an 80 GB H100); the allowances for the CUDA "
                             "context and fragmentation are taken off")
    step = parser.add_argument_group("step time (the model: docs/distributed.md, Predicting step time)")
    step.add_argument("--calibrate", default=None, metavar="FILE",
                      help="the one-GPU step: a `bench model --out` JSON record (a timed training row at this size, "
                           'batch, context and precision) or {"forward_ms": F, "backward_ms": B, "optimizer_ms": O}; '
                           "without it the step's FLOPs at --mfu")
    step.add_argument("--comm", default=None, metavar="FILE",
                      help="a `bench comm --out` JSON record: the bus bandwidths per message size; without it "
                           "--intra-node-gbps")
    step.add_argument("--mfu", type=positive_number, default=0.4,
                      help="model FLOPs utilisation assumed without --calibrate (default 0.4)")
    step.add_argument("--memory-gbps", type=positive_number, default=3000.0,
                      help="device memory bandwidth for AdamW assumed without --calibrate, GB/s (default 3000, what a "
                           "copy reaches on an H100 SXM)")
    step.add_argument("--intra-node-gbps", type=positive_number, default=350.0,
                      help="bus bandwidth inside a node assumed without --comm, GB/s (default 350: NVLink 4)")
    step.add_argument("--overlap-slowdown", type=_slowdown, default=OVERLAP_SLOWDOWN,
                      help="how many times as long compute takes beside the communication it hides (KernelShare's "
                           "kernels/compute_beside_comm_slowdown of a run; 1: not slowed; default "
                           f"{OVERLAP_SLOWDOWN:g}, compiled FSDP2 of 2.7B on 4 H200s)")
    step.add_argument("--inter-node-gbps", type=positive_number, default=45.0,
                      help="bus bandwidth per GPU between nodes, GB/s, assumed (default 45: one 400 Gb/s network "
                           "interface per GPU at 90%%)")


def resolve(args: argparse.Namespace) -> tuple[ResolvedConfig, str]:
    """(resolved config, step mode) of the command line: the ``fit`` options and ``--mode``."""
    resolved = resolve_args(list(getattr(args, "config_args", []) or []))
    mode = args.mode or resolved.model.get("step_mode") or "train"
    if resolved.precision not in PRECISIONS:
        raise LmtrainError("trainer.precision", f"the planner does not know {resolved.precision!r}.",
                           f"use one of {', '.join(PRECISIONS)}.")
    return resolved, mode


def parallel_of(trainer: dict) -> tuple[str, int, dict]:
    """(strategy kind, GPUs, DDP arguments) of the resolved trainer arguments.

    The kind and the process count are ``lmtrain.cli_config.strategy_of``'s (``auto`` on several GPUs is DDP;
    ``devices`` ``auto`` or -1 counts one GPU); DDP on one GPU is the one-GPU step. The DDP arguments are those the
    trainer builds (:func:`ddp_arguments_of`), empty under the other strategies.

    Raises:
        LmtrainError: a strategy the planner has no plan for (e.g. Lightning's ``fsdp``, FSDP1).
    """
    kind, processes = strategy_of(trainer)
    if kind == "other":
        strategy = trainer.get("strategy")
        name = strategy.get("class_path") if isinstance(strategy, dict) else strategy
        raise LmtrainError("trainer.strategy", f"the memory planner has no plan for {name!r}.",
                           "plan ddp, lightning.pytorch.strategies.ModelParallelStrategy (FSDP2, how lmtrain shards; "
                           "docs/distributed.md) or auto.")
    # devices auto: one process per node at least (what each node runs is known once the trainer exists)
    world = processes or max(1, int(trainer.get("num_nodes") or 1))
    if kind == "ddp" and world == 1:
        kind = "single"  # DDP on one device is the single-device step
    return kind, world, ddp_arguments_of(trainer) if kind == "ddp" else {}


def ddp_arguments_of(trainer: dict) -> dict:
    """The ``DDPStrategy`` arguments a resolved ``trainer`` section builds: lmtrain's (``ddp_arguments``) for
    ``strategy: ddp`` (the name, as ``fit``'s command line builds it), the ``init_args`` of a ``class_path`` entry,
    else none (``auto`` on several GPUs and the other ``ddp_*`` names: PyTorch's defaults)."""
    from lmtrain.distributed import builds_lmtrain_ddp, ddp_arguments

    strategy = trainer.get("strategy", "auto")
    if builds_lmtrain_ddp(strategy):
        return ddp_arguments(int(trainer.get("accumulate_grad_batches") or 1))
    if isinstance(strategy, dict):
        return dict(strategy.get("init_args") or {})
    return {}


def run(args: argparse.Namespace) -> int:
    resolved, mode = resolve(args)
    cfg = resolved.model_config()
    batch = int(resolved.data["batch_size"])
    if batch < 1:
        raise LmtrainError("data.batch_size", f"must be at least 1, got {batch}.", "give sequences per GPU, e.g. 4.")
    nodes = resolved.trainer.get("num_nodes", 1)
    if nodes is not None and int(nodes) < 1:
        raise LmtrainError("trainer.num_nodes", f"must be at least 1, got {nodes}.",
                           "give the number of nodes, e.g. 1.")
    precision = resolved.precision
    strategy, world, ddp_kwargs = parallel_of(resolved.trainer)
    from lmtrain.distributed import check_strategy_options

    check_strategy_options(cfg, strategy, world, training=mode == "train")  # what fit would refuse, not planned
    parallel = {"strategy": strategy, "world_size": world,
                "gradient_as_bucket_view": bool(ddp_kwargs.get("gradient_as_bucket_view", False))}
    plan = estimate_memory(cfg, batch, cfg.context_length, precision, mode, **parallel)

    def largest(budget: int, **kw: int | None) -> int:
        return max_fitting(cfg, budget, precision=precision, mode=mode, **kw, **parallel)
    capacity = device_capacity_bytes(args.gpu_memory_gib)
    options = [f"activation checkpointing {cfg.activation_checkpointing}"]
    if cfg.checkpoint_layers is not None:
        options.append(f"on the first {cfg.checkpoint_layers} blocks, the rest {cfg.checkpoint_rest}")
    if cfg.optimizer_in_backward:
        options.append("optimizer in the backward pass")
    if cfg.loss_chunk_tokens:
        options.append(f"loss in chunks of {cfg.loss_chunk_tokens} tokens")
    if cfg.float8 != "none":
        options.append(float8_line(cfg))
    print(f"model: {parameter_count(cfg):,} parameters (d_model {cfg.d_model}, {cfg.num_layers} layers, "
          f"{cfg.num_heads} heads, d_ff {cfg.d_ff}, vocab {cfg.vocab_size}), attention {cfg.attention}, "
          f"{', '.join(options)}")
    where = "one GPU" if strategy == "single" else f"per GPU, {strategy} over {world} GPUs"
    print(f"step: batch {batch} x context {cfg.context_length}, {precision}, mode {mode}, {where}")
    print()
    print(plan.table())
    host = plan.details.get("host_bytes", 0)
    if host:
        print(f"pinned host memory (offloaded block inputs): {host / GIB:.2f} GiB")
    print()
    max_t = largest(capacity, batch_size=batch)
    max_b = largest(capacity, seq_len=cfg.context_length)
    verdict = "fits" if fits(plan, capacity) else "does NOT fit"
    needed = f" (peak {plan.peak_gib:.2f} GiB + {plan.cached / GIB:.2f} GiB of the whole loss's buffers, still " \
        "cached after the loss; loss_chunk_tokens avoids them)" if plan.cached else ""
    print(f"{plan.needed / GIB:.2f} GiB{needed} {verdict} in {capacity / GIB:.2f} GiB usable (device total less 1 GiB "
          f"for the CUDA context and 5% for fragmentation). Largest context at batch {batch}: {max_t}; largest batch "
          f"at context {cfg.context_length}: {max_b}.")
    print()
    print(step_time_text(args, resolved, cfg, batch, precision, strategy, world, ddp_kwargs))
    if cfg.attention == "flash_triton":
        print()
        print(flash_kernel_lines(cfg.context_length, cfg.d_model // cfg.num_heads, precision))
    return 0


def float8_line(cfg: ModelConfig) -> str:
    """How many linear layers ``cfg.float8`` converts under the size rule (``lmtrain.float8.converts_shape``)."""
    shapes = block_linear_shapes(cfg).values()
    per_block = sum(converts_shape(i, o, False, cfg) for i, o in shapes)
    head = converts_shape(cfg.d_model, cfg.vocab_size, True, cfg)
    total = cfg.num_layers * len(shapes) + 1
    return (f"float8 {cfg.float8} on {per_block * cfg.num_layers + head} of {total} linear layers (in and out "
            f"features >= {cfg.float8_min_features}, head {'included' if head else 'not converted'})")


def step_time_text(args: argparse.Namespace, resolved: ResolvedConfig, cfg: ModelConfig, batch: int, precision: str,
                   strategy: str, world: int, ddp_kwargs: dict | None = None) -> str:
    """The step-time prediction (``lmtrain.step_time``) with its inputs, and under several GPUs FSDP2 against DDP.

    DDP's bucket is that of ``ddp_kwargs`` under ``ddp`` (the trainer's DDP arguments), else that of lmtrain's
    ``strategy: ddp`` (the comparison's DDP)."""
    import torch

    from lmtrain.bench.comm import read_record
    from lmtrain.flops import peak_flops
    from lmtrain.step_time import (
        StepPrediction,
        ddp_bucket_bytes,
        describe,
        network_from_record,
        one_gpu_from_flops,
        one_gpu_from_record,
        predict,
        units,
    )

    nodes = max(1, int(resolved.trainer.get("num_nodes") or 1))
    if args.calibrate:
        one = one_gpu_from_record(_read_json(args.calibrate, "--calibrate"), args.calibrate,
                                  resolved.model.get("size"), batch, cfg.context_length, precision, cfg.attention,
                                  cfg.compile)
    else:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "H100"
        peak = peak_flops(device, precision)
        if peak is None:
            return (f"step time: not predicted: no peak FLOP/s is known for {device!r} to assume the step from "
                    "(give a measured one-GPU step with --calibrate FILE).")
        one = one_gpu_from_flops(cfg, batch, cfg.context_length, peak, args.mfu, args.memory_gbps)
    record = read_record(args.comm) if args.comm else None
    network = network_from_record(record, args.comm or "assumed", args.intra_node_gbps, args.inter_node_gbps)
    where = (f"{args.comm} ({record['meta'].get('device')}, {record['meta'].get('world_size')} ranks)" if record
             else f"assumed {args.intra_node_gbps:g} GB/s for every collective")
    u = units(cfg, batch, cfg.context_length, precision)
    bucket = ddp_bucket_bytes(ddp_kwargs if strategy == "ddp" else None)
    tokens = batch * cfg.context_length
    inputs = [f"one-GPU step: forward {one.forward_ms:.2f} ms, backward {one.backward_ms:.2f} ms, optimizer "
              f"{one.optimizer_ms:.2f} ms; from {one.source}",
              f"bus bandwidth inside a node: {where}",
              f"bus bandwidth between nodes: {args.inter_node_gbps:g} GB/s per GPU (assumed)" if nodes > 1 else
              f"one node ({world} GPUs)",
              f"FSDP units: {u.layers} blocks of {u.block_params:,} parameters and the root of {u.root_params:,}; "
              f"all-gather {u.gather_bytes} bytes per parameter, gradients reduce-scattered in {u.grad_bytes} bytes; "
              f"DDP all-reduces {u.ddp_gradient_bytes() / 2**20:,.0f} MiB of gradients"
              + (f" (the {u.ddp_bf16_grads:,} linear weights' in bf16: master weights)" if u.ddp_bf16_grads else ""),
              "overlap: each block's all-gather hides behind the previous block's compute (the root's and the first "
              "block's are exposed); in backward the next all-gather and the previous reduce-scatter hide behind a "
              f"block's backward, the last two reduce-scatters are exposed; DDP: all but the last {bucket / 2**20:g} "
              "MiB bucket of the all-reduce hides behind the backward",
              f"compute beside hidden communication: {args.overlap_slowdown:g}x as long as alone (--overlap-slowdown)"]

    def plan(kind: str, ranks: int, over_nodes: int) -> StepPrediction:
        return predict(u, one.forward_ms, one.backward_ms, one.optimizer_ms, kind, ranks, over_nodes, network,
                       tokens, reshard=cfg.fsdp_reshard_after_forward, bucket_bytes=bucket,
                       overlap_slowdown=args.overlap_slowdown)

    # Without ddp or FSDP2 the memory plan is one GPU's, and so is this prediction (the table below has N GPUs).
    chosen = plan(strategy, 1 if strategy == "single" else world, nodes)
    lines = ["step time: step = forward + backward + optimizer (/ N under FSDP2) + exposed communication + compute "
             "slowed beside the hidden communication",
             describe(chosen, inputs)]
    if world > 1:
        single = plan("single", 1, 1)
        body = []
        for kind in ("fsdp", "ddp"):
            p = plan(kind, world, nodes)
            body.append([kind, f"{p.step_ms:.2f}", f"{p.exposed_ms:.2f}", f"{p.slowed_ms:.2f}",
                         f"{p.tokens_per_s:,.0f}", f"{p.tokens_per_s / world:,.0f}",
                         f"{p.tokens_per_s / world / single.tokens_per_s:.3f}"])
        from lmtrain.bench.tables import markdown_table

        lines += ["", f"on {world} GPUs (1 GPU: {single.step_ms:.2f} ms, {single.tokens_per_s:,.0f} tokens/s):",
                  markdown_table(["strategy", "step ms", "exposed ms", "slowed compute ms", "tokens/s",
                                  "tokens/s per GPU", "scaling"], body)]
    return "\n".join(lines)


def _read_json(path: str, option: str) -> dict:
    import json
    from pathlib import Path

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise LmtrainError(option, f"{path} cannot be read as JSON ({exc}).", "give a JSON file.") from None
    if not isinstance(data, dict):
        raise LmtrainError(option, f"{path} holds no JSON object.", "give a record or a calibration file.")
    return data


def flash_kernel_lines(seq_len: int, head_dim: int, precision: str) -> str:
    """Which flash_triton kernels serve the model's attention on this device (on a machine without a GPU: on an
    sm_90 GPU, as an H100 would run it), and why (``lmtrain.kernels.flash.explain``)."""
    import torch

    from lmtrain.kernels.flash import explain

    dtype = compute_dtype(precision)
    here = explain([(seq_len, head_dim)], dtype=dtype)
    return here if torch.cuda.is_available() else here + "\n" + explain([(seq_len, head_dim)], "sm_90", dtype)
