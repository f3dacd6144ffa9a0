"""Lightning overhead: step time of Trainer.fit against a plain PyTorch loop doing the same work.

One GPU, runs in this order (a drift of the GPU clock or temperature, or state left behind by an earlier
run, shows as a gap between the two plain runs)::

    plain        the plain loop
    lightning    Trainer.fit(LMModule, LMDataModule) as the YAML config sets it up (progress bar, logging)
    lightning_no_progress_bar   the same without the progress bar (a diagnostic; ``--no-diagnostic`` skips it)
    plain        the plain loop again

Each run is a fresh Python process (``--isolate``, the default; ``lmtrain.bench.runner``) that gets the
resolved configuration and returns its result, because runs one
after another in one process can slow down for reasons that have nothing to do with what is compared (on
a GPU the Lightning run without progress bar came out slower than the one with it, inside the step too,
which the progress bar cannot explain). A run that
crashes or exceeds ``--timeout`` is recorded as ``error`` or ``timeout`` and the others go on.
``--no-isolate`` runs all of them in this process (quicker to start).

The config is resolved like ``python -m lmtrain fit`` resolves it (``lmtrain.cli_config``), with
``--batch-size``, ``--context-length`` and ``--attention`` as overrides. Both sides build the model and
optimizer the same way, from the config's ``model`` section: the same
``TransformerLM``, attention backend, AdamW (fused on CUDA) and warmup/cosine schedule, the same
precision (``32-true``: no autocast; ``bf16-mixed``: bf16 autocast around forward and loss), batches of
the same shape. The plain loop draws its random token ids on the GPU once; the Lightning run reads its
batches from ``LMDataModule`` (random ids for the shipped configs), moves them to the GPU and logs to
TensorBoard (a temporary folder) as ``python -m lmtrain fit`` does. Validation, sanity checks,
checkpointing and the config's ``trainer.callbacks`` are left out.

Timing: an event is recorded when each step starts and ends (CUDA events on the GPU stream, read after
the run; the wall clock on the CPU); for Lightning in a private callback's ``on_train_batch_start`` and
``on_train_batch_end``, for the plain loop at the top and bottom of its loop body. The step time is the
interval between the ends of consecutive steps, so everything Lightning does between two steps (loading,
moving and logging the batch, the progress bar) counts; "in-step" is start to end of one step. The first
``--warmup`` steps are not counted. Lightning overhead = median Lightning step / baseline - 1, where the
baseline is the mean of the two plain runs' median steps; their difference is reported as the baseline
drift (overheads smaller than it are not resolved). Peak memory is ``torch.cuda.max_memory_allocated`` of
each run, reset between runs.

Output: a Markdown table on stdout, JSON with every step time (and the process id of each run) at
``--out``. Needs a CUDA GPU; ``--allow-cpu`` runs on the CPU as a functional check (wall-clock times, no
memory figures).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import tempfile
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmtrain.analysis.tables import markdown_table
from lmtrain.bench.clock import Clock
from lmtrain.bench.comparison import baseline, keep_on_device_strategy
from lmtrain.bench.environment import device_name
from lmtrain.bench.runner import add_isolation_arguments, args_payload, run_settings
from lmtrain.cli_config import resolve_config
from lmtrain.errors import LmtrainError

DEFAULT_CONFIG = "configs/2.7B_bf16.yaml"
#: Lightning precision -> autocast dtype of the plain loop (None: no autocast).
AUTOCAST: dict[str, torch.dtype | None] = {"32-true": None, "bf16-mixed": torch.bfloat16}
_PLAIN_BATCHES = 4  # distinct batches the plain loop cycles through


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"LightningCLI YAML (default {DEFAULT_CONFIG})")
    parser.add_argument("--steps", type=int, default=30, help="steps per run, warm-up included (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of each run not counted (default 5)")
    parser.add_argument("--batch-size", type=int, default=None, help="override data.batch_size")
    parser.add_argument("--context-length", type=int, default=None, help="override model.context_length")
    parser.add_argument("--attention", default=None, help="override model.attention")
    parser.add_argument("--no-diagnostic", action="store_true",
                        help="skip the Lightning run without progress bar")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU (a functional check, no GPU)")
    add_isolation_arguments(parser)


@dataclass
class Run:
    """One timed run: per-step times after warm-up and the memory it used."""

    name: str
    status: str = "ok"  # ok | OOM | error | timeout (the last two: its process failed, with --isolate)
    step_ms: list[float] = field(default_factory=list)  # end of step i-1 to end of step i
    in_step_ms: list[float] = field(default_factory=list)  # start to end of step i
    peak_memory_gib: float | None = None
    memory_released: bool | None = None  # the run's model was garbage once the run was over
    pid: int | None = None  # the process that ran it
    error: str = ""  # why a failed run has no times

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.step_ms) if self.step_ms else None

    def summary(self, tokens_per_step: int) -> dict[str, Any]:
        median = self.median_ms
        return {
            "median_step_ms": median,
            "mean_step_ms": statistics.fmean(self.step_ms) if self.step_ms else None,
            "median_in_step_ms": statistics.median(self.in_step_ms) if self.in_step_ms else None,
            "tokens_per_s": tokens_per_step / median * 1e3 if median else None,
        }


def step_times(clock: Clock, starts: list[Any], ends: list[Any], warmup: int) -> tuple[list[float], list[float]]:
    """(step times, in-step times) of steps ``warmup..`` (``warmup`` >= 1: a step time needs the step before).

    A step time runs from the end of the step before to the end of the step, so that everything done between
    two steps counts; an in-step time from the start of the step to its end.
    """
    clock.sync()
    steps = [clock.ms(ends[i - 1], ends[i]) for i in range(warmup, len(ends))]
    in_step = [clock.ms(starts[i], ends[i]) for i in range(warmup, len(ends))]
    return steps, in_step


def load_config(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(LMModule, LMDataModule, Trainer) keyword arguments: ``--config`` resolved like ``fit``, with the overrides.

    The trainer's callbacks are left out (the study times the bare Trainer) and its precision is in long form.
    """
    resolved = resolve_config(args.config, {"model.context_length": args.context_length,
                                            "model.attention": args.attention, "data.batch_size": args.batch_size})
    model, data, trainer = resolved.model, resolved.data, resolved.trainer
    if model.get("step_mode", "train") != "train":
        raise LmtrainError("model.step_mode", f"this study times whole training steps, not {model['step_mode']!r}.",
                           "use a config with model.step_mode: train.")
    precision = resolved.precision
    if precision not in AUTOCAST:
        raise LmtrainError("trainer.precision", f"the plain loop has no counterpart for {precision!r}.",
                           f"use one of {', '.join(AUTOCAST)}.")
    trainer["precision"] = precision
    trainer.pop("callbacks", None)
    return model, data, trainer


def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def plain_run(name: str, model_kwargs: dict[str, Any], batch_size: int, autocast: torch.dtype | None,
              device: torch.device, steps: int, warmup: int, clock: Clock) -> tuple[Run, weakref.ref]:
    """The plain loop: LMModule's model, loss and optimizer driven by hand, no Trainer."""
    from lmtrain.module import LMModule

    module = LMModule(**model_kwargs)
    with device:  # build the weights where they will live (a 2.7B model is slow to initialise on the CPU)
        module.configure_model()
    module.to(device).train()
    optimizers = module.configure_optimizers()
    optimizer, schedule = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
    cfg = module.config
    generator = torch.Generator(device=device).manual_seed(0)
    batches = torch.randint(0, cfg.vocab_size, (_PLAIN_BATCHES, batch_size, cfg.context_length + 1),
                            device=device, generator=generator)  # (n, B, T + 1)
    starts, ends = [], []
    for i in range(steps):
        starts.append(clock.mark())
        with _autocast(device, autocast):
            loss = module.loss(batches[i % _PLAIN_BATCHES])
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        ends.append(clock.mark())
    run = Run(name)
    run.step_ms, run.in_step_ms = step_times(clock, starts, ends, warmup)
    return run, weakref.ref(module)


def lightning_run(name: str, model_kwargs: dict[str, Any], data_kwargs: dict[str, Any],
                  trainer_kwargs: dict[str, Any], steps: int, warmup: int, clock: Clock, log_dir: str
                  ) -> tuple[Run, weakref.ref]:
    """``Trainer.fit`` of LMModule on LMDataModule, with a callback that only records time marks."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
    from typing_extensions import override

    from lmtrain.data import LMDataModule
    from lmtrain.module import LMModule

    class StepMarks(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[Any] = []
            self.ends: list[Any] = []

        @override
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            self.starts.append(clock.mark())

        @override
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            self.ends.append(clock.mark())

    module = LMModule(**model_kwargs)
    data = LMDataModule(**{**data_kwargs, "context_length": module.config.context_length,
                           "vocab_size": module.config.vocab_size})
    marks = StepMarks()
    trainer = pl.Trainer(**{
        **trainer_kwargs,
        "devices": 1, "max_steps": steps, "max_epochs": None, "callbacks": [marks],
        # Leaves the model on the GPU at the end of fit instead of copying it and AdamW's state to the host.
        "strategy": keep_on_device_strategy() if torch.cuda.is_available() else "auto",
        "logger": TensorBoardLogger(log_dir, name=name), "enable_checkpointing": False,
        "limit_val_batches": 0, "num_sanity_val_steps": 0,
    })
    trainer.fit(module, data)
    run = Run(name)
    run.step_ms, run.in_step_ms = step_times(clock, marks.starts, marks.ends, warmup)
    return run, weakref.ref(module)


def _release(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


#: Trainer arguments that differ from the config's, per run name (None: the plain loop).
TRAINER_CHANGES: dict[str, dict[str, Any] | None] = {
    "plain": None, "lightning": {}, "lightning_no_progress_bar": {"enable_progress_bar": False}}


def run_plan(diagnostic: bool = True) -> list[str]:
    """Run names in running order: the plain loop first and last, Lightning in between."""
    return ["plain", "lightning", *(["lightning_no_progress_bar"] if diagnostic else []), "plain"]


def measure_one(name: str, model_kwargs: dict[str, Any], data_kwargs: dict[str, Any], trainer_kwargs: dict[str, Any],
                args: argparse.Namespace, clock: Clock, log_dir: str) -> Run:
    """One run in this process (plain loop or Lightning, by ``name``), with its peak memory; OOM is recorded."""
    cuda = clock.cuda
    device = torch.device("cuda" if cuda else "cpu")
    precision = str(trainer_kwargs.get("precision", "32-true"))
    batch_size = int(data_kwargs.get("batch_size", 4))
    trainer_changes = TRAINER_CHANGES[name]
    _release(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        if trainer_changes is None:
            result, ref = plain_run(name, model_kwargs, batch_size, AUTOCAST[precision], device,
                                    args.steps, args.warmup, clock)
        else:
            result, ref = lightning_run(name, model_kwargs, data_kwargs, {**trainer_kwargs, **trainer_changes},
                                        args.steps, args.warmup, clock, log_dir)
    except torch.cuda.OutOfMemoryError as exc:
        result, ref = Run(name, status="OOM", error=str(exc).splitlines()[0][:300] if str(exc) else ""), None
    if cuda:
        result.peak_memory_gib = torch.cuda.max_memory_allocated() / 2**30
    _release(cuda)
    result.memory_released = ref is None or ref() is None
    result.pid = os.getpid()
    return result


def _run_from_child(payload: dict[str, Any]) -> Run:
    fields = set(Run.__dataclass_fields__)
    return Run(**{k: v for k, v in payload.items() if k in fields})


#: The function a run's process executes (``module:function``); tests point it at a wrapper that injects failures.
SETTING_TARGET = "lmtrain.bench.overhead:run_setting_in_child"


def run_setting_in_child(payload: dict[str, Any]) -> dict[str, Any]:
    """Child target (``lmtrain.bench.runner``): one run, from the parent's arguments and resolved config."""
    args = argparse.Namespace(**payload["args"])
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="lmtrain-overhead-") as log_dir:
        result = measure_one(payload["setting"], payload["model"], payload["data"], payload["trainer"], args,
                             Clock(cuda), log_dir)
    return {"run": asdict(result), "device": device_name(cuda)}


def run(args: argparse.Namespace) -> int:
    """Time the runs, print the table, write the JSON; 0 on success."""
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        raise LmtrainError("device", "no CUDA GPU is visible, and this study times GPU steps.",
                           "run it on a GPU machine, or pass --allow-cpu for a functional check on the CPU.")
    if args.warmup < 1 or args.steps < args.warmup + 2:
        raise LmtrainError("--steps", f"needs at least two steps after {args.warmup} warm-up steps "
                           f"(and --warmup >= 1), got --steps {args.steps}.", "raise --steps (e.g. 30).")
    model_kwargs, data_kwargs, trainer_kwargs = load_config(args)
    import lightning

    from lmtrain.module import LMModule

    # Validates the model section (size, heads, backend, GPU-only options) before anything runs.
    config = LMModule(**model_kwargs).config
    precision = str(trainer_kwargs["precision"])
    batch_size = int(data_kwargs["batch_size"])
    tokens_per_step = batch_size * config.context_length
    plan = run_plan(not args.no_diagnostic)

    runs: list[Run] = []
    interrupted = False
    try:
        if args.isolate:
            device = "cuda" if cuda else "cpu"  # this process never touches the GPU; the children name it
            payload = {"args": args_payload(args), "model": model_kwargs, "data": data_kwargs,
                       "trainer": trainer_kwargs}
            for child in run_settings("overhead", SETTING_TARGET, plan, payload, args.timeout):
                if child.status == "ok" and child.result is not None:
                    runs.append(_run_from_child(child.result["run"]))
                    device = child.result.get("device", device)
                else:
                    runs.append(Run(child.name, status=child.status, error=child.error))
        else:
            device = device_name(cuda)
            with tempfile.TemporaryDirectory(prefix="lmtrain-overhead-") as log_dir:
                for name in plan:
                    runs.append(measure_one(name, model_kwargs, data_kwargs, trainer_kwargs, args, Clock(cuda),
                                            log_dir))
    except KeyboardInterrupt:
        interrupted = True  # report and write the runs finished so far, then stop

    plain_runs = [r for r in runs if r.name == "plain"]
    first_plain = plain_runs[0].median_ms if plain_runs else None
    last_plain = plain_runs[1].median_ms if len(plain_runs) > 1 else None
    base, drift = baseline(first_plain, last_plain)
    plain_steps = [t for r in plain_runs for t in r.step_ms]
    plain_median = statistics.median(plain_steps) if plain_steps else None  # pooled; kept for reference
    overhead = {
        r.name: (r.median_ms / base - 1) * 100 if r.median_ms and base else None
        for r in runs if r.name.startswith("lightning")
    }

    header = ["run", "steps timed", "median step ms", "mean step ms", "median in-step ms", "tokens/s",
              "peak memory GiB", "vs plain"]
    rows = []
    for r in runs:
        s = r.summary(tokens_per_step)
        vs = overhead.get(r.name)
        rows.append([r.name if r.status == "ok" else f"{r.name} ({r.status})", len(r.step_ms),
                     _fmt(s["median_step_ms"], 2), _fmt(s["mean_step_ms"], 2), _fmt(s["median_in_step_ms"], 2),
                     _fmt(s["tokens_per_s"], 0), _fmt(r.peak_memory_gib, 2), "" if vs is None else f"{vs:+.2f}%"])
    how = "each run in a fresh process" if args.isolate else "all runs in one process"
    print(f"Lightning overhead, {args.config}: size {model_kwargs.get('size')}, batch {batch_size}, context "
          f"{config.context_length}, {precision}, {config.attention}, {args.steps} steps per run "
          f"({args.warmup} warm-up), {device}, {how}")
    print(markdown_table(header, rows))
    for r in runs:
        if r.error:
            print(f"{r.name} ({r.status}): {r.error}")
    lightning_result = next((r for r in runs if r.name == "lightning"), None)
    if lightning_result is not None and overhead.get("lightning") is not None:
        print(f"Lightning overhead: {overhead['lightning']:+.2f}% (median step {lightning_result.median_ms:.2f} ms "
              f"vs {base:.2f} ms, the mean of the plain runs' medians)")
    if drift is not None:
        note = " - larger than the overheads being measured can be trusted to" if abs(drift) > 2.0 else ""
        print(f"baseline drift (second plain run vs first): {drift:+.2f}%{note}")

    if args.out:
        result = {
            "study": "overhead",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device,
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "arguments": args_payload(args),
            "isolated": bool(args.isolate),
            "model": model_kwargs, "data": data_kwargs, "trainer": trainer_kwargs,
            "batch_size": batch_size, "context_length": config.context_length, "precision": precision,
            "attention": config.attention,
            "plain_median_step_ms": plain_median,
            "baseline_step_ms": base,
            "baseline_drift_pct": drift,
            "overhead_pct": overhead,
            "runs": [{**asdict(r), **r.summary(tokens_per_step)} for r in runs],
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    if interrupted:
        raise KeyboardInterrupt("stopped by Ctrl-C; " + (f"the runs finished so far are in {args.out}." if args.out
                                                          else "the runs finished so far are printed above."))
    return 0 if all(r.status == "ok" for r in runs) else 1
