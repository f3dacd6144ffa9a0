"""Peak memory of ``python -m lmtrain prepare`` on a generated corpus (default 200 MB of text).

    python benchmarks/prepare_memory.py                    # 200 MB, vocabulary 10,000
    python benchmarks/prepare_memory.py --mb 50 --keep     # keep the corpus and the output folder

Writes ``--files`` text files of Zipf-distributed made-up words (a 30,000-word vocabulary, newlines as
frequent "words"), runs ``prepare`` on them in a subprocess and reports the child's peak resident set size
(``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss``), its wall time and the token count. The corpus
generation runs in this process, before the child starts, so it is not part of the child's peak.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def write_corpus(root: Path, total_mb: float, files: int, seed: int = 0) -> int:
    """``files`` text files of about ``total_mb`` MB together; returns their total size in bytes."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = np.array(["".join(rng.choice(letters, size=rng.integers(2, 11))) for _ in range(30_000)] + ["\n"],
                     dtype=object)
    ranks = np.arange(1, len(words) + 1, dtype=np.float64)
    probs = 1.0 / ranks**1.1
    probs[-1] = probs.sum() / 11  # a line end about every 12 words
    probs /= probs.sum()
    per_file = int(total_mb * 1e6 / files)
    root.mkdir(parents=True, exist_ok=True)
    total = 0
    for f in range(files):
        with open(root / f"part_{f:03d}.txt", "w", encoding="utf-8") as out:
            written = 0
            while written < per_file:
                text = " ".join(words[rng.choice(len(words), size=200_000, p=probs)]) + "\n"
                out.write(text)
                written += len(text)
        total += (root / f"part_{f:03d}.txt").stat().st_size
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0, help="corpus size in MB (200)")
    parser.add_argument("--files", type=int, default=20, help="number of files (20)")
    parser.add_argument("--vocab-size", type=int, default=10_000, help="BPE vocabulary (10000)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder and print it")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="prepare-memory-"))
    try:
        size = write_corpus(work / "corpus", args.mb, args.files)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "lmtrain", "prepare", "--input", str(work / "corpus"),
                        "--out", str(work / "out"), "--vocab-size", str(args.vocab_size)], check=True)
        wall = time.perf_counter() - start
        peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # Linux: KiB
        manifest = json.loads((work / "out" / "dataset.json").read_text())
        result = {"corpus_bytes": size, "files": args.files, "vocab_size": manifest["vocab_size"],
                  "tokens": manifest["tokens"], "peak_rss_mib": round(peak_mib, 1), "wall_s": round(wall, 1)}
        print(json.dumps(result))
        print(f"prepare of {size / 1e6:.1f} MB: peak RSS {peak_mib:.0f} MiB, {wall:.0f} s, "
              f"{manifest['tokens']:,} tokens")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
