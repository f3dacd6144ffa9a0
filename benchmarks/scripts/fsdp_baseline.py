"""A torchtitan-style FSDP2 baseline: plain PyTorch on lmtrain's model shape, no Lightning, no lmtrain training code.

The recipe is torchtitan's for a dense model (``torchtitan/models/llama3/infra/parallelize.py``): per transformer
block ``torch.compile(block, fullgraph=True)`` then ``fully_shard(block, reshard_after_forward=...)`` (every block
but the last resharded after forward), then ``fully_shard`` on the root; ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``; the loss compiled on its own; fused AdamW (lr 3e-4, betas (0.9, 0.95), weight decay 0.1 on
every parameter, as torchtitan's default); synthetic uniform token ids. torchtitan leaves FSDP2's prefetching
implicit for dense models, and so does this script (``--explicit-prefetch`` sets torchtitan's MoE-model prefetch
instead). The model is ``lmtrain.model.TransformerLM`` built from ``lmtrain.config.ModelConfig`` (its only lmtrain
imports), so the FLOPs are the same as lmtrain's.

Run with torchrun on one node (NVLink multicast off, as in every lmtrain measurement on these machines):

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/scripts/fsdp_baseline.py \
        [--size 2.7B --context 1024 --batch 4 --warmup 5 --steps 20]

A smoke test of the same code on the CPU (gloo, fp32, the host clock):

    torchrun --standalone --nproc-per-node 2 benchmarks/scripts/fsdp_baseline.py --cpu --size tiny --context 32 \
        --batch 2 --warmup 1 --steps 2

Each step is timed with CUDA events on rank 0's current stream after the warm-up steps (compilation happens in
the first); the script prints one JSON line on rank 0: median step ms, tokens/s per GPU, peak memory (GiB, the
largest over the ranks), world size and the settings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's lmtrain, installed or not

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The model, compiled per block and sharded per block then at the root (torchtitan's order)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lmtrain.config import ModelConfig
    from lmtrain.model import TransformerLM

    cfg = ModelConfig.from_size(args.size, vocab_size=args.vocab, context_length=args.context, attention="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = TransformerLM(cfg)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = (MixedPrecisionPolicy() if device.type == "cpu"
              else MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    blocks = model.blocks
    for i, block in enumerate(blocks):
        blocks[i] = torch.compile(block, fullgraph=True)
    last = len(blocks) - 1
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < last)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if args.explicit_prefetch:
        for block, following in zip(blocks, list(blocks)[1:], strict=False):
            block.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([block])
    return model


@torch.compile
def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """torchtitan's loss: fp32 cross-entropy over the flattened tokens, compiled on its own."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _mark(cpu: bool) -> float | torch.cuda.Event:
    """A point in time: a recorded CUDA event on the GPU, the host clock on the CPU."""
    if cpu:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed_ms(start: float | torch.cuda.Event, end: float | torch.cuda.Event) -> float:
    if isinstance(start, float):
        return (end - start) * 1000
    end.synchronize()
    return start.elapsed_time(end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2.7B")
    parser.add_argument("--vocab", type=int, default=10_000)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4, help="sequences per GPU and step")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps after the warm-up")
    parser.add_argument("--explicit-prefetch", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="smoke test on the CPU: gloo, the host clock, unfused "
                        "AdamW, fp32 (e.g. --size tiny --context 64 --warmup 1 --steps 2)")
    args = parser.parse_args()
    for name, value in MULTICAST_OFF.items():
        if os.environ.get(name, value) != value:
            raise SystemExit(f"{name}={os.environ[name]}: run with {name}={value} (NVLink multicast off).")
        os.environ[name] = value
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    model = build(args, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=not args.cpu)
    generator = torch.Generator(device=device).manual_seed(1000 + dist.get_rank())
    times: list[float] = []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.context + 1), device=device, generator=generator)
        start = _mark(args.cpu)
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append(_elapsed_ms(start, _mark(args.cpu)))
    peak = torch.tensor(0.0 if args.cpu else torch.cuda.max_memory_allocated() / 1024**3, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    median = statistics.median(times)
    if dist.get_rank() == 0:
        print(json.dumps({"cell": "baseline", "world_size": dist.get_world_size(), "step_ms": round(median, 2),
                          "tokens_per_s_per_gpu": round(args.batch * args.context / (median / 1000), 1),
                          "peak_gib": round(float(peak), 2), "loss": round(float(loss.detach()), 4), "size": args.size,
                          "context": args.context, "batch_per_gpu": args.batch,
                          "explicit_prefetch": args.explicit_prefetch}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
