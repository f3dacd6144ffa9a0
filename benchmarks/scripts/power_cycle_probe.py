"""Does the GPU's clock cycle under its power limit? Back-to-back bf16 matrix products, timed per iteration, while
``nvidia-smi`` samples the SM clock, the power draw and the clock-event reasons.

Each iteration runs ``--products`` bf16 products of two ``--size`` x ``--size`` matrices and is timed with CUDA events
(host wall time kept beside it). For ``--seconds`` the loop runs; meanwhile ``nvidia-smi`` (where the machine has it)
writes one sample every ``--sample-ms``. Printed last, one JSON line: the median iteration, the iterations more than
``--slow`` times as long and when they came (seconds from the start), and from the samples taken under load (power
over ``LOAD_WATTS``) the median and lowest SM clock, the median power and the share of samples whose reasons include
the software power cap (``0x4``).

Why: the graphed 2.7B step is not equally long every step (about once a second two or three steps take 5-15%
longer, with and without callbacks). A plain loop of products, which has no host work, no callbacks and no data,
tells whether that cycle is the GPU's own::

    python benchmarks/scripts/power_cycle_probe.py --seconds 12 --out power_cycle.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lmtrain.bench.clock import Clock

#: Samples with more power than this (W) are taken under load.
LOAD_WATTS = 250.0
#: The ``clocks_event_reasons.active`` bit of the software power cap (NVML's ``clocksEventReasonSwPowerCap``).
SW_POWER_CAP = 0x4
SMI_FIELDS = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"


def parse_smi(lines: list[str]) -> list[tuple[float, int, float, int]]:
    """``nvidia-smi --query-gpu=SMI_FIELDS --format=csv,noheader`` lines as (epoch s, SM MHz, W, reasons); lines
    that do not parse (a header, ``[N/A]``) are skipped."""
    samples = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((when, int(parts[1].split()[0]), float(parts[2].split()[0]), int(parts[3], 16)))
        except ValueError:
            continue
    return samples


def slow_iterations(rows: list[tuple[float, float]], slow: float) -> dict[str, Any]:
    """From (host s, iteration ms) rows: the median ms and the iterations over ``slow`` x median as [seconds from the
    first row, ratio to the median]."""
    median = statistics.median(ms for _, ms in rows)
    start = rows[0][0]
    return {"iterations": len(rows), "median_ms": median,
            "slow": [[round(t - start, 3), round(ms / median, 3)] for t, ms in rows if ms > slow * median]}


def load_summary(samples: list[tuple[float, int, float, int]]) -> dict[str, Any] | None:
    """The samples under load (power over ``LOAD_WATTS``): how many, the median and lowest SM clock (MHz), the median
    power (W) and the share with the software power cap among their reasons; None without such samples."""
    load = [s for s in samples if s[2] > LOAD_WATTS]
    if not load:
        return None
    return {"samples": len(load), "sm_mhz_median": statistics.median(s[1] for s in load),
            "sm_mhz_min": min(s[1] for s in load), "power_w_median": statistics.median(s[2] for s in load),
            "power_cap_share": sum(bool(s[3] & SW_POWER_CAP) for s in load) / len(load)}


def smi_index() -> str:
    """nvidia-smi's index of the GPU this process uses: the first of ``CUDA_VISIBLE_DEVICES`` where it is set (an
    index or a UUID), else 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


def run(seconds: float, size: int, products: int) -> list[tuple[float, float]]:
    import torch

    clock = Clock(cuda=True)
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(products):  # warm-up: cuBLAS heuristics, clocks up
        a @ b
    clock.sync()
    rows: list[tuple[float, float]] = []
    end = time.time() + seconds
    while time.time() < end:
        start = clock.mark()
        for _ in range(products):
            a @ b
        stop = clock.mark()
        clock.sync()
        rows.append((time.time(), clock.ms(start, stop)))
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="how long the loop runs")
    parser.add_argument("--size", type=int, default=8192, help="the matrices' side")
    parser.add_argument("--products", type=int, default=20, help="products per timed iteration")
    parser.add_argument("--slow", type=float, default=1.03, help="an iteration this many times the median is slow")
    parser.add_argument("--sample-ms", type=int, default=50, help="nvidia-smi's sampling interval")
    parser.add_argument("--out", type=Path, help="also write the result and every sample to this JSON file")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("power_cycle_probe: needs a CUDA GPU; none is visible.", file=sys.stderr)
        return 2
    smi = shutil.which("nvidia-smi")
    with tempfile.TemporaryFile("w+") as log:
        sampler = (subprocess.Popen([smi, f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader",
                                     f"--loop-ms={args.sample_ms}", f"--id={smi_index()}"],
                                    stdout=log, stderr=subprocess.DEVNULL) if smi else None)
        try:
            rows = run(args.seconds, args.size, args.products)
        finally:
            if sampler:
                sampler.terminate()
                sampler.wait(timeout=10)
        log.seek(0)
        samples = parse_smi(log.read().splitlines())
    during = [s for s in samples if rows[0][0] <= s[0] <= rows[-1][0]]
    timing = slow_iterations(rows, args.slow)
    result = {"device": torch.cuda.get_device_name(), "size": args.size, "products": args.products, **timing,
              "load": load_summary(during),
              "tflops_at_median": args.products * 2 * args.size ** 3 / timing["median_ms"] / 1e9}
    if not smi:
        result["load"] = "no nvidia-smi on this machine: no samples"
    if args.out:
        args.out.write_text(json.dumps({**result, "rows": rows, "samples": during}, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
