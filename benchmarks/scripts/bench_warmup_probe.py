"""What ``bench attention``'s sustained warm-up (``--warmup-ms``) changes: each cell measured as the bench does
(``measure_cell``) with and without it, every timed run's interval kept, and the GPU's SM clock sampled every
100 ms by ``nvidia-smi`` during each measurement (bf16, causal, 16 heads, B*H*N = 2^21).

Written for ``bench attention``'s ``measure_cell`` as of commit 02b9036, where each of a cell's three measurements
(forward, backward, forward+backward) had its own warm-up. The bench now measures a shape's backends in rounds
(``measure_shape``, only a round's first measurement warmed up) and ``measure_cell`` is gone, so this script runs
at commit 02b9036: check it out to repeat the record.

    PYTHONPATH=. python docs/benchmarks/scripts/bench_warmup_probe.py [--cells 64:16384 128:16384] [--rep 10]
"""
import argparse
import statistics
import subprocess
import tempfile
import time
from datetime import datetime

import torch

from lmtrain.bench import attention as bench

intervals = []  # every measurement's timed intervals, in order: fwd, bwd, f+b per cell
_intervals_ms = bench.Clock.intervals_ms


def _logged(self, starts, ends):
    xs = _intervals_ms(self, starts, ends)
    intervals.append((time.time(), xs))
    return xs


def clocks(path, t0, t1):
    """SM clocks (MHz) that nvidia-smi sampled between host times t0 and t1."""
    out = []
    for line in open(path).read().splitlines():
        try:
            stamp, mhz = (x.strip() for x in line.split(",")[:2])
            t = datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
        except ValueError:
            continue
        if t0 <= t <= t1:
            out.append(int(mhz.split()[0]))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cells", nargs="+", default=["64:16384", "128:16384"])
    p.add_argument("--rep", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    bench.Clock.intervals_ms = _logged
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    smi_log = tempfile.NamedTemporaryFile(suffix=".csv", delete=False).name
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm", "--format=csv,noheader", "-lms", "100"],
                           stdout=open(smi_log, "w"))
    time.sleep(1)
    rows = []
    try:
        for _ in range(a.rounds):
            for cell in a.cells:
                d, n = map(int, cell.split(":"))
                for backend in ("flash_triton", "sdpa_cudnn"):
                    for warmup_ms in (0.0, bench.DEFAULT_WARMUP_MS):
                        c = bench.Cell(backend, "bf16", True, 2**21 // (16 * n), 16, n, d)
                        t0 = time.time()
                        bench.measure_cell(c, bench._backend(backend, dev, n, 1024), dev, 5, a.rep, warmup_ms)
                        (_, fwd), (_, bwd), (t_fb, fb) = intervals[-3:]
                        rows.append((d, n, backend, warmup_ms, c, fb, (t0, time.time())))
                        print(f"d {d} N {n} {backend} warmup_ms {warmup_ms:g}: fwd {c.fwd_ms:.2f} bwd {c.bwd_ms:.2f} "
                              f"f+b {c.fwd_bwd_ms:.2f}; f+b runs " + " ".join(f"{x:.2f}" for x in fb), flush=True)
                        bench._free(dev)
        time.sleep(0.3)
    finally:
        smi.terminate()
    print("\nmedian ms of the bench's measurements; f+b runs: fastest and slowest timed run; clock: SM MHz sampled "
          "during the whole cell (min / median / max)\n")
    print("| d | N | backend | --warmup-ms | fwd | bwd | fwd + bwd | f+b | f+b runs | SM MHz |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for d, n, backend, warmup_ms, c, fb, (t0, t1) in rows:
        mhz = clocks(smi_log, t0, t1)
        clock = f"{min(mhz)} / {statistics.median(mhz):.0f} / {max(mhz)}" if mhz else "-"
        print(f"| {d} | {n} | {backend} | {warmup_ms:g} | {c.fwd_ms:.2f} | {c.bwd_ms:.2f} | "
              f"{c.fwd_ms + c.bwd_ms:.2f} | {c.fwd_bwd_ms:.2f} | {min(fb):.2f}-{max(fb):.2f} | {clock} |")


if __name__ == "__main__":
    main()
