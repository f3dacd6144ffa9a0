"""Overhead of the profiling callbacks: step time with each alone and all five together vs none.

The same ``LMModule`` (from ``--config``) is trained with ``Trainer.fit`` for ``--steps`` steps per setting,
in this order: no callback, each of CudaSyncTimer, NVTXRanges, MemorySnapshot, KernelShare and
PrecisionInspector alone, all five together, and no callback again. Windowed callbacks are placed early
(from ``--window-start``, a few steps), and statistics use only the steps from ``--measure-from`` on, so
they show the cost *outside* the windows, which is what a long training run pays. In the all-five setting
the windows follow one another (``window_plan``): KernelShare profiles steps ``start .. start+2``, then
PrecisionInspector inspects ``start+3``, MemorySnapshot records ``start+4`` and NVTXRanges covers
``start+5 .. start+7``, so that no callback's window measures another's work (KernelShare's kernel
table would otherwise include PrecisionInspector's fp32 reference forward). ``--no-stagger`` opens them
all at ``--window-start``.

For the settings with KernelShare the row also gives its kernel time per step and the GPU's idle time in
the profiled steps, next to the probe's median step time: how much of a step the kernel table explains.

Each setting runs in a fresh Python process (``--isolate``, the default): run one after another in one
process, later settings ran slower (on a GPU the second no-callback run, after the profiler-based
settings, was slower than the first by more than the overheads being measured). ``lmtrain.bench.runner``
starts one process per setting (a fresh model with the same seed each time) and collects the children's
results; a child that crashes or exceeds
``--timeout`` is recorded in its row and the other settings go on. ``--no-isolate`` runs every setting in
this process on one model (quicker to start; for smoke runs).

The ground truth is an independent CUDA-event pair per step, recorded by a private probe registered
first and last in the callback list (so it brackets every other callback's ``on_train_batch_start`` and
``on_train_batch_end``). Reported per setting: median step ms (probe), overhead % against the mean of the
two no-callback runs, and for CudaSyncTimer the difference between its own ``time/step_ms`` median and
the probe's median over the same steps. The line under the table gives the baseline drift (second
no-callback run vs the first): overheads smaller than it are not resolved. Output: a Markdown table on
stdout, ``--out`` JSON (``meta.baseline_drift_pct``; each row's ``pid`` is the process that measured it),
and the TensorBoard logs of the all-five run under ``--logdir``.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lmtrain.bench.clock import Clock
from lmtrain.bench.comparison import baseline, keep_on_device_strategy
from lmtrain.bench.environment import device_name
from lmtrain.bench.runner import add_isolation_arguments, args_payload, run_settings
from lmtrain.cli_config import resolve_config

DEFAULT_CONFIG = "configs/2.7B_bf16.yaml"
STRATEGIES = ("ddp", "fsdp")
CALLBACKS = ("CudaSyncTimer", "NVTXRanges", "MemorySnapshot", "KernelShare", "PrecisionInspector")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``python -m lmtrain bench callbacks``."""
    parser.add_argument("--config", default=None,
                        help=f"fit YAML giving model, data and trainer.precision, resolved like fit resolves it "
                             f"(default {DEFAULT_CONFIG}, or where that file is missing and for --config '': "
                             "2.7B, bf16-mixed, batch 4, context 512, synthetic data)")
    parser.add_argument("--size", help="model size instead of the config's (e.g. tiny for a smoke run)")
    parser.add_argument("--batch-size", type=int, help="batch size instead of the config's")
    parser.add_argument("--context-length", type=int, help="context length instead of the config's")
    parser.add_argument("--precision", help="trainer precision instead of the config's")
    parser.add_argument("--steps", type=int, default=36, help="training steps per setting (default 36)")
    parser.add_argument("--window-start", type=int, default=5, help="first step of the callbacks' windows (default 5)")
    parser.add_argument("--measure-from", type=int, default=14,
                        help="first step counted in the statistics, after every window (default 14)")
    parser.add_argument("--no-stagger", dest="stagger", action="store_false",
                        help="all-five setting: open every window at --window-start instead of one after another")
    parser.add_argument("--settings", nargs="+", help="run only these settings (none, a callback name, all)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--logdir", default="logs/bench_callbacks",
                        help="TensorBoard logs of the all-five run (default logs/bench_callbacks)")
    parser.add_argument("--devices", type=int, default=1,
                        help="devices (GPUs, or CPU processes with --allow-cpu) each setting trains on (default 1). "
                             "Above 1 every setting runs under --strategy with one process per device, started "
                             "by Lightning; the step time of a setting is its slowest rank's median")
    parser.add_argument("--strategy", choices=STRATEGIES, default="ddp",
                        help="with --devices above 1: ddp, or fsdp (FSDP2 through ModelParallelStrategy, "
                             "data-parallel over all devices) (default ddp)")
    parser.add_argument("--allow-cpu", action="store_true", help="run without CUDA (host clock; a smoke test)")
    add_isolation_arguments(parser)


# -- model, data, callbacks -----------------------------------------------------------------------------------


#: The setting without a config file: the 2.7B model of the course's benchmark setup.
BUILT_IN = {"model.size": "2.7B", "model.vocab_size": 10_000, "model.context_length": 512,
            "data.source": "synthetic", "data.batch_size": 4, "trainer.precision": "bf16-mixed"}


def load_setup(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], str, str]:
    """(LMModule kwargs, LMDataModule kwargs, precision, where they came from): resolved like ``fit`` does."""
    path = args.config
    if path is None:
        path = DEFAULT_CONFIG if Path(DEFAULT_CONFIG).is_file() else ""
    base: dict[str, Any] = {} if path else dict(BUILT_IN)
    source = str(path) if path else (f"built-in defaults (no {DEFAULT_CONFIG})" if args.config is None
                                     else "built-in defaults")
    overrides = {**base, "model.size": args.size or base.get("model.size"),
                 "model.context_length": base.get("model.context_length") if args.context_length is None
                 else args.context_length,
                 "data.batch_size": base.get("data.batch_size") if args.batch_size is None else args.batch_size,
                 "trainer.precision": args.precision or base.get("trainer.precision")}
    resolved = resolve_config(path or None, overrides)
    data = dict(resolved.data)
    data["train_batches"] = max(int(data["train_batches"]), args.steps)
    return dict(resolved.model), data, resolved.precision, source


#: Where each callback's window starts in the all-five setting, relative to ``--window-start``
#: (KernelShare profiles 3 steps; NVTXRanges covers 3).
STAGGER = {"KernelShare": 0, "PrecisionInspector": 3, "MemorySnapshot": 4, "NVTXRanges": 5, "CudaSyncTimer": 0}
WINDOW_STEPS = {"KernelShare": 3, "PrecisionInspector": 1, "MemorySnapshot": 1, "NVTXRanges": 3, "CudaSyncTimer": 0}


def window_plan(names: list[str], window_start: int, stagger: bool = True) -> dict[str, int]:
    """First window step of each callback: one after another when several run together and ``stagger``."""
    together = len(names) > 1 and stagger
    return {n: window_start + (STAGGER.get(n, 0) if together else 0) for n in names}


def last_window_step(names: list[str], window_start: int, stagger: bool = True) -> int:
    """The last step inside any callback's window (``window_start - 1`` when none has one)."""
    plan = window_plan(names, window_start, stagger)
    return max([plan[n] + WINDOW_STEPS.get(n, 1) - 1 for n in names] or [window_start - 1])


def make_callback(name: str, window_start: int) -> tuple[Any | None, str]:
    """The callback ``name`` with its window at ``window_start`` (and a few steps), or None and why not."""
    try:
        import lmtrain.callbacks as cbs

        cls = getattr(cbs, name)
    except Exception as exc:  # noqa: BLE001 - another file may be unfinished: report and go on
        return None, f"not available ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
    wanted = {
        "CudaSyncTimer": {"warmup_steps": window_start, "print_summary": False},
        "NVTXRanges": {"depth": "op", "start_step": window_start, "num_steps": WINDOW_STEPS["NVTXRanges"]},
        "MemorySnapshot": {"start_step": window_start, "num_steps": 1},
        # torch.profiler schedule: wait, warmup, then active steps window_start .. window_start + 2.
        "KernelShare": {"wait": max(0, window_start - 2), "warmup": min(2, window_start),
                        "active": WINDOW_STEPS["KernelShare"]},
        "PrecisionInspector": {"step": window_start},
    }[name]
    try:
        params = inspect.signature(cls.__init__).parameters
        return cls(**{k: v for k, v in wanted.items() if k in params}), ""
    except Exception as exc:  # noqa: BLE001
        return None, f"could not be built ({type(exc).__name__}: {exc})"


class _StepProbe:
    """Independent per-step timing: one instance first and one last in the callback list.

    On several ranks every rank times its own steps; at the end of training the ranks' step times are gathered
    (one collective, after the last step), so that ``per_rank`` holds every rank's list in rank order."""

    def __init__(self, cuda: bool) -> None:
        self.clock = Clock(cuda)
        self.starts: list[Any] = []
        self.ends: list[Any] = []
        self.per_rank: list[list[float]] | None = None

    def mark(self, into: list[Any]) -> None:
        into.append(self.clock.mark())

    def step_ms(self) -> list[float]:
        return self.clock.intervals_ms(self.starts, self.ends)

    def gather(self, trainer: Any) -> None:
        from lmtrain.callbacks._common import gather_values

        self.per_rank = gather_values(trainer, self.step_ms())


def rank_statistics(per_rank: list[list[float]], measure_from: int) -> dict[str, Any]:
    """Row fields from every rank's step times (ms, rank order): each rank's median over the steps from
    ``measure_from`` on, the slowest rank's median (what a data-parallel run waits on: ``median_step_ms``),
    and the straggler ratio of each step (slowest / fastest rank), as its median and maximum."""
    measured = [steps[measure_from:] for steps in per_rank]
    if not measured or not all(measured):
        return {}
    medians = [statistics.median(m) for m in measured]
    ratios = [max(step) / min(step) for step in zip(*measured, strict=False) if min(step) > 0]
    row: dict[str, Any] = {"rank_median_step_ms": medians, "median_step_ms": max(medians),
                           "slowest_rank": medians.index(max(medians))}
    if ratios:
        row["straggler_ratio_median"] = statistics.median(ratios)
        row["straggler_ratio_max"] = max(ratios)
    return row


def _probe_callbacks(probe: _StepProbe) -> tuple[Any, Any]:
    import lightning.pytorch as pl

    class _ProbeStart(pl.Callback):
        @property
        def state_key(self) -> str:
            return "bench_probe_start"

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            probe.mark(probe.starts)

    class _ProbeEnd(pl.Callback):
        @property
        def state_key(self) -> str:
            return "bench_probe_end"

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            probe.mark(probe.ends)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            probe.gather(trainer)  # every rank, after its last step: one collective

    return _ProbeStart(), _ProbeEnd()


def _strategy(args: argparse.Namespace, cuda: bool) -> Any:
    """The Trainer's strategy: one device kept in place on a GPU, else ``--strategy`` over ``--devices``."""
    devices = getattr(args, "devices", 1)
    if devices <= 1:
        return keep_on_device_strategy() if cuda else "auto"
    if args.strategy == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    return "ddp"


#: KernelShare metrics copied into a setting's row (several ranks: the maxima over the profiling ranks are logged
#: too, as ``..._step_max``).
KERNEL_METRICS = {"kernels/communication_ms_step": "communication_ms", "kernels/communication_share_step":
                  "communication_share", "kernels/communication_exposed_ms_step": "communication_exposed_ms",
                  "kernels/compute_beside_comm_excess_ms_step": "compute_beside_comm_excess_ms"}


def _hook_origin(hook: Any) -> str:
    """The module a hook's function was defined in (``functools.partial`` and bound methods unwrapped)."""
    func = getattr(hook, "func", hook)
    func = getattr(func, "__func__", func)
    return getattr(func, "__module__", "") or ""


def _hooks_left(module: torch.nn.Module) -> int:
    """Forward and backward hooks on the module's submodules after a fit, apart from the strategy's own
    (``torch.distributed``: FSDP2 keeps a forward pre- and post-hook on every sharded module)."""
    return sum(1 for m in module.modules()
               for hooks in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks)
               for hook in hooks.values() if not _hook_origin(hook).startswith("torch.distributed"))


# -- one setting ----------------------------------------------------------------------------------------------


def run_setting(name: str, callbacks: list[Any], module: Any, data: Any, precision: str, args: argparse.Namespace,
                cuda: bool, logdir: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    probe = _StepProbe(cuda)
    first, last = _probe_callbacks(probe)
    trainer = pl.Trainer(
        max_steps=args.steps, accelerator="cuda" if cuda else "cpu", devices=getattr(args, "devices", 1),
        precision=precision, strategy=_strategy(args, cuda),
        callbacks=[first, *callbacks, last], logger=TensorBoardLogger(logdir, name=name),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=max(1, args.steps),
    )
    t0 = time.perf_counter()
    trainer.fit(module, data)
    wall = time.perf_counter() - t0
    steps = probe.step_ms()
    measured = steps[args.measure_from:]
    row: dict[str, Any] = {
        "setting": name, "steps": len(steps), "wall_s": round(wall, 2),
        "median_step_ms": statistics.median(measured) if measured else None,
        "first_step_ms": steps[0] if steps else None,
        "hooks_left": _hooks_left(module),
    }
    if trainer.world_size > 1 and probe.per_rank is not None:
        row.update(rank_statistics(probe.per_rank, args.measure_from))
    for cb in callbacks:
        summary = getattr(cb, "summary", None) if type(cb).__name__ == "KernelShare" else None
        if summary is not None:  # set with its metrics and timeline when the window's trace is analysed
            metrics = cb.metrics or {}
            row.update({field: metrics[key] for key, field in KERNEL_METRICS.items() if key in metrics})
            row["kernel_ms"] = summary.total_us / 1e3
            if row["median_step_ms"]:
                row["kernel_vs_step_pct"] = 100.0 * (row["kernel_ms"] / row["median_step_ms"] - 1.0)
            timeline = getattr(cb, "timeline", None)
            if timeline is not None:
                row["gpu_idle_ms"] = timeline.idle_us / 1e3
        if type(cb).__name__ == "CudaSyncTimer":
            own = [r["step_ms"] for r in cb.step_times if r["step"] >= args.measure_from]
            same = [steps[int(r["step"])] for r in cb.step_times if r["step"] >= args.measure_from]
            if own and same:
                row["timer_step_ms"] = statistics.median(own)
                row["probe_same_steps_ms"] = statistics.median(same)
                row["timer_vs_probe_pct"] = 100.0 * (row["timer_step_ms"] / row["probe_same_steps_ms"] - 1.0)
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def settings_plan(selected: list[str] | None = None) -> list[tuple[str, list[str]]]:
    """(setting, callback names) in running order; ``selected`` as ``--settings`` (``none`` keeps both baselines)."""
    settings: list[tuple[str, list[str]]] = [("none", [])] + [(n, [n]) for n in CALLBACKS] + [
        ("all five", list(CALLBACKS)), ("none (again)", [])]
    if selected:
        wanted = {s.lower() for s in selected}
        settings = [(n, c) for n, c in settings if n.lower() in wanted or (n == "all five" and "all" in wanted)
                    or (n == "none (again)" and "none" in wanted)]
    return settings


def measure_setting(name: str, names: list[str], module: Any, data: Any, precision: str, args: argparse.Namespace,
                    cuda: bool, scratch: str) -> dict[str, Any]:
    """The row of one setting in this process; a setting that fails is recorded in the row's ``note``."""
    callbacks, notes = [], []
    starts = window_plan(names, args.window_start, args.stagger)
    for cb_name in names:
        cb, why = make_callback(cb_name, starts[cb_name])
        if cb is None:
            notes.append(f"{cb_name} {why}")
        else:
            callbacks.append(cb)
    if names and not callbacks:
        print(f"[bench callbacks] {name}: skipped ({'; '.join(notes)})", file=sys.stderr)
        return {"setting": name, "note": "; ".join(notes)}
    logdir = args.logdir if name == "all five" else scratch
    try:
        row = run_setting(name.replace(" ", "_").replace("(", "").replace(")", ""), callbacks, module, data,
                          precision, args, cuda, logdir)
    except Exception as exc:  # noqa: BLE001 - record the failure and go on with the other settings
        row = {"note": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"}
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    row["setting"] = name
    row["pid"] = os.getpid()
    if notes:
        row["note"] = "; ".join([*notes, row.get("note", "")]).strip("; ")
    print(f"[bench callbacks] {name}: {row}", file=sys.stderr, flush=True)
    return row


def _module_and_data(model_kwargs: dict[str, Any], data_kwargs: dict[str, Any]) -> tuple[Any, Any]:
    import lightning.pytorch as pl

    from lmtrain.data import LMDataModule
    from lmtrain.module import LMModule

    pl.seed_everything(0, verbose=False)
    return LMModule(**model_kwargs), LMDataModule(**data_kwargs)


#: The function a setting's process executes (``module:function``); tests point it at a failure-injecting wrapper.
SETTING_TARGET = "lmtrain.bench.callbacks:run_setting_in_child"


def run_setting_in_child(payload: dict[str, Any]) -> dict[str, Any]:
    """Child target (``lmtrain.bench.runner``): one setting, from the parent's arguments and resolved config."""
    args = argparse.Namespace(**payload["args"])
    setting = payload["setting"]
    cuda = torch.cuda.is_available()
    names = dict(settings_plan())[setting]
    module, data = _module_and_data(payload["model"], payload["data"])
    with tempfile.TemporaryDirectory(prefix="bench_callbacks_") as scratch:
        row = measure_setting(setting, names, module, data, payload["precision"], args, cuda, scratch)
    return {"row": row, "device": device_name(cuda)}


def run(args: argparse.Namespace) -> int:
    """Run every setting; 0 on success, 2 without a GPU unless ``--allow-cpu``."""
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("bench callbacks: no CUDA GPU found; overheads are GPU step times. Run it on a GPU machine, or "
              "pass --allow-cpu for a smoke run.", file=sys.stderr)
        return 2
    if args.devices < 1:
        print(f"bench callbacks: --devices must be at least 1, got {args.devices}.", file=sys.stderr)
        return 2
    if args.devices > 1 and not args.isolate:
        print("bench callbacks: --devices above 1 needs --isolate (the default): Lightning starts the further "
              "ranks by running the setting's own process again.", file=sys.stderr)
        return 2
    if cuda and args.devices > torch.cuda.device_count():
        print(f"bench callbacks: --devices {args.devices} but {torch.cuda.device_count()} GPU(s) are visible.",
              file=sys.stderr)
        return 2
    if args.measure_from >= args.steps:
        print(f"bench callbacks: --measure-from {args.measure_from} must be below --steps {args.steps}.",
              file=sys.stderr)
        return 2
    last = last_window_step(list(CALLBACKS), args.window_start, args.stagger)
    if args.measure_from <= last:
        print(f"bench callbacks: warning: --measure-from {args.measure_from} is inside a window (the last window "
              f"step is {last}); the statistics then include profiled steps.", file=sys.stderr)
    known = {name.lower() for name, _ in settings_plan()} | {"all"}  # the names settings_plan matches
    unknown = [s for s in args.settings or [] if s.lower() not in known]
    if unknown:
        print(f"bench callbacks: --settings {' '.join(unknown)}: no such setting; use none, all or a callback's name "
              f"({', '.join(CALLBACKS)}).", file=sys.stderr)
        return 2
    for flag, value in (("--batch-size", args.batch_size), ("--context-length", args.context_length)):
        if value is not None and value < 1:
            print(f"bench callbacks: {flag} must be at least 1, got {value}.", file=sys.stderr)
            return 2
    model_kwargs, data_kwargs, precision, source = load_setup(args)
    from lmtrain.config import SIZES

    if model_kwargs.get("size") not in SIZES:  # checked here: every child process would fail on it instead
        print(f"bench callbacks: --size {model_kwargs.get('size')!r} is no model size; use one of "
              f"{', '.join(SIZES)}.", file=sys.stderr)
        return 2
    plan = settings_plan(args.settings)

    device = "cuda" if cuda else "cpu"  # an isolated run never touches the GPU here; the children name it
    rows: list[dict[str, Any]] = []
    interrupted = False
    try:
        if args.isolate:
            payload = {"args": args_payload(args), "model": model_kwargs, "data": data_kwargs, "precision": precision}
            for child in run_settings("callbacks", SETTING_TARGET, [name for name, _ in plan], payload, args.timeout,
                                      ranks=args.devices):
                if child.status == "ok" and child.result is not None:
                    row = dict(child.result["row"])
                    device = child.result.get("device", device)
                else:
                    row = {"setting": child.name, "status": child.status, "note": f"{child.status}: {child.error}"}
                print(f"[bench callbacks] {child.name} (pid {child.pid}, {child.seconds:.0f} s): {row}",
                      file=sys.stderr, flush=True)
                rows.append(row)
        else:
            device = device_name(cuda)
            module, data = _module_and_data(model_kwargs, data_kwargs)
            with tempfile.TemporaryDirectory(prefix="bench_callbacks_") as scratch:
                for name, names in plan:
                    rows.append(measure_setting(name, names, module, data, precision, args, cuda, scratch))
    except KeyboardInterrupt:
        interrupted = True  # report and write the settings finished so far, then stop

    first = next((r.get("median_step_ms") for r in rows if r["setting"] == "none"), None)
    last = next((r.get("median_step_ms") for r in rows if r["setting"] == "none (again)"), None)
    base, drift = baseline(first, last)
    for r in rows:
        if base and r.get("median_step_ms"):
            r["overhead_pct"] = 100.0 * (r["median_step_ms"] / base - 1.0)
    meta = {"device": device, "config": source, "model": model_kwargs, "data": data_kwargs, "precision": precision,
            "steps": args.steps, "window_start": args.window_start, "measure_from": args.measure_from,
            "windows_all_five": window_plan(list(CALLBACKS), args.window_start, args.stagger),
            "isolated": bool(args.isolate), "devices": args.devices,
            "strategy": args.strategy if args.devices > 1 else None, "baseline_step_ms": base,
            "baseline_drift_pct": drift,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    how = "each setting in a fresh process" if args.isolate else "all settings in one process"
    ranks = f"; {args.devices} ranks, {args.strategy}, step time of the slowest rank" if args.devices > 1 else ""
    print(f"\n{device}; {source}; precision {precision}; {args.steps} steps per setting; windows from step "
          f"{args.window_start}; medians over steps {args.measure_from}..{args.steps - 1}; {how}{ranks}\n")
    print(format_table(rows))
    print(baseline_line(base, drift))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str))
    if interrupted:
        raise KeyboardInterrupt("stopped by Ctrl-C; " + (f"the settings finished so far are in {args.out}."
                                                          if args.out else "the settings finished so far are above."))
    return 0


def baseline_line(base: float | None, drift: float | None) -> str:
    """The line under the table: the baseline the overheads are relative to, and how far the two baselines differ."""
    if base is None:
        return "overhead %: no baseline (the no-callback runs did not run or failed)"
    if drift is None:
        return f"overhead % vs {base:.2f} ms (one no-callback run only; baseline drift unknown)"
    text = (f"overhead % vs {base:.2f} ms, the mean of the two no-callback runs; baseline drift (none (again) vs "
            f"none): {drift:+.2f}%")
    if abs(drift) > 2.0:
        text += " - larger than the overheads being measured can be trusted to; rerun or add steps"
    return text


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the results (target: overhead <= 1% each, CudaSyncTimer within 2% of the probe)."""
    from lmtrain.analysis.tables import markdown_table

    def num(value: Any, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    ranked = any("rank_median_step_ms" in r for r in rows)
    table = []
    for r in rows:
        line = [r["setting"], num(r.get("median_step_ms"), ".2f"), num(r.get("overhead_pct"), "+.2f"),
                num(r.get("timer_step_ms"), ".2f"), num(r.get("timer_vs_probe_pct"), "+.2f"),
                num(r.get("kernel_ms"), ".2f"), num(r.get("kernel_vs_step_pct"), "+.2f"),
                num(r.get("gpu_idle_ms"), ".2f")]
        if ranked:
            medians = r.get("rank_median_step_ms")
            line += [" / ".join(format(m, ".2f") for m in medians) if medians else "-",
                     num(r.get("straggler_ratio_median"), ".3f"), num(r.get("communication_ms"), ".2f"),
                     num(r.get("communication_exposed_ms"), ".2f"), num(r.get("compute_beside_comm_excess_ms"), ".2f")]
        line += [num(r.get("first_step_ms"), ".0f"), r.get("hooks_left", "-"), r.get("note", "")]
        table.append(line)
    head = ["setting", "median step ms", "overhead %", "timer step ms", "timer vs probe %", "kernel ms/step",
            "kernel vs step %", "GPU idle ms/step (profiled)"]
    if ranked:
        head += ["rank medians ms", "straggler ratio", "comm ms/step", "exposed comm ms/step",
                 "compute slowed beside comm ms/step"]
    return markdown_table([*head, "first step ms", "hooks left", "note"], table)
