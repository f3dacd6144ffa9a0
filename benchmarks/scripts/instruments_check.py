"""The instruments' acceptance on a GPU: runs the fits, compares with HolisticTraceAnalysis, prints one table.

Usage::

    # one H100; each command is planned to stay under 9 minutes (estimates, not measured yet): small in one,
    # 2.7B in two (its compiled fast config alone compiles for about a minute, twice)
    python benchmarks/scripts/instruments_check.py run OUT --models small
    # where HTA is not installed on the GPU machine: skip it there, compare later with check
    python benchmarks/scripts/instruments_check.py run OUT --models small --skip-hta
    python benchmarks/scripts/instruments_check.py run OUT --models 2.7B --only sdpa512 flash512
    python benchmarks/scripts/instruments_check.py run OUT --models 2.7B --only flash4096 fast
    # KernelShare later in a longer fit (steps 81-83 of 120), away from the first steps' clocks
    python benchmarks/scripts/instruments_check.py run OUT --models small --only fast --steps 120 \
        --kernel-share='--trainer.callbacks.wait=80'
    # FSDP2 on two GPUs (all five callbacks, both ranks profiled)
    python benchmarks/scripts/instruments_check.py fsdp OUT --size small --devices 2 [--context 1024] \
        [--kernel-share='--trainer.callbacks.wait=80' --steps 120]
    # only read fits made already (a run's version folder, logs/lmtrain/version_N)
    python benchmarks/scripts/instruments_check.py check LOG_DIR [LOG_DIR ...]

``run`` makes, per model, four one-GPU fits (``--trainer.devices 1``, also on a machine with several) with all five
callbacks at their defaults (KernelShare with ``export_trace``):
eager sdpa at context 512, eager flash_triton at 512 and at 4096 (2.7B: batch 1 there, to fit in 80 GB) and
``configs/<model>_bf16_fast.yaml`` (compiled, CUDA graphs); and the same four with CudaSyncTimer alone (the
uninstrumented reference: its CUDA events cost no measurable time). Each fit may run for ``--fit-timeout`` seconds
(240). Right after each fit it appends that fit's figures to ``OUT/results.jsonl`` (the fit's own output in
``OUT/runs/<name>.log``, its TensorBoard files under ``OUT/runs/<name>/``), so a run cut short keeps what it
measured; after each model it appends that model's table to ``OUT/summary.md`` and prints it. ``--skip-hta`` leaves
HTA out (its columns show ``-``); ``check`` on the fits' log folders compares with HTA later. Per fit:

- ``other``: the "other" category's share of kernel time (acceptance: at most 1%);
- ``busy / step``, ``span / step``, ``wall / step``: KernelShare's kernel busy time, GPU span (first kernel to
  last) and the profiled step's wall time, each over CudaSyncTimer's median unprofiled step
  (``kernels/step_comparison``; acceptance for busy: within 3%). On a host-bound step busy / step is far below 1
  by physics (the GPU waits for the host), with wall / step showing the profiler's own slowdown;
- ``span / profiled``: the GPU span (busy + idle) over CudaSyncTimer's mean on the very steps KernelShare
  profiled (``kernels/span_to_timer_profiled``): near 1 when KernelShare's accounting covers the whole of the
  steps it profiled, whatever the profiler did to their length; ``busy / profiled``: the busy time over the same
  (``kernels/busy_to_timer_profiled``), busy against the steps it was measured in;
- ``HTA``: the largest difference, in percentage points, between lmtrain's temporal breakdown (idle, compute,
  non-compute, communication overlap) and HTA's on the same trace file (acceptance: 2 points), and the same for the
  idle split per stream (host wait, kernel wait, other); ``hta_compare.py`` prints the full tables;
- ``phases / step``: for the CUDA-graph fits, the median over replayed steps of (forward + backward + optimizer,
  from the timing events inside the graph) / step (acceptance: within 2%);
- ``overhead``: the timer's median step with all five attached / with the timer alone, minus 1 (acceptance: 1%);
- ``hooks / step``: the host time per step of the four callbacks the reference fit does not run (the sum of their
  hooks' per-step medians, measured in the instrumented fit by :mod:`hook_cost`) over the timer's step: what the
  callbacks can add to a step outside their windows, whatever the host's speed in the other process. On a
  host-bound step two processes differ by more than 1%; this figure does not depend on a second process.

``run --compare 'ARGS'`` fits each path once more with CudaSyncTimer alone and those fit arguments added (for
example ``--model.blas_workspace default``), in the same run, and prints its median step over the timer-only one's.

``run --only compiled compact inbackward checkpointing`` adds the other shipped paths (compiled without CUDA graphs,
master weights with the compact state, the optimizer in the backward pass, full activation checkpointing), each
fitted as the four are.

``fsdp`` makes one FSDP2 fit (``configs/2.7B_bf16_fsdp.yaml``, ``--size`` small, xl or 2.7B; ``--strategy ddp``:
DDP, ``configs/xl_bf16_ddp.yaml``) with all five, KernelShare
on every rank, and reports per rank the communication time, the part of it no compute overlaps, the overlap share
(lmtrain's and HTA's) and the timer's straggler ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hta_compare  # this folder (on the path when this file runs as a script)
from tb_figures import read

from lmtrain.analysis.kernels import load_trace
from lmtrain.analysis.tables import markdown_table

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def five(*kernel_share: str) -> list[str]:
    """All five callbacks at their defaults; KernelShare exports its trace (and takes ``kernel_share``'s options:
    a ``--trainer.callbacks.X`` option applies to the callback added last)."""
    return ["--trainer.callbacks+=lmtrain.callbacks.CudaSyncTimer", "--trainer.callbacks+=lmtrain.callbacks.NVTXRanges",
            "--trainer.callbacks+=lmtrain.callbacks.MemorySnapshot",
            "--trainer.callbacks+=lmtrain.callbacks.KernelShare", "--trainer.callbacks.export_trace=true",
            *kernel_share, "--trainer.callbacks+=lmtrain.callbacks.PrecisionInspector"]


TIMER_ONLY = ["--trainer.callbacks+=lmtrain.callbacks.CudaSyncTimer"]
#: Steps per fit: the timer's warm-up is steps 0..4, KernelShare's window 5..7 (6..8 on several ranks, past the step
#: that waits for MemorySnapshot's files); the medians of the timer's scalars are over steps 8.. (the timer's own
#: summary, ``kernels/timer_step_ms``, leaves the perturbed steps out itself)
STEPS = {"small": {"eager": 40, "fast": 100}, "2.7B": {"eager": 30, "fast": 40}}
FIRST_COUNTED = 8
#: Per model: name -> (config, overrides). 2.7B at 4096 runs at batch 1 (batch 4 does not fit in 80 GB).
FITS = {
    "sdpa512": ("{m}_bf16.yaml", ["--model.attention", "sdpa"]),
    "flash512": ("{m}_bf16.yaml", ["--model.attention", "flash_triton"]),
    "flash4096": ("{m}_bf16.yaml", ["--model.attention", "flash_triton", "--model.context_length", "4096"]),
    "fast": ("{m}_bf16_fast.yaml", []),
    # The other shipped training paths (not run by default): compiled without graphs, master weights with the
    # compact state, the optimizer inside the backward pass, activation checkpointing.
    "compiled": ("{m}_bf16.yaml", ["--model.compile", "true"]),
    "compact": ("{m}_bf16.yaml", ["--model.master_weights", "true", "--model.optimizer_state_dtype", "bfloat16"]),
    "inbackward": ("{m}_bf16.yaml", ["--model.optimizer_in_backward", "true"]),
    "checkpointing": ("{m}_bf16.yaml", ["--model.activation_checkpointing", "full"]),
}
#: The fits ``run`` makes without ``--only``: the four paths of the acceptance table.
DEFAULT_FITS = ("sdpa512", "flash512", "flash4096", "fast")
LIMITS = {"other": 0.01, "busy": 0.03, "hta": 2.0, "phases": 0.02, "overhead": 0.01}
#: Seconds one fit may run before it is stopped (a 2.7B fit of ``run`` takes about two minutes; the first compiled
#: one more): a hung fit costs at most this, and the command's other fits still run.
FIT_TIMEOUT_S = 240


def version_dir(save_dir: Path) -> Path | None:
    """The newest version folder under ``save_dir`` (a fit run again into one OUT writes version_1, ...)."""
    found = sorted(save_dir.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


def first(scalars: dict, tag: str) -> float | None:
    values = scalars.get(tag)
    return values[0][1] if values else None


def counted_median(scalars: dict, tag: str) -> float | None:
    values = [v for step, v in scalars.get(tag, []) if step >= FIRST_COUNTED]
    return statistics.median(values) if values else None


def graph_phase_ratio(scalars: dict) -> float | None:
    """Median over the counted steps of (forward + backward + optimizer) / step."""
    by_step: dict[int, dict[str, float]] = {}
    for key in ("forward_ms", "backward_ms", "optimizer_ms", "step_ms"):
        for step, value in scalars.get(f"time/{key}", []):
            if step >= FIRST_COUNTED:
                by_step.setdefault(step, {})[key] = value
    ratios = [(r["forward_ms"] + r["backward_ms"] + r["optimizer_ms"]) / r["step_ms"]
              for r in by_step.values() if len(r) == 4 and r["step_ms"] > 0]
    return statistics.median(ratios) if ratios else None


def hta_differences(trace: Path, rank: int = 0) -> dict[str, Any]:
    """Largest |lmtrain - HTA| in points: breakdown + overlap, and the per-stream idle split; or HTA's error."""
    mine = hta_compare.lmtrain_figures(trace)
    try:
        theirs = hta_compare.hta_figures(trace, rank)
    except Exception as e:  # noqa: BLE001 (HTA's failure modes are many: report it and go on)
        return {"hta_error": f"{type(e).__name__}: {e}"[:300], "lmtrain": mine}
    diffs = {k: mine[k] - theirs[k] for k in mine if k in theirs and theirs[k] == theirs[k]}  # NaN: no comms
    breakdown = [abs(v) for k, v in diffs.items() if "per stream" not in k]
    split = [abs(v) for k, v in diffs.items() if "per stream" in k]
    out = {"hta_breakdown_points": max(breakdown, default=None), "hta_idle_split_points": max(split, default=None),
           "lmtrain": mine, "hta": theirs}
    if hta_compare.without_cpu_op_streams(load_trace(trace))[1]:
        # HTA again without counting inductor's CPU launch operators as GPU work (hta_compare's last column)
        try:
            gpu_only = hta_compare.hta_figures(trace, rank, gpu_only=True)
        except Exception as e:  # noqa: BLE001 (as above: report it and go on)
            out["hta_gpu_only_error"] = f"{type(e).__name__}: {e}"[:300]
            return out
        out["hta_gpu_only"] = gpu_only
        out["hta_gpu_only_points"] = max((abs(mine[k] - v) for k, v in gpu_only.items() if k in mine and v == v),
                                         default=None)
    return out


def fit(out: Path, name: str, config: str, args: list[str], callbacks: list[str], steps: int,
        extra: list[str] | None = None, timeout: int = FIT_TIMEOUT_S) -> dict[str, Any]:
    """One ``python -m lmtrain fit`` in its own process; returns its exit status, time and log folder.

    Every fit of one OUT shares the compile cache ``OUT/compile_cache``, so the second fit of a compiled config (the
    timer-only reference) loads its kernels instead of compiling them again. Each fit runs under
    :class:`hook_cost.HookCost`, which writes its callbacks' host time per step to ``hooks.json`` in its save
    folder."""
    save = out / "runs" / name
    command = [sys.executable, "-m", "lmtrain", "fit", "--config", str(ROOT / "configs" / config), *args,
               "--trainer.max_steps", str(steps), "--trainer.logger.init_args.save_dir", str(save),
               "--trainer.enable_progress_bar", "false", "--compile_cache", str(out / "compile_cache"),
               "--trainer.profiler", "hook_cost.HookCost", "--trainer.profiler.path", str(save / "hooks.json"),
               *(extra or []), *callbacks]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)}
    start = time.perf_counter()
    with open(out / "runs" / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                env=env).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {"name": name, "rc": rc, "seconds": round(time.perf_counter() - start, 1), "log_dir": version_dir(save),
            "hooks": save / "hooks.json", "command": " ".join(command[1:])}


def figures(result: dict[str, Any], hta: bool = True) -> dict[str, Any]:
    """The acceptance figures of one instrumented fit (see the module docstring); ``hta``: compare its traces with
    HTA too."""
    log_dir = result["log_dir"]
    if log_dir is None:
        return {}
    s, _ = read(log_dir)
    out = {key: first(s, tag) for key, tag in (
        ("timer_step_ms", "kernels/timer_step_ms"), ("busy_to_step", "kernels/busy_to_timer_step"),
        ("span_to_step", "kernels/span_to_timer_step"), ("wall_to_step", "kernels/wall_to_timer_step"),
        ("timer_profiled_ms", "kernels/timer_profiled_step_ms"), ("span_to_profiled", "kernels/span_to_timer_profiled"),
        ("busy_to_profiled", "kernels/busy_to_timer_profiled"),
        ("other_share", "kernels/other_share_step"), ("gpu_busy_ms", "kernels/gpu_busy_ms_per_step"),
        ("gpu_span_ms", "kernels/gpu_span_ms_per_step"), ("step_wall_ms", "kernels/step_wall_ms"),
        ("comm_ms", "kernels/communication_ms_step"), ("comm_exposed_ms", "kernels/communication_exposed_ms_step"),
        ("comm_overlap_share", "breakdown/comm_overlap_share"))}
    out["phases_to_step"] = graph_phase_ratio(s)
    out["straggler_ratio"] = counted_median(s, "time/straggler_ratio")
    out["added_hooks_ms"] = added_hooks_ms(log_dir.parents[1] / "hooks.json")
    if out["added_hooks_ms"] is not None and out["timer_step_ms"]:
        out["hooks_to_step"] = out["added_hooks_ms"] / out["timer_step_ms"]
    traces = sorted(log_dir.glob("kernel_trace*.json.gz")) if hta else []
    for rank, trace in enumerate(traces):
        out[f"hta_rank{rank}" if len(traces) > 1 else "hta"] = hta_differences(trace, rank)
    return out


#: The callbacks a timer-only reference fit does not have (hook_cost.HookCost names them by their state keys,
#: which may add arguments to the class name).
ADDED = ("NVTXRanges", "MemorySnapshot", "KernelShare", "PrecisionInspector")


def added_hooks_ms(path: Path) -> float | None:
    """The host time per step (sum of the per-callback medians, ms) of the callbacks that the timer-only reference
    does not run, from a fit's ``hooks.json`` (:mod:`hook_cost`); None without the file."""
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    return sum(r["median_us"] for name, r in report.items() if name.startswith(ADDED)) / 1e3


def append(out: Path, record: dict[str, Any]) -> None:
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(record, default=str) + "\n")


def fmt(value: float | None, spec: str = ".3f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def row(name: str, f: dict[str, Any], overhead: float | None, graphed: bool = False) -> tuple[list[str], bool]:
    """A table row of one fit's figures and whether each acceptance it has figures for holds (``graphed``: the
    fit replays CUDA graphs, so its phases come from inside the graph and are checked against the step)."""
    hta = f.get("hta", {})
    checks = {"other": f.get("other_share") is not None and f["other_share"] <= LIMITS["other"],
              "busy": f.get("busy_to_step") is not None and abs(f["busy_to_step"] - 1) <= LIMITS["busy"]}
    if hta.get("hta_breakdown_points") is not None:
        checks["hta"] = hta["hta_breakdown_points"] <= LIMITS["hta"]
    if graphed and f.get("phases_to_step") is not None:
        checks["phases"] = abs(f["phases_to_step"] - 1) <= LIMITS["phases"]
    if overhead is not None:
        checks["overhead"] = abs(overhead) <= LIMITS["overhead"]
    failed = [k for k, ok in checks.items() if not ok]
    cells = [name, fmt(f.get("timer_step_ms")), fmt(f.get("busy_to_step")), fmt(f.get("span_to_step")),
             fmt(f.get("wall_to_step")), fmt(f.get("span_to_profiled")), fmt(f.get("busy_to_profiled")),
             fmt(f.get("other_share"), ".2f", 100) + "%",
             "HTA failed" if "hta_error" in hta else fmt(hta.get("hta_breakdown_points"), ".2f"),
             fmt(hta.get("hta_idle_split_points"), ".2f"), fmt(f.get("phases_to_step")),
             fmt(overhead, "+.2f", 100) + ("%" if overhead is not None else ""),
             fmt(f.get("hooks_to_step"), ".2f", 100) + ("%" if f.get("hooks_to_step") is not None else ""),
             "yes" if not failed else "NO: " + ", ".join(failed)]
    return cells, not failed


def timer_fit(out: Path, name: str, config: str, args: list[str], steps: int, extra: list[str] | None = None,
              timeout: int = FIT_TIMEOUT_S) -> tuple[dict[str, Any], float | None]:
    """One fit with CudaSyncTimer alone: (the fit, its median step over the counted steps, None if it failed)."""
    result = fit(out, name, config, args, TIMER_ONLY, steps, extra=extra, timeout=timeout)
    ok = result["rc"] == 0 and result["log_dir"]
    return result, counted_median(read(result["log_dir"])[0], "time/step_ms") if ok else None


def timer_only_reference(out: Path, name: str, config: str, args: list[str], steps: int, figures_: dict[str, Any],
                         extra: list[str] | None = None,
                         timeout: int = FIT_TIMEOUT_S) -> tuple[dict[str, Any], float | None, float | None]:
    """The fit ``name`` again with CudaSyncTimer alone (``name_timer``), appended to the results: (its fit, its
    median step over the counted steps, the overhead of the instrumented fit whose ``figures_`` are given)."""
    base, base_ms = timer_fit(out, name + "_timer", config, args, steps, extra=extra, timeout=timeout)
    overhead = figures_["timer_step_ms"] / base_ms - 1 if base_ms and figures_.get("timer_step_ms") else None
    append(out, {"fit": name + "_timer", "timer_only": base, "baseline_step_ms": base_ms, "overhead": overhead})
    return base, base_ms, overhead


HEADER = ["fit", "timer step ms", "busy / step", "span / step", "wall / step", "span / profiled", "busy / profiled",
          "other", "HTA breakdown (pts)", "HTA idle split (pts)", "phases / step", "overhead", "hooks / step", "pass"]


def compare_reference(out: Path, name: str, config: str, args: list[str], steps: int, compare: list[str],
                      base_ms: float | None, timeout: int = FIT_TIMEOUT_S) -> float | None:
    """The timer-only fit once more with the options ``compare`` added (``name_compare``), in the same run, appended
    to the results; returns its median step over the timer-only reference's (None where either is missing)."""
    other, other_ms = timer_fit(out, name + "_compare", config, args + compare, steps, timeout=timeout)
    ratio = other_ms / base_ms if other_ms and base_ms else None
    append(out, {"fit": name + "_compare", "compare": other, "options": compare, "compare_step_ms": other_ms,
                 "compare_to_timer_only": ratio})
    return ratio


def run(out: Path, models: list[str], only: list[str] | None, hta: bool = True,
        timeout: int = FIT_TIMEOUT_S, compare: list[str] | None = None, kernel_share: list[str] | None = None,
        steps: int | None = None) -> int:
    """The fits of ``models`` (``only``: these paths), each with all five callbacks and with the timer alone.

    ``kernel_share``: options for KernelShare (``--trainer.callbacks.wait=80``, say) in every instrumented fit;
    ``steps``: the steps of every fit instead of :data:`STEPS` (a later window needs a longer fit)."""
    (out / "runs").mkdir(parents=True, exist_ok=True)
    all_ok = True
    for model in models:
        rows = []
        for key, (config, args) in FITS.items():
            if key not in (only or DEFAULT_FITS):
                continue
            kind = "fast" if key == "fast" else "eager"
            fit_steps = STEPS[model][kind] if steps is None else steps
            # One GPU: on a machine with several, Lightning's devices=auto would make every fit DDP over all of them
            args = args + ["--trainer.devices", "1"] + (["--data.batch_size", "1"] if model == "2.7B" and
                                                         key == "flash4096" else [])
            name = f"{model}_{key}"
            all5 = fit(out, name, config.format(m=model), args, five(*(kernel_share or [])), fit_steps,
                       timeout=timeout)
            f = figures(all5, hta) if all5["rc"] == 0 else {}
            append(out, {"fit": name, "five": all5, **f})  # kept even if the timer-only fit never ends
            base, base_ms, overhead = timer_only_reference(out, name, config.format(m=model), args, fit_steps, f,
                                                           timeout=timeout)
            failed = ([name, *["-"] * (len(HEADER) - 2), f"NO: fit exit {all5['rc']}"], False)
            cells, ok = row(name, f, overhead, graphed=key == "fast") if f else failed
            rows.append(cells)
            all_ok &= ok
            print(f"{name}: {all5['seconds']} s + {base['seconds']} s (timer only); " + " | ".join(cells[1:]),
                  flush=True)
            if compare:
                ratio = compare_reference(out, name, config.format(m=model), args, fit_steps, compare, base_ms,
                                          timeout=timeout)
                print(f"{name}: timer-only step with {' '.join(compare)} / without: "
                      f"{'-' if ratio is None else f'{ratio:.4f}'}", flush=True)
        if rows:
            table = markdown_table(HEADER, rows)
            with open(out / "summary.md", "a") as summary:  # after each model; several commands may share one OUT
                summary.write(table + "\n\n")
            print(table, flush=True)
    return 0 if all_ok else 1


def fsdp(out: Path, size: str, devices: int, steps: int, context: int = 512, strategy: str = "fsdp",
         overhead: bool = False, kernel_share: list[str] | None = None) -> int:
    """One fit on ``devices`` GPUs with all five callbacks, KernelShare on every rank: FSDP2
    (``configs/2.7B_bf16_fsdp.yaml``) or, with ``strategy="ddp"``, DDP (``configs/xl_bf16_ddp.yaml``), the model
    set to ``size``. With ``overhead``, the same fit again with CudaSyncTimer alone, and the overhead of the five.
    ``kernel_share``: more KernelShare options (its window, say)."""
    (out / "runs").mkdir(parents=True, exist_ok=True)
    ranks = "[" + ",".join(str(r) for r in range(devices)) + "]"
    name = f"{size}_{strategy}{devices}"
    config = "2.7B_bf16_fsdp.yaml" if strategy == "fsdp" else "xl_bf16_ddp.yaml"
    extra = ["--trainer.devices", str(devices)]
    if strategy == "fsdp":
        extra += ["--trainer.strategy.init_args.data_parallel_size", str(devices)]
    model_args = ["--model.size", size, "--model.context_length", str(context)]
    result = fit(out, name, config, model_args, five(f"--trainer.callbacks.ranks={ranks}", *(kernel_share or [])),
                 steps, extra=extra, timeout=540)
    f = figures(result) if result["rc"] == 0 else {}
    f["window"] = window_line(out / "runs" / f"{name}.log")
    append(out, {"fit": name, "five": result, **f})
    base_ms = ratio = None
    base = None
    if overhead and result["rc"] == 0:  # no reference for a fit that failed
        base, base_ms, ratio = timer_only_reference(out, name, config, model_args, steps, f, extra=extra,
                                                    timeout=540)
    rows = [[name, fmt(f.get("timer_step_ms")), fmt(base_ms), fmt(ratio, "+.2f", 100) + ("%" if ratio is not None
                                                                                           else ""),
             fmt(f.get("busy_to_step")), fmt(f.get("other_share"), ".2f", 100) + "%", fmt(f.get("comm_ms")),
             fmt(f.get("comm_exposed_ms")), fmt(f.get("comm_overlap_share"), ".1f", 100) + "%",
             fmt(f.get("straggler_ratio")),
             *[fmt(f.get(f"hta_rank{r}", {}).get("hta", {}).get("comm overlap %"), ".1f") for r in range(devices)],
             *[fmt(f.get(f"hta_rank{r}", {}).get("hta_gpu_only_points"), ".2f") for r in range(devices)],
             str(result["rc"])]]
    header = ["fit", "timer step ms", "timer alone ms", "overhead", "busy / step", "other", "comm ms/step",
              "exposed comm ms/step", "comm hidden", "straggler ratio",
              *[f"HTA overlap % rank {r}" for r in range(devices)],
              *[f"HTA (GPU events) pts rank {r}" for r in range(devices)], "exit"]
    table = markdown_table(header, rows)
    (out / f"summary_{name}.md").write_text(table + "\n" + (f["window"] or "") + "\n")
    print(table)
    if f["window"]:
        print(f["window"])
    return 0 if result["rc"] == 0 and (base is None or base["rc"] == 0) else 1


def window_line(log: Path) -> str | None:
    """KernelShare's setup line about its window (moved past another callback's perturbed steps, or not movable),
    from a fit's log; None when the window stayed where ``wait`` put it."""
    if not log.is_file():
        return None
    marks = ("KernelShare: profiling ", "KernelShare: the profiling window")
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if any(m in line for m in marks)]
    return lines[0] if lines else None


def check(log_dirs: list[Path]) -> int:
    rows, all_ok = [], True
    for log_dir in log_dirs:
        cells, ok = row(log_dir.name, figures({"log_dir": log_dir}), None)
        rows.append(cells)
        all_ok &= ok
    print(markdown_table(HEADER, rows))
    return 0 if all_ok else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="the fits of one or both models, then the table")
    p.add_argument("out", type=Path)
    p.add_argument("--models", nargs="+", default=["small"], choices=sorted(STEPS))
    p.add_argument("--only", nargs="+", choices=sorted(FITS),
                   help=f"these fits (default: {' '.join(DEFAULT_FITS)}; also "
                        f"{' '.join(k for k in FITS if k not in DEFAULT_FITS)})")
    p.add_argument("--skip-hta", action="store_true",
                   help="no HTA comparison (HTA not installed here): run check on the log folders later")
    p.add_argument("--fit-timeout", type=int, default=FIT_TIMEOUT_S, help="seconds one fit may run")
    p.add_argument("--compare", type=shlex.split, metavar="'ARGS'",
                   help="per fit, one more timer-only fit with these fit arguments added, one quoted string (e.g. "
                        "'--model.blas_workspace default'), and its median step over the timer-only one's")
    p.add_argument("--kernel-share", type=shlex.split, metavar="'ARGS'",
                   help="KernelShare options for every instrumented fit, one quoted string after = (e.g. "
                        "--kernel-share='--trainer.callbacks.wait=80' to profile later in a longer fit)")
    p.add_argument("--steps", type=int, help="steps of every fit (default: 40/100 small, 30/40 2.7B, eager/fast)")
    p = sub.add_parser("fsdp", help="one FSDP2 (or DDP) fit on several GPUs")
    p.add_argument("out", type=Path)
    p.add_argument("--size", default="small", choices=["small", "xl", "2.7B"])
    p.add_argument("--strategy", default="fsdp", choices=["fsdp", "ddp"],
                   help="fsdp: configs/2.7B_bf16_fsdp.yaml; ddp: configs/xl_bf16_ddp.yaml (the model set to --size)")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--context", type=int, default=512, help="tokens per sequence (the scaling runs use 1024)")
    p.add_argument("--overhead", action="store_true",
                   help="fit again with CudaSyncTimer alone and report the five's overhead on the timer's median")
    p.add_argument("--kernel-share", type=shlex.split, metavar="'ARGS'",
                   help="more KernelShare options, one quoted string after = (e.g. "
                        "--kernel-share='--trainer.callbacks.wait=80')")
    p = sub.add_parser("check", help="read fits made already")
    p.add_argument("log_dirs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args.out, args.models, args.only, hta=not args.skip_hta, timeout=args.fit_timeout,
                   compare=args.compare, kernel_share=args.kernel_share, steps=args.steps)
    if args.command == "fsdp":
        return fsdp(args.out, args.size, args.devices, args.steps, args.context, args.strategy, args.overhead,
                    args.kernel_share)
    return check(args.log_dirs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
