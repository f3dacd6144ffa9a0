"""Long-context probe: step time, tokens/s and peak memory of 2.7B bf16-mixed (batch 4) per memory option.

Run from the repository root on one CUDA GPU (under 8 minutes on an H100; cases are ordered by importance and the
rest are skipped once ``--max-seconds`` is spent):

    python benchmarks/scripts/long_context_probe.py [--out probe.json] [--max-seconds 450]
    python benchmarks/scripts/long_context_probe.py --smoke        # tiny model on the CPU: checks the script

Each case runs in its own process (an out-of-memory case cannot leave fragments to the next, and the parent never
creates a CUDA context of its own): it builds ``LMModule`` directly on the GPU, runs warm-up steps and then
measured steps of the plain training loop that ``LMModule`` defines (forward + loss under bf16 autocast,
backward, AdamW, the warmup+cosine schedule; with ``optimizer_in_backward`` the updates run inside the backward
pass through ``InBackwardAdamW.step(closure)``), times each step with CUDA events (median), and reads
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``. Next to each it prints the memory planner's peak
and whether the planner says it fits (``lmtrain.memory_plan.fits`` against ``device_capacity_bytes``). A case that
runs out of memory is recorded as OOM and the probe goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Case:
    """One probe case: a context and the memory options."""

    name: str
    context: int
    checkpointing: str
    in_backward: bool = False
    chunk: int = 0
    attention: str = "flash_triton"
    overlap: bool = False
    layers: int | None = None  # checkpoint_layers (None: every block)
    rest: str = "none"  # checkpoint_rest
    steps: int = 3
    warmup: int = 1
    compile: bool = False  # LMModule compile (the warm-up step compiles)


#: In order of importance: the baseline, the 16k candidates, 32k, then the comparisons at shorter contexts.
CASES = [
    Case("baseline 8k", 8192, "full"),
    Case("16k candidate", 16384, "full", True, 4096, steps=2),
    Case("16k offload", 16384, "offload", True, 4096, steps=2),
    Case("32k offload", 32768, "offload", True, 4096, steps=2),
    Case("8k full+ib+chunk", 8192, "full", True, 4096),
    Case("8k offload+ib+chunk", 8192, "offload", True, 4096),
    Case("16k full, no options (plan: no fit)", 16384, "full", steps=1),
    Case("2k full", 2048, "full"),
    Case("2k selective+ib+chunk", 2048, "selective", True, 4096),
    Case("16k candidate + overlap", 16384, "full", True, 4096, overlap=True, steps=2),
    Case("16k candidate, sdpa", 16384, "full", True, 4096, attention="sdpa", steps=2),
    Case("8k full, sdpa", 8192, "full", attention="sdpa"),
    Case("8k sdpa 24 full + 8 selective", 8192, "full", True, 4096, attention="sdpa", layers=24, rest="selective"),
    Case("8k sdpa 26 full + 6 selective", 8192, "full", True, 4096, attention="sdpa", layers=26, rest="selective"),
    Case("8k sdpa 29 full + 3 whole", 8192, "full", True, 4096, attention="sdpa", layers=29),
    Case("8k sdpa 24 full + 8 selective, compiled", 8192, "full", True, 4096, attention="sdpa", layers=24,
         rest="selective", compile=True),
    Case("8k sdpa 26 full + 6 selective, compiled", 8192, "full", True, 4096, attention="sdpa", layers=26,
         rest="selective", compile=True),
    Case("16k candidate, sdpa, compiled", 16384, "full", True, 4096, attention="sdpa", steps=2, compile=True),
]

#: --smoke: the same cases on the tiny model, contexts divided by this, sdpa attention, on the CPU.
SMOKE_DIVISOR = 64


def run_case(case: Case, smoke: bool) -> dict[str, Any]:
    """Build the module, run the steps, return the measurements (in this process)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from lmtrain.memory_plan import GIB, device_capacity_bytes, estimate_memory, fits
    from lmtrain.module import LMModule

    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda" if cuda else "cpu")
    batch, vocab = (2, 256) if smoke else (4, 10_000)
    context = max(16, case.context // SMOKE_DIVISOR) if smoke else case.context
    module = LMModule(
        size="tiny" if smoke else "2.7B", vocab_size=vocab, context_length=context,
        attention="sdpa" if smoke else case.attention, activation_checkpointing=case.checkpointing,
        warmup_steps=10, optimizer_in_backward=case.in_backward, optimizer_overlap=case.overlap,
        loss_chunk_tokens=case.chunk // SMOKE_DIVISOR if smoke else case.chunk,
        checkpoint_layers=None if case.layers is None else (min(case.layers, 3) if smoke else case.layers),
        checkpoint_rest=case.rest, compile=case.compile,
    )
    plan = estimate_memory(module.config, batch, context, "bf16-mixed", "train", device.type)
    capacity = device_capacity_bytes(80)
    row: dict[str, Any] = {**asdict(case), "context": context, "attention": module.config.attention,
                           "plan_gib": plan.peak_gib, "plan_moment": plan.moment,
                           "plan_fits": fits(plan, capacity), "capacity_gib": capacity / GIB,
                           "host_gib": plan.details["host_bytes"] / GIB}
    try:
        with device:
            module.configure_model()  # built on the device directly: no 13.6 GB copy from host memory
        config = module.configure_optimizers()
        optimizer, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"]
        tokens = torch.randint(0, vocab, (batch, context + 1), device=device)

        def closure() -> torch.Tensor:
            # bf16-mixed as Lightning runs it: autocast around forward and loss, backward outside.
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = module.loss(tokens)
            loss.backward()
            return loss

        def step() -> None:
            if case.in_backward:
                optimizer.step(closure)
            else:
                closure()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            schedule.step()

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for i in range(case.warmup + case.steps):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                step()
                elapsed = (time.perf_counter() - t0) * 1e3
            if i >= case.warmup:
                times.append(elapsed)
        ms = statistics.median(times)
        row.update(status="ok", step_ms=ms, tokens_per_s=batch * context / (ms / 1e3))
    except torch.OutOfMemoryError as error:
        row.update(status="OOM", error=str(error).splitlines()[0][:160])
    if cuda:
        row.update(peak_gib=torch.cuda.max_memory_allocated() / GIB,
                   reserved_gib=torch.cuda.max_memory_reserved() / GIB,
                   device=torch.cuda.get_device_name())
    return row


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict[str, Any]]) -> str:
    header = ["case", "context", "checkpointing", "in-bwd", "chunk", "attention", "step ms", "tokens/s",
              "peak GiB", "reserved GiB", "plan GiB", "plan fits", "host GiB", "status"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["name"], str(r.get("context")), r["checkpointing"], "on" if r["in_backward"] else "off", str(r["chunk"]),
            r["attention"], fmt(r.get("step_ms"), ".0f"), fmt(r.get("tokens_per_s"), ",.0f"),
            fmt(r.get("peak_gib"), ".2f"), fmt(r.get("reserved_gib"), ".2f"), fmt(r.get("plan_gib"), ".2f"),
            {True: "yes", False: "no"}.get(r.get("plan_fits"), "-"), fmt(r.get("host_gib"), ".1f"),
            r.get("status", "-") + (f": {r['error']}" if r.get("error") else ""),
        ]) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the script)")
    parser.add_argument("--max-seconds", type=float, default=450.0, help="start no case after this many seconds")
    parser.add_argument("--case-timeout", type=float, default=240.0, help="seconds before a case is killed")
    parser.add_argument("--only", help="comma-separated case numbers to run (0-based), e.g. 0,1")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case (JSON) and print its row
    args = parser.parse_args()
    if args.case:
        print("ROW " + json.dumps(run_case(Case(**json.loads(args.case)), args.smoke)), flush=True)
        return 0

    cases = [CASES[int(i)] for i in args.only.split(",")] if args.only else CASES
    begun = time.monotonic()
    rows = []
    for case in cases:
        row: dict[str, Any] = asdict(case)
        if time.monotonic() - begun > args.max_seconds:
            rows.append({**row, "status": "skipped (time)"})
            continue
        command = [sys.executable, __file__, "--case", json.dumps(asdict(case))] + (["--smoke"] if args.smoke else [])
        t0 = time.monotonic()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.case_timeout, cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
            found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
            if found:
                row = json.loads(found[-1])
            else:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                row.update(status="error", error=last[:160])
        except subprocess.TimeoutExpired:
            row.update(status=f"timeout ({args.case_timeout:.0f} s)")
        row["wall_s"] = time.monotonic() - t0
        rows.append(row)
        print(f"{case.name}: {row.get('status')} in {row['wall_s']:.0f} s", file=sys.stderr, flush=True)
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
