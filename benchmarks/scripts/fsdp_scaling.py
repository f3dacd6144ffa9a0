"""Scaling of the shipped distributed configs on the GPUs of one node, next to a torchtitan-style baseline, in one run.

Run from the repository root on a machine with 2 (or 4) CUDA GPUs (planned: about 7 minutes, most of it building and
compiling the 2.7B and xl models once per cell; each cell stops after ``--cell-timeout`` seconds and the whole
after ``--budget``, 150 and 530 by default, so that it ends within 9 minutes):

    python benchmarks/scripts/fsdp_scaling.py [--out DIR] [--cells fsdp1 fsdp2 baseline2 ddp1 ddp2]
        [--warmup 5] [--steps 15] [--context 1024] [--ddp-context 1024] [-- EXTRA lmtrain fit ARGUMENTS]

Cells (compiled, bf16-mixed, synthetic tokens, batch 4 per GPU):

    fsdpN       python -m lmtrain fit --config configs/2.7B_bf16_fsdp.yaml on N GPUs (FSDP2; lmtrain's recipe:
                every block kept gathered until its backward, explicit prefetch, fp32 master shards with bf16
                moments, blocks compiled without fullgraph)
    fsdp_sameN  the same config with the baseline's recipe (--model.fsdp_reshard_after_forward blocks,
                --model.fsdp_prefetch false, --model.master_weights false (fp32 AdamW state, fused),
                --model.compile_fullgraph true); not run by default (the budget fits five 2.7B/xl cells)
    baselineN   benchmarks/scripts/fsdp_baseline.py under torchrun on N GPUs (baseline1 is not run by default)
    ddpN        python -m lmtrain fit --config configs/xl_bf16_ddp.yaml on N GPUs (DDP)
    ddp_sidestreamN
                ddpN with Lightning's own DDPStrategy (lmtrain's DDP arguments), which wraps the model under a
                side stream: what lmtrain's same-stream strategy changes, in the same run; scaling over ddp1
    fast1       python -m lmtrain fit --config configs/2.7B_bf16_fast.yaml on one GPU at the FSDP2 cells' context
                and batch (the single-GPU fast recipe: one CUDA graph per step, master weights, compact state):
                the table's "over fast1" column sets every FSDP2 cell's tokens/s per GPU against it
    fsdp_lsyncN, ddp_lsyncN
                fsdpN, ddpN with Lightning's per-step SIGTERM broadcast put back (lightning_sigterm_check.py):
                what lmtrain's skipping it buys, in the same run; their scaling is over fsdp1, ddp1

The default cells are ``fsdp1 fsdp2 baseline2 ddp1 ddp2``; to split lmtrain's speed into framework overhead and
recipe gains, run ``--cells fsdp2 fsdp_same2 baseline2``. What is left between fsdp_same and the baseline: lmtrain's
AdamW decays the matrices only (the baseline every parameter), its learning rate warms up (the baseline's is
constant), its loss is computed inside the compiled model code (the baseline compiles it apart), and Lightning runs
the loop.

Every cell runs ``--warmup`` untimed steps then ``--steps`` timed ones: lmtrain's cells fit ``warmup + steps``
steps and time them with ``CudaSyncTimer`` (CUDA events; its first ``warmup`` steps left out) through
:class:`StepTimesToJson`, a subclass that also writes its summary to a JSON file; the baseline gets the same
``--warmup`` and ``--steps`` and times its steps with CUDA events. Step time is the median. tokens/s per GPU =
batch x context / step time; scaling = an N-GPU cell's tokens/s per GPU over the 1-GPU cell's of the same kind;
"over baseline" = an lmtrain FSDP2 cell's tokens/s per GPU over the baseline's at the same GPU count (for fsdp it
mixes framework and recipe, for fsdp_same it is the framework alone); "recipe gain" = fsdp over fsdp_same. NVLink
multicast stays off in every process (``NCCL_NVLS_ENABLE=0`` and its companions are set in the environment every
cell inherits).

Each cell runs in a session of its own, its stdout and stderr in ``CELL.stdout.log`` and ``CELL.stderr.log``. A
cell past its time is stopped with every process it started (:func:`stop_tree`: SIGTERM to each process group of
the cell's process tree, torchrun's workers included, which torchrun starts in sessions of their own, then SIGKILL
to what is left). A cell that fails, runs out of time or prints no step time becomes a row with its reason;
``results.json`` and ``table.md`` are written again after every cell. A cell stopped (for time, or because the
script itself was sent SIGTERM, by ``timeout`` say) after its fit had written its step time keeps it, with a
``note``; on SIGTERM the script stops the cell running, writes the results so far and exits 143.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parents[1]
sys.path.insert(0, str(ROOT))  # the repository's lmtrain, installed or not (the cells run with it first too)

from lmtrain.callbacks import CudaSyncTimer  # noqa: E402

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
KINDS = ("fsdp", "fsdp_same", "baseline", "ddp", "fsdp_lsync", "ddp_lsync", "fast", "ddp_sidestream")
DEFAULT_CELLS = ("fsdp1", "fsdp2", "baseline2", "ddp1", "ddp2")
BATCH = 4
#: The baseline's recipe (benchmarks/scripts/fsdp_baseline.py) in lmtrain's options, on top of the FSDP2 config.
BASELINE_RECIPE = ["--model.fsdp_reshard_after_forward", "blocks", "--model.fsdp_prefetch", "false",
                   "--model.master_weights", "false", "--model.optimizer_state_dtype", "float32",
                   "--model.compile_fullgraph", "true"]
#: Which recipe each kind of cell runs (the table's "recipe" column).
RECIPES = {"fsdp": "lmtrain config", "fsdp_same": "baseline's", "baseline": "baseline", "ddp": "lmtrain config",
           "fsdp_lsync": "lmtrain config + Lightning's SIGTERM sync",
           "ddp_lsync": "lmtrain config + Lightning's SIGTERM sync", "fast": "2.7B fast config (1 GPU)",
           "ddp_sidestream": "lmtrain config, Lightning's DDPStrategy"}
#: Lightning's own DDPStrategy with lmtrain's DDP arguments (the ddp_sidestream cells).
LIGHTNING_DDP = ["--trainer.strategy", "lightning.pytorch.strategies.DDPStrategy",
                 "--trainer.strategy.gradient_as_bucket_view", "true", "--trainer.strategy.bucket_cap_mb", "100",
                 "--trainer.strategy.static_graph", "true"]
#: Lightning's per-step SIGTERM broadcast, which lmtrain skips, put back (the *_lsync cells).
LIGHTNING_SYNC = ["--trainer.callbacks+=lightning_sigterm_check.LightningSigtermCheck"]
#: Variants of lmtrain's cells: kind -> (the kind whose config and 1-GPU cell they share, the arguments they add).
VARIANTS = {"fsdp_lsync": ("fsdp", LIGHTNING_SYNC), "ddp_lsync": ("ddp", LIGHTNING_SYNC),
            "ddp_sidestream": ("ddp", LIGHTNING_DDP)}
#: Seconds a stopped cell's processes get between SIGTERM and SIGKILL (torchrun passes SIGTERM on to its workers).
STOP_GRACE_S = 5.0


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


def cell_kind(cell: str) -> str:
    """The kind of a cell name (``fsdp_same2`` -> ``fsdp_same``)."""
    return cell.rstrip("0123456789")


def base_kind(kind: str) -> str:
    """The kind a variant (:data:`VARIANTS`) is measured against (``fsdp_lsync`` -> ``fsdp``); other kinds as they
    are."""
    return VARIANTS.get(kind, (kind, []))[0]


def cell_name(text: str) -> str:
    """Check a ``--cells`` entry: one of :data:`KINDS` followed by a GPU count of at least 1."""
    if cell_kind(text) not in KINDS or cell_kind(text) == text or cell_devices(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a cell is fsdpN, fsdp_sameN, baselineN, ddpN, fsdp_lsyncN, "
                                         "ddp_lsyncN, ddp_sidestreamN (N GPUs, at least 1) or fast1")
    if cell_kind(text) == "fast" and cell_devices(text) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the fast recipe is a one-GPU cell: fast1")
    return text


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: use a whole number of at least 1")
    return int(text)


@dataclass(frozen=True)
class Cell:
    """One timed run: its command and how to read its step time.

    Attributes:
        name: the cell (``fsdp2``); its files are ``NAME.stdout.log``, ``NAME.stderr.log`` (and ``NAME.json``).
        cmd: the command, run from the repository root in a session of its own.
        devices: GPUs it runs on.
        context: tokens per sequence (tokens/s per GPU = BATCH x context / step time).
        read_step_ms: (the cell's stdout, its output folder) -> median step ms; raises ``ValueError`` with the
            reason when the run left no step time.
    """

    name: str
    cmd: list[str]
    devices: int
    context: int
    read_step_ms: Callable[[str, Path], float]


def lmtrain_cell(config: str, devices: int, context: int, warmup: int, steps: int, out: Path,
                 extra: list[str]) -> list[str]:
    """The command of one lmtrain cell: ``warmup + steps`` steps, the last ``steps`` timed into ``out`` (FSDP2
    configs also get their data-parallel size)."""
    args = [sys.executable, "-m", "lmtrain", "fit", "--config", config, "--model.context_length", str(context),
            "--data.batch_size", str(BATCH), "--trainer.devices", str(devices),
            "--trainer.max_steps", str(warmup + steps), "--trainer.logger", "false",
            "--trainer.callbacks+=fsdp_scaling.StepTimesToJson", "--trainer.callbacks.path", str(out),
            "--trainer.callbacks.warmup_steps", str(warmup)]
    if "fsdp" in config:
        args += ["--trainer.strategy.data_parallel_size", str(devices)]
    return args + extra


def timer_step_ms(name: str) -> Callable[[str, Path], float]:
    """How an lmtrain cell's step time is read: the median of ``NAME.json``, which :class:`StepTimesToJson`
    writes."""

    def read(stdout: str, out_dir: Path) -> float:
        path = out_dir / f"{name}.json"
        if not path.is_file():
            raise ValueError(f"{path.name} was not written (the fit did not reach its end)")
        summary = json.loads(path.read_text())
        if "median" not in summary.get("step_ms", {}):
            raise ValueError(f"{path.name} has no timed step (every step was a warm-up step): {summary}")
        return float(summary["step_ms"]["median"])

    return read


def printed_step_ms(stdout: str, out_dir: Path) -> float:
    """How the baseline's step time is read: ``step_ms`` of the last JSON line of its stdout."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                return float(json.loads(line)["step_ms"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"its last JSON line has no step_ms ({type(exc).__name__}: {exc}): "
                                 f"{line[:300]}") from None
    raise ValueError("it printed no JSON line")


def plan(cell: str, args: argparse.Namespace, out_dir: Path) -> Cell:
    """The :class:`Cell` of a ``--cells`` entry."""
    devices, kind = cell_devices(cell), cell_kind(cell)
    if kind == "baseline":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(devices),
               str(SCRIPTS / "fsdp_baseline.py"), "--context", str(args.context), "--batch", str(BATCH),
               "--warmup", str(args.warmup), "--steps", str(args.steps)]
        return Cell(cell, cmd, devices, args.context, printed_step_ms)
    out = out_dir / f"{cell}.json"
    if kind == "fast":
        cmd = lmtrain_cell("configs/2.7B_bf16_fast.yaml", 1, args.context, args.warmup, args.steps, out, args.extra)
        return Cell(cell, cmd, 1, args.context, timer_step_ms(cell))
    base, added = VARIANTS.get(kind, (kind, []))
    if base == "ddp":
        cmd = lmtrain_cell("configs/xl_bf16_ddp.yaml", devices, args.ddp_context, args.warmup, args.steps, out,
                           added + args.extra)
        return Cell(cell, cmd, devices, args.ddp_context, timer_step_ms(cell))
    recipe = BASELINE_RECIPE if kind == "fsdp_same" else []
    cmd = lmtrain_cell("configs/2.7B_bf16_fsdp.yaml", devices, args.context, args.warmup, args.steps, out,
                       recipe + added + args.extra)
    return Cell(cell, cmd, devices, args.context, timer_step_ms(cell))


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, their children, ...), read from ``/proc``: torchrun's workers are
    among them even though they run in sessions of their own."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended while we looked
            continue
        parent = int(stat[stat.rindex(")") + 2:].split()[1])  # the name, in parentheses, may hold spaces
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _signal_groups(pids: list[int], sig: int, groups: set[int]) -> None:
    """Send ``sig`` to ``groups`` and to the process group of each of ``pids`` (never to this process's own)."""
    groups = set(groups)
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            continue
    for group in groups - {os.getpgrp()}:
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            continue


def stop_tree(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """Stop ``proc`` (started with ``start_new_session=True``, so its process group is its pid) and every process
    it started: SIGTERM to its group and to the group of each process of its tree (torchrun passes SIGTERM on to
    its workers, in sessions of their own, and waits for them), up to ``grace_s`` seconds for ``proc`` to end, then
    SIGKILL to the groups of whatever is left, found again (a worker whose parent died is no longer below
    ``proc``: the first look's pids are kept). Not found: a process that left both the tree and the group before
    the first look (a daemon of a daemon)."""
    tree = [*descendants(proc.pid)] + ([proc.pid] if proc.returncode is None else [])
    _signal_groups(tree, signal.SIGTERM, {proc.pid})
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    survivors = [pid for pid in dict.fromkeys(tree + descendants(proc.pid)) if Path(f"/proc/{pid}").exists()]
    _signal_groups(survivors, signal.SIGKILL, {proc.pid})
    proc.wait()


class Stopped(Exception):
    """This script was sent SIGTERM (:func:`main` installs the handler): the cell running is stopped, and its row
    and the results so far are written before the script exits."""


def _stop_on_sigterm(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: stopping the cell and writing the results go on
    raise Stopped


def run(cell: Cell, out_dir: Path, env: dict[str, str], timeout: float, grace_s: float = STOP_GRACE_S) -> dict:
    """Run one cell within ``timeout`` seconds: its step time, tokens/s per GPU and GPU count, or ``error`` (why
    it has none: the tail of its stderr, its time running out, no step time printed or written).

    A cell stopped for time (or by :class:`Stopped`) after its fit had written its step time keeps that step time,
    with a ``note`` that it was stopped: the timed steps were over (a multi-rank fit can take a while to end).
    :class:`Stopped` is raised again once the cell's processes are stopped, with the row as its argument."""
    print(f"[{cell.name}] {' '.join(cell.cmd)}", flush=True)
    stdout_path, stderr_path = out_dir / f"{cell.name}.stdout.log", out_dir / f"{cell.name}.stderr.log"
    (out_dir / f"{cell.name}.json").unlink(missing_ok=True)  # a step time left by an earlier run is not this one's
    started = time.perf_counter()
    stopped = False
    with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(cell.cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                                stderr=stderr, start_new_session=True)
        try:
            returncode = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        except Stopped:
            returncode, stopped = None, True
        finally:
            stop_tree(proc, grace_s)  # also after a normal end: a rank or compile worker may still be there
    wall = round(time.perf_counter() - started, 1)
    row = {"cell": cell.name, "devices": cell.devices, "wall_s": wall}
    err_tail = stderr_path.read_text(errors="replace")[-1500:]
    why = (f"after {wall:.0f} s: the script was sent SIGTERM" if stopped
           else f"after {timeout:.0f} s (--cell-timeout, --budget)")
    try:
        step_ms = cell.read_step_ms(stdout_path.read_text(errors="replace"), out_dir)
    except ValueError as exc:
        step_ms, no_step = None, exc
    if returncode is None and step_ms is None:
        row |= {"error": f"stopped {why}; stderr ends: {err_tail}"}
    elif returncode not in (None, 0):
        row |= {"error": f"exit {returncode}; stderr ends: {err_tail}"}
    elif step_ms is None:
        row |= {"error": f"no step time: {no_step}"}
    else:  # ended, or stopped once its timed steps were written
        row |= {"step_ms": step_ms, "tokens_per_s_per_gpu": BATCH * cell.context / (step_ms / 1000)}
        if returncode is None:
            row["note"] = f"stopped {why}, once its timed steps were written"
    if stopped:
        raise Stopped(row)
    return row


def _ratio(numerator: dict, denominator: dict) -> str:
    if "tokens_per_s_per_gpu" not in numerator or "tokens_per_s_per_gpu" not in denominator:
        return ""
    return f"{numerator['tokens_per_s_per_gpu'] / denominator['tokens_per_s_per_gpu']:.3f}"


def table(results: dict[str, dict]) -> str:
    """The results as Markdown: recipe, step time, tokens/s per GPU, scaling over the 1-GPU cell of the same kind,
    lmtrain's FSDP2 cells over the baseline at the same GPU count, and fsdp over fsdp_same (the recipe's gain)."""
    lines = ["| cell | GPUs | recipe | step ms (median) | tokens/s per GPU | scaling over 1 GPU | over baseline "
             "| recipe gain (fsdp over fsdp_same) | over fast1 |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for cell, r in results.items():
        kind = cell_kind(cell)
        if "error" in r:
            reason = r["error"].splitlines()[0][:120].replace("|", "/")
            lines.append(f"| {cell} | {cell_devices(cell)} | {RECIPES[kind]} | failed: {reason} (see "
                         f"{cell}.stderr.log) | | | | | |")
            continue
        devices = r["devices"]
        scaling = _ratio(r, results.get(f"{base_kind(kind)}1", {})) if devices > 1 else ""
        over = _ratio(r, results.get(f"baseline{devices}", {})) if kind in ("fsdp", "fsdp_same") else ""
        gain = _ratio(r, results.get(f"fsdp_same{devices}", {})) if kind == "fsdp" else ""
        fast = _ratio(r, results.get("fast1", {})) if base_kind(kind) in ("fsdp", "fsdp_same") else ""
        lines.append(f"| {cell} | {devices} | {RECIPES[kind]} | {r['step_ms']:.1f} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} | {scaling} | {over} | {gain} | {fast} |")
    return "\n".join(lines)


def write_results(results: dict[str, dict], out_dir: Path) -> None:
    """``results.json`` and ``table.md`` of the cells so far (written after every cell, so a stopped run keeps
    them)."""
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "table.md").write_text(table(results) + "\n")


def run_cells(cells: list[Cell], out_dir: Path, env: dict[str, str], cell_timeout: float, budget: float,
              grace_s: float = STOP_GRACE_S) -> dict[str, dict]:
    """Run ``cells`` in turn, each within ``cell_timeout`` and all within ``budget`` seconds (a cell left no time
    becomes an error row); write the results after each."""
    results: dict[str, dict] = {}
    deadline = time.perf_counter() + budget
    for cell in cells:
        left = deadline - time.perf_counter()
        if left <= 0:
            results[cell.name] = {"cell": cell.name, "devices": cell.devices, "error": "not run: --budget spent"}
        else:
            try:
                results[cell.name] = run(cell, out_dir, env, min(cell_timeout, left), grace_s)
            except Stopped as stop:  # SIGTERM: the cell's row if it had started, the results so far, then stop
                if stop.args:
                    results[cell.name] = stop.args[0]
                    print(json.dumps(results[cell.name]), flush=True)
                write_results(results, out_dir)
                raise
        print(json.dumps(results[cell.name]), flush=True)
        write_results(results, out_dir)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fsdp_scaling", help="folder for each cell's JSON and logs, results.json "
                        "and table.md")
    parser.add_argument("--cells", nargs="+", type=cell_name, default=list(DEFAULT_CELLS),
                        help="fsdpN, fsdp_sameN, baselineN, ddpN: a config (or the baseline) on N GPUs")
    parser.add_argument("--warmup", type=positive_int, default=5, help="untimed steps of every cell")
    parser.add_argument("--steps", type=positive_int, default=15, help="timed steps of every cell, after the warm-up")
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
    signal.signal(signal.SIGTERM, _stop_on_sigterm)  # e.g. a `timeout` around the script: keep what was measured
    try:
        results = run_cells([plan(c, args, out_dir) for c in args.cells], out_dir, env, args.cell_timeout,
                            args.budget)
    except Stopped:
        print(f"stopped (SIGTERM); the results so far are in {out_dir / 'results.json'}", file=sys.stderr)
        print((out_dir / "table.md").read_text() if (out_dir / "table.md").is_file() else "", end="")
        sys.exit(128 + signal.SIGTERM)
    print(table(results))


if __name__ == "__main__":
    main()
