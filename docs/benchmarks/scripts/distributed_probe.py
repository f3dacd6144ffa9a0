"""DDP and FSDP2 on one node of 2 GPUs: throughput, scaling, losses, longest context, planned vs measured peak.

Run from the repository root on a machine with 2 CUDA GPUs (one call does everything; about 10 minutes):

    python docs/benchmarks/scripts/distributed_probe.py [--out DIR]

Cells (2.7B, bf16-mixed, sdpa, synthetic data), each in its own process group started by Lightning:

    1gpu        1 GPU, context 1024, batch 4, 20 steps
    ddp         2 GPUs, ddp, context 1024, batch 4 per GPU, 20 steps
    fsdp        2 GPUs, FSDP2 (ModelParallelStrategy), context 1024, batch 4 per GPU, 20 steps
    fsdp_ac_T   2 GPUs, FSDP2 + activation checkpointing, batch 1 per GPU, context T: 32768, then 16384 and
                8192 until one fits, 4 steps

Step time: the median of the synchronised steps after the first 3. tokens/s per GPU = batch x context /
step time; scaling efficiency = a 2-GPU cell's tokens/s per GPU over the 1-GPU cell's. Peak: the largest
``torch.cuda.max_memory_allocated`` over the ranks, counted from the start of training (after the model is
built and sharded), next to ``lmtrain.memory_plan.estimate_memory_distributed``. Losses: the rank-averaged
loss of each of the 20 steps of ``ddp`` and ``fsdp`` (same data order: both read through Lightning's
distributed sampler at world size 2). Each cell writes ``DIR/<cell>.json``; the table is printed last.

NVLink multicast stays off in every process (the variables below are exported before any process starts,
and Lightning's ranks inherit them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SIZE, PRECISION, WARMUP = "2.7B", "bf16-mixed", 3


def worker(args: argparse.Namespace) -> None:
    """One cell: fit, time every step, record losses and the peak; rank 0 writes ``args.json``."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lmtrain.data import LMDataModule
    from lmtrain.module import LMModule

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.start: torch.cuda.Event | None = None

        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

        def on_train_batch_start(self, trainer, module, batch, idx) -> None:  # noqa: ANN001
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()

        def on_train_batch_end(self, trainer, module, outputs, batch, idx) -> None:  # noqa: ANN001
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            torch.cuda.synchronize()
            self.times.append(self.start.elapsed_time(end) / 1000)
            self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    strategy = {"auto": "auto", "ddp": "ddp",
                "fsdp": ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)}[args.strategy]
    pl.seed_everything(0)
    module = LMModule(size=SIZE, vocab_size=10_000, context_length=args.context, attention="sdpa",
                      activation_checkpointing=args.ac, warmup_steps=10)
    data = LMDataModule(source="synthetic", batch_size=args.batch, context_length=args.context, vocab_size=10_000,
                        train_batches=1000)
    probe = Probe()
    trainer = pl.Trainer(accelerator="gpu", devices=args.devices, strategy=strategy, precision=PRECISION,
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=[probe])
    result: dict = {"cell": args.name}
    try:
        trainer.fit(module, datamodule=data)
        peak = torch.tensor(float(torch.cuda.max_memory_allocated()), device=trainer.strategy.root_device)
        result.update(step_s=statistics.median(probe.times[WARMUP:]), losses=probe.losses,
                      peak_gib=float(trainer.strategy.reduce(peak, reduce_op="max")) / 1024**3)
    except torch.OutOfMemoryError as error:
        result.update(oom=str(error).splitlines()[0])
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and trainer.global_rank == 0:
        Path(args.json).write_text(json.dumps(result))


def planned_gib(strategy: str, devices: int, batch: int, context: int, ac: bool) -> float:
    from lmtrain.config import ModelConfig
    from lmtrain.memory_plan import GIB, estimate_memory_distributed

    cfg = ModelConfig.from_size(SIZE, vocab_size=10_000, context_length=context, activation_checkpointing=ac)
    kind = {"auto": "single", "ddp": "ddp", "fsdp": "fsdp"}[strategy]
    return estimate_memory_distributed(cfg, batch, context, PRECISION, kind, devices).peak / GIB


def run_cell(out: Path, name: str, strategy: str, devices: int, batch: int, context: int, steps: int,
             ac: bool = False) -> dict:
    path = out / f"{name}.json"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "worker", "--name", name, "--json", str(path), "--strategy", strategy,
           "--devices", str(devices), "--batch", str(batch), "--context", str(context), "--steps", str(steps)]
    if ac:
        cmd.append("--ac")
    print(f"== {name}: {' '.join(cmd[2:])}", flush=True)
    try:
        proc = subprocess.run(cmd, env=dict(os.environ, **MULTICAST_OFF), timeout=900)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    result = json.loads(path.read_text()) if path.exists() else {"cell": name, "error": f"exit {rc}"}
    result.update(strategy=strategy, devices=devices, batch=batch, context=context, ac=ac,
                  planned_gib=planned_gib(strategy, devices, batch, context, ac))
    if "step_s" in result:
        result["tokens_per_s_per_gpu"] = batch * context / result["step_s"]
    path.write_text(json.dumps(result))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="distributed_probe")
    args = parser.parse_args()
    os.environ.update(MULTICAST_OFF)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = [run_cell(out, "1gpu", "auto", 1, 4, 1024, 20),
             run_cell(out, "ddp", "ddp", 2, 4, 1024, 20),
             run_cell(out, "fsdp", "fsdp", 2, 4, 1024, 20)]
    for context in (32768, 16384, 8192):
        long = run_cell(out, f"fsdp_ac_{context}", "fsdp", 2, 1, context, 4, ac=True)
        cells.append(long)
        if "step_s" in long:
            break

    base = cells[0].get("tokens_per_s_per_gpu")
    print("\n| cell | GPUs | batch/GPU | context | step s | tokens/s/GPU | scaling | peak GiB | planned GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in cells:
        if "step_s" not in c:
            print(f"| {c['cell']} | {c['devices']} | {c['batch']} | {c['context']} | "
                  f"{c.get('oom') and 'OOM' or c.get('error')} | | | | {c['planned_gib']:.1f} |")
            continue
        tps = c["tokens_per_s_per_gpu"]
        scaling = f"{tps / base:.3f}" if base and c["devices"] > 1 and c["context"] == 1024 else ""
        print(f"| {c['cell']} | {c['devices']} | {c['batch']} | {c['context']} | {c['step_s']:.3f} | {tps:,.0f} | "
              f"{scaling} | {c['peak_gib']:.1f} | {c['planned_gib']:.1f} |")
    ddp, fsdp = cells[1].get("losses"), cells[2].get("losses")
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
        worker(p.parse_args())
    else:
        main()
