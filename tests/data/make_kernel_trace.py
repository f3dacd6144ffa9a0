"""Regenerate ``kernel_trace_cpu_tiny.json.gz``: a real CPU ``torch.profiler`` Chrome trace of a tiny model.

KernelShare profiles one warm-up and two active steps of a 2-layer model (naive attention, so the attention
stage ranges are in the trace) and exports the trace it analysed. Run from the repository root:
``python tests/data/make_kernel_trace.py``.
"""

from __future__ import annotations

import gzip
import json
import tempfile
import warnings
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger

from lmtrain.callbacks import KernelShare
from lmtrain.data import LMDataModule
from lmtrain.module import LMModule

OUT = Path(__file__).with_name("kernel_trace_cpu_tiny.json.gz")


def main() -> None:
    warnings.simplefilter("ignore")
    pl.seed_everything(0)
    module = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                      attention="naive", warmup_steps=1)
    data = LMDataModule(source="synthetic", batch_size=2, context_length=16, vocab_size=64, train_batches=20,
                        val_batches=1)
    with tempfile.TemporaryDirectory() as tmp:
        cb = KernelShare(wait=1, warmup=1, active=2, export_trace=True, chart=False)
        trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=TensorBoardLogger(tmp, name="trace"),
                             callbacks=[cb], enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
        trainer.fit(module, data)
        with gzip.open(Path(trainer.log_dir) / "kernel_trace.json.gz", "rt") as f:
            trace = json.load(f)
    # Nothing of this machine in the file: the temporary path and the host name go.
    trace["traceName"], trace["host_name"] = "trace.json", "host"
    with gzip.open(OUT, "wt") as f:
        json.dump(trace, f, separators=(",", ":"))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
