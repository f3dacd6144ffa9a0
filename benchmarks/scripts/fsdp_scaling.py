"""Scaling of the shipped distributed configs on the GPUs of one node, next to a torchtitan-style baseline, in one run.

Run from the repository root on a machine with 2 (or 4) CUDA GPUs (planned: about 7 minutes, most of it building and
compiling the 2.7B and xl models once per cell; each cell stops after ``--cell-timeout`` seconds and the whole
after ``--budget``, 150 and 530 by default, so that it ends within 9 minutes):

    python benchmarks/scripts/fsdp_scaling.py [--out DIR] [--cells fsdp1 fsdp2 baseline2 ddp1 ddp2]
        [--steps 20] [--context 1024] [--ddp-context 1024] [-- EXTRA lmtrain fit ARGUMENTS]

Cells (compiled, bf16-mixed, synthetic tokens, batch 4 per GPU):

    fsdp1       python -m lmtrain fit --config configs/2.7B_bf16_fsdp.yaml, 1 GPU (FSDP2 over one rank)
    fsdp2       the same on 2 GPUs
    baseline1   benchmarks/scripts/fsdp_baseline.py under torchrun, 1 GPU (not run by default)
    baseline2   the same on 2 GPUs
    ddp1        python -m lmtrain fit --config configs/xl_bf16_ddp.yaml, 1 GPU (DDP over one rank)
    ddp2        the same on 2 GPUs

Any GPU count works as the suffix (``fsdp4 baseline4 ddp4`` on a 4-GPU machine).

lmtrain's cells time each step with ``CudaSyncTimer`` (CUDA events; its first 5 steps are warm-up) through
:class:`StepTimesToJson`, a subclass that also writes its summary to a JSON file; the baseline times its steps with
CUDA events after 5 warm-up steps. Step time is the median. tokens/s per GPU = batch x context / step time;
scaling = a 2-GPU cell's tokens/s per GPU over the 1-GPU cell's of the same config; the last column compares
lmtrain's FSDP2 cells with the baseline at the same GPU count. NVLink multicast stays off in every process
(``NCCL_NVLS_ENABLE=0`` and its companions are set in the environment every cell inherits).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parents[1]
sys.path.insert(0, str(ROOT))  # the repository's lmtrain, installed or not (the cells run with it first too)

from lmtrain.callbacks import CudaSyncTimer  # noqa: E402

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
KINDS = ("fsdp", "baseline", "ddp")
DEFAULT_CELLS = ("fsdp1", "fsdp2", "baseline2", "ddp1", "ddp2")
BATCH = 4


class StepTimesToJson(CudaSyncTimer):
    """``CudaSyncTimer`` that also writes its summary (``summary()``: phase -> mean, median, ... in ms) to ``path``
    on rank 0 at the end of the fit.

    Args:
        path: the JSON file to write.
        warmup_steps: ``CudaSyncTimer``'s: steps left out of the summary.
    """

    def __init__(self, path: str, warmup_steps: int = 5) -> None:
        super().__init__(warmup_steps=warmup_steps, print_summary=False)
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        super().on_train_end(trainer, pl_module)
        if trainer.global_rank == 0:
            Path(self.path).write_text(json.dumps(self.summary()))


def cell_devices(cell: str) -> int:
    """The GPU count of a cell name (``fsdp4`` -> 4)."""
    return int(cell[len(cell.rstrip("0123456789")):])


def cell_name(text: str) -> str:
    """Check a ``--cells`` entry: one of :data:`KINDS` followed by a GPU count of at least 1."""
    kind = text.rstrip("0123456789")
    if kind not in KINDS or kind == text or cell_devices(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a cell is fsdpN, baselineN or ddpN (N GPUs, at least 1)")
    return text


def lmtrain_cell(config: str, devices: int, context: int, steps: int, out: Path, extra: list[str]) -> list[str]:
    """The command of one lmtrain cell (FSDP2 configs also get their data-parallel size)."""
    args = [sys.executable, "-m", "lmtrain", "fit", "--config", config, "--model.context_length", str(context),
            "--data.batch_size", str(BATCH), "--trainer.devices", str(devices), "--trainer.max_steps", str(steps),
            "--trainer.logger", "false", "--trainer.callbacks+=fsdp_scaling.StepTimesToJson",
            "--trainer.callbacks.path", str(out)]
    if "fsdp" in config:
        args += ["--trainer.strategy.data_parallel_size", str(devices)]
    return args + extra


def run(cell: str, args: argparse.Namespace, out_dir: Path, env: dict[str, str], timeout: float) -> dict:
    """Run one cell within ``timeout`` seconds; its step time, tokens/s per GPU and GPU count (or the tail of its
    output if it failed or ran out of time)."""
    devices = cell_devices(cell)
    out = out_dir / f"{cell}.json"
    if cell.startswith("baseline"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(devices),
               str(SCRIPTS / "fsdp_baseline.py"), "--context", str(args.context), "--batch", str(BATCH)]
        context = args.context
    elif cell.startswith("fsdp"):
        cmd = lmtrain_cell("configs/2.7B_bf16_fsdp.yaml", devices, args.context, args.steps, out, args.extra)
        context = args.context
    else:
        cmd = lmtrain_cell("configs/xl_bf16_ddp.yaml", devices, args.ddp_context, args.steps, out, args.extra)
        context = args.ddp_context
    print(f"[{cell}] {' '.join(cmd)}", flush=True)
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        output = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        (out_dir / f"{cell}.log").write_text(output)
        return {"cell": cell, "error": f"stopped after {timeout:.0f} s (--cell-timeout, --budget)", "wall_s": timeout}
    wall = time.perf_counter() - started
    (out_dir / f"{cell}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"cell": cell, "error": (proc.stderr or proc.stdout)[-1500:], "wall_s": wall}
    if cell.startswith("baseline"):
        line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("{"))
        step_ms = json.loads(line)["step_ms"]
    else:
        step_ms = json.loads(out.read_text())["step_ms"]["median"]
    return {"cell": cell, "devices": devices, "step_ms": step_ms,
            "tokens_per_s_per_gpu": BATCH * context / (step_ms / 1000), "wall_s": wall}


def table(results: dict[str, dict]) -> str:
    """The results as Markdown: step time, tokens/s per GPU, scaling over the 1-GPU cell, ratio to the baseline."""
    lines = ["| cell | GPUs | step ms (median) | tokens/s per GPU | scaling over 1 GPU | over baseline |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for cell, r in results.items():
        if "error" in r:
            lines.append(f"| {cell} | | failed: see {cell}.log | | | |")
            continue
        one = results.get(cell.rstrip("0123456789") + "1", {})
        scaling = (f"{r['tokens_per_s_per_gpu'] / one['tokens_per_s_per_gpu']:.3f}"
                   if r["devices"] > 1 and "tokens_per_s_per_gpu" in one else "")
        base = results.get(f"baseline{r['devices']}", {})
        over = (f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.3f}"
                if cell.startswith("fsdp") and "tokens_per_s_per_gpu" in base else "")
        lines.append(f"| {cell} | {r['devices']} | {r['step_ms']:.1f} | {r['tokens_per_s_per_gpu']:,.0f} | {scaling} "
                     f"| {over} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fsdp_scaling", help="folder for each cell's JSON and log")
    parser.add_argument("--cells", nargs="+", type=cell_name, default=list(DEFAULT_CELLS),
                        help="fsdpN, baselineN, ddpN: a config on N GPUs")
    parser.add_argument("--steps", type=int, default=20, help="steps of each lmtrain cell (5 of them warm-up)")
    parser.add_argument("--context", type=int, default=1024, help="context of the 2.7B FSDP2 and baseline cells")
    parser.add_argument("--ddp-context", type=int, default=1024, help="context of the xl DDP cells")
    parser.add_argument("--cell-timeout", type=float, default=150, help="seconds one cell may take")
    parser.add_argument("--budget", type=float, default=530, help="seconds all cells together may take")
    parser.add_argument("extra", nargs="*", help="more `lmtrain fit` arguments for lmtrain's cells (after --)")
    args = parser.parse_args()
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.update(MULTICAST_OFF)  # before any process starts: every rank inherits it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(SCRIPTS), os.environ.get("PYTHONPATH", "")])}
    results = {}
    deadline = time.perf_counter() + args.budget
    for cell in args.cells:
        left = deadline - time.perf_counter()
        if left <= 0:
            results[cell] = {"cell": cell, "error": "not run: --budget spent"}
            continue
        results[cell] = run(cell, args, out_dir, env, min(args.cell_timeout, left))
        print(json.dumps(results[cell]), flush=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
