"""DDP and FSDP2 on one node of 2 GPUs: throughput, scaling, losses, longest context, planned vs measured peak.

Run from the repository root on a machine with 2 CUDA GPUs (one call does everything; on 2 x H200 about
4 minutes, most of it starting processes and building the model):

    python benchmarks/scripts/distributed_probe.py [--out DIR] [--cells 1gpu ddp fsdp long]
        [--ddp "" "gradient_as_bucket_view=1,bucket_cap_mb=100,static_graph=1"]

``--ddp`` runs one ddp cell per value, each with those DDPStrategy arguments ("" for Lightning's defaults).
A smoke run of the same code on the CPU (2 gloo processes, the tiny model, fp32, short contexts):

    python benchmarks/scripts/distributed_probe.py --cpu --size tiny --context 64 --long-contexts 128 \
        --steps 5 --long-steps 4 --batch 2

Cells (2.7B, bf16-mixed, sdpa, synthetic data), each in its own process group started by Lightning:

    1gpu        1 GPU, context 1024, batch 4, 20 steps
    ddp         2 GPUs, ddp, context 1024, batch 4 per GPU, 20 steps
    fsdp        2 GPUs, FSDP2 (ModelParallelStrategy), context 1024, batch 4 per GPU, 20 steps
    fsdp_ac_T   2 GPUs, FSDP2 + activation checkpointing, batch 1 per GPU, context T: 32768, then 16384 and
                8192 until one fits, 4 steps

Step time: the median of the synchronised steps after the first 3 (fewer when a cell has fewer steps).
tokens/s per GPU = batch x context / step time; scaling efficiency = a 2-GPU cell's tokens/s per GPU over
the 1-GPU cell's. Peak: the largest ``torch.cuda.max_memory_allocated`` over the ranks, counted from the
start of training (after the model is built and sharded), next to
``lmtrain.memory_plan.estimate_memory`` (with ``strategy`` and ``world_size``). Losses: the rank-averaged loss of
each of the 20 steps of ``ddp`` and ``fsdp`` (same data order: both read through Lightning's distributed sampler at
world size 2).
Each cell writes ``DIR/<cell>.json``; the table is printed last.

NVLink multicast stays off in every process (the variables below are exported before any process starts,
and Lightning's ranks inherit them).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PRECISION, WARMUP = "bf16-mixed", 3


def worker(args: argparse.Namespace) -> None:
    """One cell: fit, time every step, record losses and the peak; rank 0 writes ``args.json``."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lmtrain.bench.clock import Clock
    from lmtrain.data import LMDataModule
    from lmtrain.module import LMModule

    cuda = not args.cpu

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.clock = Clock(cuda)  # CUDA events on a GPU, the host clock otherwise
            self.times: list[float] = []
            self.losses: list[float] = []
            self.start = None

        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()

        def on_train_batch_start(self, trainer, module, batch, idx) -> None:  # noqa: ANN001
            self.start = self.clock.mark()

        def on_train_batch_end(self, trainer, module, outputs, batch, idx) -> None:  # noqa: ANN001
            end = self.clock.mark()
            self.clock.sync()
            self.times.append(self.clock.ms(self.start, end) / 1000)
            self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    strategy = {"auto": "auto", "ddp": DDPStrategy(**ddp_kwargs(args.ddp)),
                "fsdp": ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)}[args.strategy]
    pl.seed_everything(0)
    module = LMModule(size=args.size, vocab_size=10_000, context_length=args.context, attention="sdpa",
                      activation_checkpointing=args.ac, warmup_steps=10)
    data = LMDataModule(source="synthetic", batch_size=args.batch, context_length=args.context, vocab_size=10_000,
                        train_batches=1000)
    probe = Probe()
    trainer = pl.Trainer(accelerator="gpu" if cuda else "cpu", devices=args.devices, strategy=strategy,
                         precision=PRECISION if cuda else "32-true",
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=[probe])
    result: dict = {"cell": args.name}
    try:
        trainer.fit(module, datamodule=data)
        peak = torch.tensor(float(torch.cuda.max_memory_allocated() if cuda else 0.0),
                            device=trainer.strategy.root_device)
        result.update(step_s=statistics.median(probe.times[min(WARMUP, len(probe.times) - 1):]), losses=probe.losses,
                      peak_gib=float(trainer.strategy.reduce(peak, reduce_op="max")) / 1024**3)
    except torch.OutOfMemoryError as error:
        result.update(oom=str(error).splitlines()[0])
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and trainer.global_rank == 0:
        Path(args.json).write_text(json.dumps(result))


def ddp_kwargs(text: str) -> dict:
    """``"gradient_as_bucket_view=1,bucket_cap_mb=100"`` -> DDPStrategy keyword arguments (ints; ``ddp_comm_hook``
    a dotted path to a function, such as ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.
    bf16_compress_hook``; else strings)."""
    kwargs = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        kwargs[key] = int(value) if value.lstrip("-").isdigit() else value
    if "ddp_comm_hook" in kwargs:
        module, _, name = kwargs["ddp_comm_hook"].rpartition(".")
        kwargs["ddp_comm_hook"] = getattr(importlib.import_module(module), name)
    for key in ("gradient_as_bucket_view", "static_graph"):
        if key in kwargs:
            kwargs[key] = bool(kwargs[key])
    return kwargs


def planned_gib(size: str, strategy: str, devices: int, batch: int, context: int, ac: bool) -> float:
    from lmtrain.config import ModelConfig
    from lmtrain.memory_plan import GIB, estimate_memory

    cfg = ModelConfig.from_size(size, vocab_size=10_000, context_length=context, activation_checkpointing=ac)
    kind = {"auto": "single", "ddp": "ddp", "fsdp": "fsdp"}[strategy]
    return estimate_memory(cfg, batch, context, PRECISION, strategy=kind, world_size=devices).peak / GIB


def run_cell(opts: argparse.Namespace, name: str, strategy: str, devices: int, batch: int, context: int,
             steps: int, ac: bool = False, ddp: str = "") -> dict:
    """One cell in its own process group (Lightning starts rank 1 by re-running the worker command); a cell that
    runs past ``--timeout`` is killed with every process it started."""
    out = Path(opts.out)
    path = out / f"{name}.json"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "worker", "--name", name, "--json", str(path), "--strategy", strategy,
           "--devices", str(devices), "--batch", str(batch), "--context", str(context), "--steps", str(steps),
           "--size", opts.size, "--ddp", ddp]
    if ac:
        cmd.append("--ac")
    if opts.cpu:
        cmd.append("--cpu")
    print(f"== {name}: {' '.join(cmd[2:])}", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=dict(os.environ, **MULTICAST_OFF), start_new_session=True)
    try:
        rc = proc.wait(opts.timeout)
    except subprocess.TimeoutExpired:
        rc = "timeout"
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # what is left of the cell's processes (rank 1 after a failure)
    except ProcessLookupError:
        pass
    proc.wait()
    result = json.loads(path.read_text()) if path.exists() else {"cell": name, "error": f"exit {rc}"}
    result.update(strategy=strategy, devices=devices, batch=batch, context=context, ac=ac, ddp=ddp,
                  wall_s=round(time.perf_counter() - start, 1),
                  planned_gib=planned_gib(opts.size, strategy, devices, batch, context, ac))
    if "step_s" in result:
        result["tokens_per_s_per_gpu"] = batch * context / result["step_s"]
    path.write_text(json.dumps(result))
    print(f"== {name}: {result.get('step_s', result.get('oom') or result.get('error'))} "
          f"({result['wall_s']} s)", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="distributed_probe")
    parser.add_argument("--size", default="2.7B", help="model size (default 2.7B)")
    parser.add_argument("--batch", type=int, default=4, help="batch per GPU of the throughput cells (default 4)")
    parser.add_argument("--context", type=int, default=1024, help="context of the throughput cells (default 1024)")
    parser.add_argument("--steps", type=int, default=20, help="steps of the throughput cells (default 20)")
    parser.add_argument("--long-contexts", type=int, nargs="*", default=[32768, 16384, 8192],
                        help="FSDP2 + activation checkpointing at batch 1: these contexts, until one trains")
    parser.add_argument("--long-steps", type=int, default=4, help="steps of a long-context cell (default 4)")
    parser.add_argument("--cells", nargs="+", default=["1gpu", "ddp", "fsdp", "long"],
                        help="which cells to run (default all: 1gpu ddp fsdp long)")
    parser.add_argument("--ddp", nargs="+", default=[""],
                        help="DDPStrategy arguments of the ddp cell, one cell per value, e.g. "
                             "gradient_as_bucket_view=1,bucket_cap_mb=100 (default: Lightning's defaults)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per cell (default 600)")
    parser.add_argument("--cpu", action="store_true", help="a smoke run on the CPU (gloo, fp32)")
    opts = parser.parse_args()
    os.environ.update(MULTICAST_OFF)
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    b, t, n = opts.batch, opts.context, opts.steps
    cells = []
    if "1gpu" in opts.cells:
        cells.append(run_cell(opts, "1gpu", "auto", 1, b, t, n))
    if "ddp" in opts.cells:
        for i, ddp in enumerate(opts.ddp):
            cells.append(run_cell(opts, "ddp" if i == 0 else f"ddp_{i}", "ddp", 2, b, t, n, ddp=ddp))
    if "fsdp" in opts.cells:
        cells.append(run_cell(opts, "fsdp", "fsdp", 2, b, t, n))
    if "long" in opts.cells:
        for context in opts.long_contexts:
            long = run_cell(opts, f"fsdp_ac_{context}", "fsdp", 2, 1, context, opts.long_steps, ac=True)
            cells.append(long)
            if "step_s" in long:
                break
    by_name = {c["cell"]: c for c in cells}

    base = by_name.get("1gpu", {}).get("tokens_per_s_per_gpu")
    print("\n| cell | GPUs | batch/GPU | context | step s | tokens/s/GPU | scaling | peak GiB | planned GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in cells:
        if "step_s" not in c:
            print(f"| {c['cell']} | {c['devices']} | {c['batch']} | {c['context']} | "
                  f"{c.get('oom') and 'OOM' or c.get('error')} | | | | {c['planned_gib']:.1f} |")
            continue
        tps = c["tokens_per_s_per_gpu"]
        scaling = f"{tps / base:.3f}" if base and c["devices"] > 1 and c["context"] == t and not c["ac"] else ""
        print(f"| {c['cell']}{' (' + c['ddp'] + ')' if c.get('ddp') else ''} | {c['devices']} | {c['batch']} | "
              f"{c['context']} | {c['step_s']:.3f} | {tps:,.0f} | "
              f"{scaling} | {c['peak_gib']:.1f} | {c['planned_gib']:.1f} |")
    ddp, fsdp = by_name.get("ddp", {}).get("losses"), by_name.get("fsdp", {}).get("losses")
    if ddp and fsdp:
        diff = max(abs(a - b) for a, b in zip(ddp, fsdp, strict=True))
        print("\n| step | ddp loss | fsdp loss |\n| --- | --- | --- |")
        for i, (a, b) in enumerate(zip(ddp, fsdp, strict=True)):
            print(f"| {i} | {a:.4f} | {b:.4f} |")
        print(f"\nlargest |ddp - fsdp| over {len(ddp)} steps: {diff:.4f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        p = argparse.ArgumentParser()
        p.add_argument("worker")
        p.add_argument("--name", required=True)
        p.add_argument("--json", required=True)
        p.add_argument("--strategy", choices=("auto", "ddp", "fsdp"), required=True)
        p.add_argument("--devices", type=int, required=True)
        p.add_argument("--batch", type=int, required=True)
        p.add_argument("--context", type=int, required=True)
        p.add_argument("--steps", type=int, required=True)
        p.add_argument("--ac", action="store_true")
        p.add_argument("--size", default="2.7B")
        p.add_argument("--ddp", default="")
        p.add_argument("--cpu", action="store_true")
        worker(p.parse_args())
    else:
        main()
