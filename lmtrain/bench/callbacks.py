"""Overhead of the profiling callbacks: step time with each alone and all five together vs none.

In one process, the same ``LMModule`` (built once, from ``--config``) is trained with ``Trainer.fit`` for
``--steps`` steps per setting: no callback, each of CudaSyncTimer, NVTXRanges, MemorySnapshot, KernelShare
and PrecisionInspector alone, all five together, and no callback again (the run-to-run noise floor).
Windowed callbacks are placed early (from ``--window-start``, a few steps), and statistics use only the
steps from ``--measure-from`` on, so they show the cost *outside* the windows, which is what a long
training run pays.

The ground truth is an independent CUDA-event pair per step, recorded by a private probe registered
first and last in the callback list (so it brackets every other callback's ``on_train_batch_start`` and
``on_train_batch_end``). Reported per setting: median step ms (probe), overhead % vs the first
no-callback run, and for CudaSyncTimer the difference between its own ``time/step_ms`` median and the
probe's median over the same steps. Output: a Markdown table on stdout, ``--out`` JSON, and the
TensorBoard logs of the all-five run under ``--logdir``.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lmtrain.callbacks._common import markdown_table

DEFAULT_CONFIG = "configs/2.7B_bf16.yaml"
CALLBACKS = ("CudaSyncTimer", "NVTXRanges", "MemorySnapshot", "KernelShare", "PrecisionInspector")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``python -m lmtrain bench callbacks``."""
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help=f"fit YAML giving model, data and trainer.precision (default {DEFAULT_CONFIG}; if the "
                             "file is missing: 2.7B, bf16-mixed, batch 4, context 512, synthetic data)")
    parser.add_argument("--size", help="model size instead of the config's (e.g. tiny for a smoke run)")
    parser.add_argument("--batch-size", type=int, help="batch size instead of the config's")
    parser.add_argument("--context-length", type=int, help="context length instead of the config's")
    parser.add_argument("--precision", help="trainer precision instead of the config's")
    parser.add_argument("--steps", type=int, default=30, help="training steps per setting (default 30)")
    parser.add_argument("--window-start", type=int, default=5, help="first step of the callbacks' windows (default 5)")
    parser.add_argument("--measure-from", type=int, default=10,
                        help="first step counted in the statistics, after every window (default 10)")
    parser.add_argument("--settings", nargs="+", help="run only these settings (none, a callback name, all)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--logdir", default="logs/bench_callbacks",
                        help="TensorBoard logs of the all-five run (default logs/bench_callbacks)")
    parser.add_argument("--allow-cpu", action="store_true", help="run without CUDA (host clock; a smoke test)")


# -- model, data, callbacks -----------------------------------------------------------------------------------


def load_setup(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], str, str]:
    """(LMModule kwargs, LMDataModule kwargs, precision, where they came from)."""
    path = Path(args.config) if args.config else None
    if path is not None and path.is_file():
        import yaml

        cfg = yaml.safe_load(path.read_text()) or {}
        model = dict(cfg.get("model") or {})
        model = dict(model.get("init_args", model)) if "class_path" in model else model
        data = dict(cfg.get("data") or {})
        data = dict(data.get("init_args", data)) if "class_path" in data else data
        precision = str((cfg.get("trainer") or {}).get("precision", "32-true"))
        source = str(path)
    else:
        model = {"size": "2.7B", "vocab_size": 10_000, "context_length": 512}
        data = {"source": "synthetic", "batch_size": 4}
        precision, source = "bf16-mixed", f"built-in (no {path})"
    if args.size:
        model["size"] = args.size
    if args.context_length:
        model["context_length"] = args.context_length
    if args.batch_size:
        data["batch_size"] = args.batch_size
    if args.precision:
        precision = args.precision
    # The command line links these two; do the same here.
    data["context_length"] = model.get("context_length", 512)
    data["vocab_size"] = model.get("vocab_size", 10_000)
    data["train_batches"] = max(int(data.get("train_batches", 0)), args.steps)
    return model, data, precision, source


def make_callback(name: str, window_start: int) -> tuple[Any | None, str]:
    """The callback ``name`` with its window at ``window_start`` (and a few steps), or None and why not."""
    try:
        import lmtrain.callbacks as cbs

        cls = getattr(cbs, name)
    except Exception as exc:  # noqa: BLE001 - another file may be unfinished: report and go on
        return None, f"not available ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
    wanted = {
        "CudaSyncTimer": {"warmup_steps": window_start, "print_summary": False},
        "NVTXRanges": {"depth": "op", "start_step": window_start, "num_steps": 3},
        "MemorySnapshot": {"start_step": window_start, "num_steps": 1},
        # torch.profiler schedule: wait, warmup, then active steps window_start .. window_start + 2.
        "KernelShare": {"wait": max(0, window_start - 2), "warmup": min(2, window_start), "active": 3},
        "PrecisionInspector": {"step": window_start},
    }[name]
    try:
        params = inspect.signature(cls.__init__).parameters
        return cls(**{k: v for k, v in wanted.items() if k in params}), ""
    except Exception as exc:  # noqa: BLE001
        return None, f"could not be built ({type(exc).__name__}: {exc})"


class _StepProbe:
    """Independent per-step timing: one instance first and one last in the callback list."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.starts: list[Any] = []
        self.ends: list[Any] = []

    def mark(self, into: list[Any]) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            into.append(event)
        else:
            into.append(time.perf_counter())

    def step_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [float(a.elapsed_time(b)) for a, b in zip(self.starts, self.ends, strict=False)]
        return [(b - a) * 1000.0 for a, b in zip(self.starts, self.ends, strict=False)]


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

    return _ProbeStart(), _ProbeEnd()


def _keep_on_device_strategy() -> Any:
    """Lightning's default teardown copies the model and the optimizer state to the host (40 GB for 2.7B
    with AdamW: many seconds per setting). This strategy frees the optimizer state instead and leaves the
    model on the GPU for the next setting."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class _KeepOnDevice(SingleDeviceStrategy):
        def teardown(self) -> None:
            for optimizer in self.optimizers:
                optimizer.state.clear()
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()

    return _KeepOnDevice(device=torch.device("cuda", torch.cuda.current_device()))


def _hooks_left(module: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in module.modules())


# -- one setting ----------------------------------------------------------------------------------------------


def run_setting(name: str, callbacks: list[Any], module: Any, data: Any, precision: str, args: argparse.Namespace,
                cuda: bool, logdir: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    probe = _StepProbe(cuda)
    first, last = _probe_callbacks(probe)
    trainer = pl.Trainer(
        max_steps=args.steps, accelerator="cuda" if cuda else "cpu", devices=1, precision=precision,
        strategy=_keep_on_device_strategy() if cuda else "auto",
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
    for cb in callbacks:
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


def run(args: argparse.Namespace) -> int:
    """Run every setting; 0 on success, 2 without a GPU unless ``--allow-cpu``."""
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("bench callbacks: no CUDA GPU found; overheads are GPU step times. Run it on a GPU machine, or "
              "pass --allow-cpu for a smoke run.", file=sys.stderr)
        return 2
    if args.measure_from >= args.steps:
        print(f"bench callbacks: --measure-from {args.measure_from} must be below --steps {args.steps}.",
              file=sys.stderr)
        return 2
    import lightning.pytorch as pl

    from lmtrain.data import LMDataModule
    from lmtrain.module import LMModule

    model_kwargs, data_kwargs, precision, source = load_setup(args)
    pl.seed_everything(0, verbose=False)
    module = LMModule(**model_kwargs)
    data = LMDataModule(**data_kwargs)

    settings: list[tuple[str, list[str]]] = [("none", [])] + [(n, [n]) for n in CALLBACKS] + [
        ("all five", list(CALLBACKS)), ("none (again)", [])]
    if args.settings:
        wanted = {s.lower() for s in args.settings}
        settings = [(n, c) for n, c in settings if n.lower() in wanted or (n == "all five" and "all" in wanted)
                    or (n == "none (again)" and "none" in wanted)]
    rows: list[dict[str, Any]] = []
    scratch = tempfile.mkdtemp(prefix="bench_callbacks_")
    for name, names in settings:
        callbacks, notes = [], []
        for cb_name in names:
            cb, why = make_callback(cb_name, args.window_start)
            if cb is None:
                notes.append(f"{cb_name} {why}")
            else:
                callbacks.append(cb)
        if names and not callbacks:
            rows.append({"setting": name, "note": "; ".join(notes)})
            print(f"[bench callbacks] {name}: skipped ({'; '.join(notes)})", file=sys.stderr)
            continue
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
        if notes:
            row["note"] = "; ".join([*notes, row.get("note", "")]).strip("; ")
        rows.append(row)
        print(f"[bench callbacks] {name}: {row}", file=sys.stderr, flush=True)

    base = next((r.get("median_step_ms") for r in rows if r["setting"] == "none"), None)
    for r in rows:
        if base and r.get("median_step_ms"):
            r["overhead_pct"] = 100.0 * (r["median_step_ms"] / base - 1.0)
    device = torch.cuda.get_device_name() if cuda else "cpu"
    meta = {"device": device, "config": source, "model": model_kwargs, "data": data_kwargs, "precision": precision,
            "steps": args.steps, "window_start": args.window_start, "measure_from": args.measure_from,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    print(f"\n{device}; {source}; precision {precision}; {args.steps} steps per setting; windows from step "
          f"{args.window_start}; medians over steps {args.measure_from}..{args.steps - 1}\n")
    print(format_table(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the results (target: overhead <= 1% each, CudaSyncTimer within 2% of the probe)."""

    def num(value: Any, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    table = [[r["setting"], num(r.get("median_step_ms"), ".2f"), num(r.get("overhead_pct"), "+.2f"),
              num(r.get("timer_step_ms"), ".2f"), num(r.get("timer_vs_probe_pct"), "+.2f"),
              num(r.get("first_step_ms"), ".0f"), r.get("hooks_left", "-"), r.get("note", "")] for r in rows]
    return markdown_table(["setting", "median step ms", "overhead %", "timer step ms", "timer vs probe %",
                           "first step ms", "hooks left", "note"], table)
