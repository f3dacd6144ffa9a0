"""First-step time of compiled configs, run twice each over a fresh compile cache (lmtrain.compile_cache).

    python benchmarks/scripts/compile_cache_timing.py [--configs configs/small_bf16_fast.yaml ...] [--steps 6]
        [--json out.json]

For each config: a fresh cache folder, then two ``python -m lmtrain fit`` runs of ``--steps`` steps with
``--compile_cache`` pointing at it (logs in a temporary folder, nothing kept). The first run compiles and fills the
cache; the second should load everything (``compile cache: hit``). Prints each run's ``first step:`` line and its
wall time as a Markdown table (and writes the rows as JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = ("configs/small_bf16_fast.yaml", "configs/2.7B_bf16_fast.yaml")
FIRST_STEP = re.compile(r"^first step: ([\d.]+) s \(compile cache: (.*)\)$", re.MULTILINE)


def run_twice(config: str, steps: int, root: Path) -> list[dict]:
    cache = root / f"cache_{Path(config).stem}"
    rows = []
    for run in (1, 2):
        command = [sys.executable, "-m", "lmtrain", "fit", "--config", config, "--trainer.max_steps", str(steps),
                   "--compile_cache", str(cache), "--trainer.logger.init_args.save_dir", str(root / "logs"),
                   "--trainer.enable_progress_bar", "false"]
        start = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        wall = time.perf_counter() - start
        output = result.stdout + result.stderr
        match = FIRST_STEP.search(output)
        rows.append({"config": config, "run": run, "status": result.returncode,
                     "first_step_s": float(match.group(1)) if match else None,
                     "cache": match.group(2) if match else None, "wall_s": round(wall, 1)})
        if result.returncode != 0 or match is None:
            print(output[-4000:], file=sys.stderr)
        print(f"{config} run {run}: {match.group(0) if match else 'no first-step line'} (wall {wall:.1f} s)",
              flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the fast configs capture at step 4)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lmtrain-compile-cache-") as root:
        rows = [row for config in args.configs for row in run_twice(config, args.steps, Path(root))]
    print("\n| config | run | first step (s) | compile cache | wall (s) | exit |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['run']} | {r['first_step_s']} | {r['cache']} | {r['wall_s']} | {r['status']} |")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["status"] == 0 and r["first_step_s"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
