"""Convergence of bf16 and float8 training, with AdamW's fp32 state and with the compact state: four `fit` runs of
the `small` model (128,625,408 parameters) on real text, same seed and data, compared on their final validation loss.

    python benchmarks/scripts/float8_convergence.py --out DIR [--steps 2000] [--val-every 100] [--runs NAME ...]
        [--val-batches 25] [--max-bytes 32000000] [--extra "--model.lr 6e-4"] [--run-timeout 240]
        [--compile-cache DIR/compile_cache] [--gpus 0,1,2,3] [--cpu-smoke]

The four runs (``RUNS``), each a ``python -m lmtrain fit`` subprocess of ``configs/small_bf16_fast.yaml`` (compiled,
the whole step one CUDA graph, bf16-mixed) with the options that tell them apart given explicitly:

- ``bf16_fp32_state``: ``--model.master_weights false --model.optimizer_state_dtype float32``: fp32 weights under
  bf16 autocast, AdamW's own fp32 state (the reference: the other three are compared with it);
- ``bf16_compact``: ``--model.master_weights true --model.optimizer_state_dtype bfloat16``: the compact state the
  ``_fast`` configs ship (bf16 weights, fp32 masters stored split, bf16 moments rounded stochastically);
- ``float8``: the first with ``--model.float8 tensorwise --model.float8_min_features 768``;
- ``float8_compact``: the second with the same float8 options.

Float8 size rule: lmtrain's default ``model.float8_min_features`` (2048) converts no layer of ``small`` (d_model 768,
d_ff 3072), so the float8 runs set it to 768, which converts every block linear layer (the fused q/k/v projection,
the output projection and the three SwiGLU layers of each of the 12 blocks: 60 layers, all widths multiples of 16);
the embedding and the output head stay bf16.

Data: ``data.source: text`` on ``python-stdlib`` (the ``*.py`` files under the running Python's standard-library
folder, site-packages included where it lies there; one token per byte), the first ``--max-bytes`` bytes (32 MB) in
sorted file order: the first 90 % train, the next 10 % validation (about 4 s to read). The vocabulary stays
small's 10,000 (ids 256 and up never occur), so the model has the shipped config's shapes and parameter count.
``seed_everything: 0`` gives every run the same initial weights and the same training windows in the
same order (one epoch of ``--steps`` seeded random windows); validation reads the same fixed ``--val-batches``
windows of the held-out part every ``--val-every`` steps, the last one after the last step. Batch 4 x context 512,
lr 3e-4 with a cosine decay over the run, as the config ships them (``--extra`` changes any of them for every run).

Output in ``--out``, rewritten after each run so that a run cut off keeps what finished:

- ``tensorboard/<run>/``: each run's event files (``tensorboard --logdir DIR/tensorboard`` shows all four curves in
  one view: ``train/loss``, ``val/loss``, and CudaSyncTimer's ``time/step_ms``);
- ``<run>.log``: the run's output; ``shared.yaml``: the options all runs share (after the config);
- ``results.json``: per run its command, exit status, wall time, final validation loss, median step time, and the
  curves; runs of an earlier call into the same folder that this call does not repeat are kept, so the runs can be
  split over calls (``--runs bf16_fp32_state bf16_compact``, then ``--runs float8 float8_compact``);
- ``curves.png``: train and validation loss of every run, drawn from the event files (not a TensorBoard screenshot);
- ``table.md``, also printed: run, final val loss, ratio to ``bf16_fp32_state``, within 1 % (yes/no), median step
  time (CudaSyncTimer's ``time/step_ms`` after its warm-up), wall time.

Exit status 0 when every requested run finished and each one's final validation loss is within 1 % of the
reference's; 1 otherwise; 2 for bad options.

Time on one H100 (an estimate from earlier records, not a measurement of this script). Steps: small_bf16_fast runs
5.75 ms a step once captured (benchmarks/2026-11-23-H100-speed-compact-state.md), 7.0 ms without master weights
(2026-11-23-H100-speed-small.md); float8 at width 768 runs its linears at 0.58-0.60x bf16's speed
(2026-11-27-H100-float8-linear-sizes.md), so allow 10-12 ms. 2,000 steps: 12-24 s a run; validation, 20 passes of
25 forward batches, a few seconds. Start-up: a fit of small_bf16_fast that compiles from an empty cache took 59.8 s
of wall time for 6 steps, and 27.9 s with the cache filled (2026-11-27-H100-compile-cache.md). The runs share one
compile cache folder (``--compile-cache``, default ``DIR/compile_cache``; it grows to hundreds of MB, so point it
outside DIR when DIR is copied somewhere), but fp32 or bf16 weights and float8 or not make graphs of their own, so
each run mostly compiles anew, and validation's forward compiles once more (no gradients). Float8's compile is
longer (not measured at small). About 90-100 s for each bf16 run and 110-150 s for each float8 run: 6.5-8.5 minutes
for the four, close to a 9-minute limit. ``--run-timeout`` (240 s) stops one run that hangs. To keep each call well
inside the limit, split the runs over two calls into the same ``--out`` and ``--compile-cache``: ``--runs
bf16_fp32_state bf16_compact`` (about 3.5 minutes), then ``--runs float8 float8_compact`` (about 5 minutes); the
second call's table has all four.

``--gpus 0,1,2,3`` runs the four side by side, one GPU each, on a machine with several GPUs: the wall time of
the slowest run instead of the sum (each process compiles on its own; the runs share the compile cache folder).

``--cpu-smoke`` checks the script end to end on a CPU: the tiny model (vocab 256, context 64, batch 2), 4 steps
validated every 2, no compile, no CUDA graphs, 200 kB of text. lmtrain refuses float8 on a CPU (exit 2 with one
line), so the two float8 runs are recorded as ``refused`` with that line and left out of the exit status (on a GPU a
refused run fails it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/small_bf16_fast.yaml"
REFERENCE = "bf16_fp32_state"
#: Relative distance of a final validation loss from the reference's that still passes (the issue's 1 %).
TOLERANCE = 0.01
#: The float8 size rule for small: 768 converts every block linear (lmtrain's default, 2048, converts none).
FLOAT8_MIN_FEATURES = 768
_FLOAT8 = ["--model.float8", "tensorwise", "--model.float8_min_features", str(FLOAT8_MIN_FEATURES)]
_FP32_STATE = ["--model.master_weights", "false", "--model.optimizer_state_dtype", "float32"]
_COMPACT = ["--model.master_weights", "true", "--model.optimizer_state_dtype", "bfloat16"]
#: Run name -> the options that make it (after the config and shared.yaml); the first is the reference.
RUNS: dict[str, list[str]] = {
    REFERENCE: [*_FP32_STATE, "--model.float8", "none"],
    "bf16_compact": [*_COMPACT, "--model.float8", "none"],
    "float8": [*_FP32_STATE, *_FLOAT8],
    "float8_compact": [*_COMPACT, *_FLOAT8],
}
FIRST_STEP = re.compile(r"^first step: ([\d.]+) s \(compile cache: (.*)\)$", re.MULTILINE)
#: Exit status of ``python -m lmtrain`` when it refuses a configuration (LmtrainError).
REFUSED = 2


def shared_options(steps: int, val_every: int, val_batches: int, max_bytes: int, cpu_smoke: bool) -> dict:
    """The options every run shares, as the YAML overlay ``shared.yaml`` (given after the config).

    Args:
        steps: optimizer steps (one epoch of that many seeded training windows).
        val_every: validate every this many steps.
        val_batches: batches of fixed held-out windows per validation.
        max_bytes: bytes of standard-library source read (90 % train, 10 % validation).
        cpu_smoke: shrink to the tiny model on a CPU (no compile, no CUDA graphs).

    Returns:
        The overlay as a nested dict (``model``, ``data``, ``trainer``).
    """
    model: dict = {"float8_head": False}
    if cpu_smoke:
        model.update(size="tiny", vocab_size=256, context_length=64, compile=False, cuda_graphs=False,
                     fused_adamw=False)
    data = {"source": "text", "path": "python-stdlib", "max_bytes": max_bytes, "val_fraction": 0.1,
            "test_fraction": 0.0, "train_batches": steps, "val_batches": val_batches, "num_workers": 0}
    if cpu_smoke:
        data["batch_size"] = 2
    log_every = 10 if steps >= 100 else 1
    # The timer's warm-up keeps the compiling and capturing steps (CUDA graphs capture at step 4) out of its median.
    timer = {"class_path": "lmtrain.callbacks.CudaSyncTimer",
             "init_args": {"warmup_steps": 1 if cpu_smoke else 5, "sync": "events", "log_every_n_steps": log_every,
                           "print_summary": True}}
    trainer = {"max_steps": steps, "precision": "bf16-mixed", "val_check_interval": val_every,
               "limit_val_batches": 1.0, "num_sanity_val_steps": 0, "log_every_n_steps": log_every,
               "enable_checkpointing": False, "enable_progress_bar": False, "callbacks": [timer]}
    if cpu_smoke:
        trainer["accelerator"] = "cpu"  # a CPU even where a GPU is present, so that float8 is refused everywhere
    return {"seed_everything": 0, "model": model, "data": data, "trainer": trainer}


def run_command(name: str, out: Path, cache: Path, extra: list[str]) -> list[str]:
    """The ``python -m lmtrain fit`` command of run ``name``, logging to ``out/tensorboard/<name>`` and sharing the
    compile cache folder ``cache`` with the other runs."""
    return [sys.executable, "-m", "lmtrain", "fit", "--config", CONFIG, "--config", str(out / "shared.yaml"),
            *RUNS[name], "--compile_cache", str(cache),
            "--trainer.logger.init_args.save_dir", str(out), "--trainer.logger.init_args.name", "tensorboard",
            "--trainer.logger.init_args.version", name, *extra]


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars (tag -> [(step, value)]) of a run's event files, read as ``tb_figures.py`` reads them."""
    spec = importlib.util.spec_from_file_location("tb_figures", Path(__file__).with_name("tb_figures.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.read(log_dir)[0]


def summarise(name: str, command: list[str], status: int, wall_s: float, output: str, log_dir: Path) -> dict:
    """One run's result: status, wall time, final validation loss, median step time and the loss curves."""
    row: dict = {"run": name, "command": shlex.join(command), "status": status, "wall_s": round(wall_s, 1)}
    if status == REFUSED:
        lines = [line for line in output.splitlines() if line.strip()]
        row["refused"] = lines[-1] if lines else ""
    match = FIRST_STEP.search(output)
    if match:
        row["first_step_s"], row["compile_cache"] = float(match.group(1)), match.group(2)
    scalars = read_scalars(log_dir) if log_dir.is_dir() else {}
    row["train_loss"] = scalars.get("train/loss", [])
    row["val_loss"] = scalars.get("val/loss", [])
    if row["val_loss"]:
        row["final_step"], row["final_val_loss"] = row["val_loss"][-1]
    steps_ms = [value for _, value in scalars.get("time/step_ms", [])]
    if steps_ms:
        row["step_ms_median"] = statistics.median(steps_ms)
    return row


def within(loss: float, reference: float, tolerance: float = TOLERANCE) -> bool:
    """Whether ``loss`` lies within ``tolerance`` (relative) of ``reference``, on either side."""
    return abs(loss / reference - 1.0) <= tolerance


def table(rows: dict[str, dict]) -> str:
    """The Markdown table of the runs in ``rows`` (run name -> result), in ``RUNS`` order then any others."""
    ref = rows.get(REFERENCE, {}).get("final_val_loss")
    lines = ["| run | final val loss | ratio to " + REFERENCE + " | within 1% | step time median (ms) | wall (s) | "
             "status |", "|---|---|---|---|---|---|---|"]
    for name in [*[n for n in RUNS if n in rows], *[n for n in rows if n not in RUNS]]:
        row = rows[name]
        loss = row.get("final_val_loss")
        ratio = f"{loss / ref:.4f}" if loss is not None and ref else ""
        verdict = ("yes" if within(loss, ref) else "no") if loss is not None and ref else ""
        median = f"{row['step_ms_median']:.2f}" if row.get("step_ms_median") is not None else ""
        status = ("refused: " + row["refused"]) if "refused" in row else (
            "ok" if row.get("status") == 0 else f"exit {row.get('status')}")
        shown = f"{loss:.4f}" if loss is not None else ""
        lines.append(f"| {name} | {shown} | {ratio} | {verdict} | {median} | {row.get('wall_s', '')} | {status} |")
    return "\n".join(lines)


def draw(rows: dict[str, dict], path: Path, title: str) -> None:
    """One PNG: train loss (left) and validation loss (right) of every run against the step, under ``title``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, key, title in ((axes[0], "train_loss", "train/loss"), (axes[1], "val_loss", "val/loss")):
        for name, row in rows.items():
            points = row.get(key) or []
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, linewidth=1.1,
                        label=name)
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title}\n(drawn from the TensorBoard event files)", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write(rows: dict[str, dict], out: Path, settings: dict) -> str:
    """Writes ``results.json``, ``table.md`` and ``curves.png`` for the runs so far; returns the table."""
    text = table(rows)
    (out / "results.json").write_text(json.dumps({"settings": settings, "runs": rows}, indent=1) + "\n")
    (out / "table.md").write_text(text + "\n")
    draw(rows, out / "curves.png", settings["title"])
    return text


def passed(rows: dict[str, dict], names: list[str], allow_refused: bool = False) -> bool:
    """Every run of ``names`` finished and is within 1 % of the reference's final validation loss; with
    ``allow_refused`` (the CPU smoke, where lmtrain refuses float8) refused runs are left out of the verdict."""
    ref = rows.get(REFERENCE, {}).get("final_val_loss")
    ran = [rows[n] for n in names if not (allow_refused and "refused" in rows[n])]
    return ref is not None and all(
        r.get("status") == 0 and r.get("final_val_loss") is not None and within(r["final_val_loss"], ref)
        for r in ran)


def launch(command: list[str], gpu: str | None) -> tuple[subprocess.Popen, float]:
    """Starts one run (output captured), shown only GPU ``gpu`` when given; returns it and its start time."""
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                               env=env)
    return process, time.perf_counter()


def finish(started: tuple[subprocess.Popen, float], timeout: float) -> tuple[int, str, float]:
    """Waits for a run launched by :func:`launch`, stopping it ``timeout`` seconds after its start; returns its exit
    status (-1 when stopped), output and wall time."""
    process, start = started
    try:
        output, _ = process.communicate(timeout=max(1.0, timeout - (time.perf_counter() - start)))
        status = process.returncode
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        status, output = -1, (output or "") + f"\nstopped after {timeout} s"
    return status, output, time.perf_counter() - start


def record(rows: dict[str, dict], name: str, command: list[str], status: int, output: str, wall: float,
           out: Path) -> None:
    """Keeps a finished run's log and summary (``rows[name]``) and prints its line."""
    (out / f"{name}.log").write_text(output)
    rows[name] = summarise(name, command, status, wall, output, out / "tensorboard" / name)
    row = rows[name]
    print(f"{name}: exit {status}, wall {wall:.1f} s, final val loss {row.get('final_val_loss')}, "
          f"median step {row.get('step_ms_median')} ms" + (f" ({row['refused']})" if "refused" in row else ""),
          flush=True)
    if status not in (0, REFUSED):
        print(output[-3000:], file=sys.stderr)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results folder (created)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (2000; cpu smoke 4)")
    parser.add_argument("--val-every", type=int, default=None,
                        help="validate every N steps; must divide --steps (100; cpu smoke 2)")
    parser.add_argument("--val-batches", type=int, default=None, help="batches per validation (25; cpu smoke 1)")
    parser.add_argument("--max-bytes", type=int, default=None,
                        help="bytes of standard-library source read (32,000,000; cpu smoke 200,000)")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="a subset of the runs")
    parser.add_argument("--extra", default="", help="options added to every run's command, as one quoted string")
    parser.add_argument("--run-timeout", type=int, default=240, help="seconds before one run is stopped")
    parser.add_argument("--compile-cache", type=Path, default=None,
                        help="compile cache folder the runs share (default DIR/compile_cache)")
    parser.add_argument("--gpus", type=lambda v: [g for g in v.split(",") if g], default=None,
                        help="comma-separated GPU indices: run the runs side by side, one process per run, each shown "
                             "one of these GPUs in turn (CUDA_VISIBLE_DEVICES); by default they run one after another "
                             "on whatever the process sees. Step times of runs sharing a GPU are not comparable")
    parser.add_argument("--cpu-smoke", action="store_true", help="the tiny model, a few steps, on a CPU")
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    steps = args.steps or (4 if smoke else 2000)
    val_every = args.val_every or (2 if smoke else 100)
    val_batches = args.val_batches or (1 if smoke else 25)
    max_bytes = args.max_bytes or (200_000 if smoke else 32_000_000)
    if steps < 1 or val_every < 1 or steps % val_every:
        parser.error(f"--val-every {val_every} must be a positive divisor of --steps {steps}, so that the last "
                     "validation comes after the last step")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    shared = shared_options(steps, val_every, val_batches, max_bytes, smoke)
    # JSON is YAML: jsonargparse reads it as a config file.
    (out / "shared.yaml").write_text(json.dumps(shared, indent=1) + "\n")
    settings = {"config": CONFIG, "shared": shared, "runs": {n: RUNS[n] for n in args.runs}, "extra": args.extra,
                "float8_min_features": FLOAT8_MIN_FEATURES, "tolerance": TOLERANCE,
                "title": (f"{'tiny (CPU smoke)' if smoke else 'small (128M)'}, {steps} steps on Python source: bf16 "
                          f"and float8 (min features {FLOAT8_MIN_FEATURES}), AdamW fp32 state and compact state")}
    previous = out / "results.json"
    rows: dict[str, dict] = {}
    if previous.is_file():
        rows = {n: r for n, r in json.loads(previous.read_text())["runs"].items() if n not in args.runs}
    extra = shlex.split(args.extra)
    print(f"float8 runs set --model.float8_min_features {FLOAT8_MIN_FEATURES}: every block linear layer of small "
          "(768 and 3072 wide) is converted; the default 2048 would convert none.", flush=True)
    began = time.perf_counter()
    commands = {}
    for name in args.runs:
        shutil.rmtree(out / "tensorboard" / name, ignore_errors=True)  # a repeated run must not mix its events
        commands[name] = run_command(name, out, args.compile_cache or out / "compile_cache", extra)
        print(f"{name}: {shlex.join(commands[name])}", flush=True)
    if args.gpus:
        # Side by side, one process per run, each shown only its GPU (round robin when runs outnumber GPUs).
        pending = {name: launch(commands[name], args.gpus[i % len(args.gpus)]) for i, name in enumerate(args.runs)}
        print(f"running {len(pending)} run(s) side by side on GPU(s) {','.join(args.gpus)}", flush=True)
        for name, process in pending.items():
            status, output, wall = finish(process, args.run_timeout)
            record(rows, name, commands[name], status, output, wall, out)
            write(rows, out, settings)
    else:
        for name in args.runs:
            status, output, wall = finish(launch(commands[name], None), args.run_timeout)
            record(rows, name, commands[name], status, output, wall, out)
            write(rows, out, settings)
    print("\n" + write(rows, out, settings))
    print(f"\nresults: {out / 'results.json'}, curves: {out / 'curves.png'}, "
          f"TensorBoard: tensorboard --logdir {out / 'tensorboard'}")
    print(f"total wall time {time.perf_counter() - began:.0f} s")
    return 0 if passed(rows, args.runs, allow_refused=smoke) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
