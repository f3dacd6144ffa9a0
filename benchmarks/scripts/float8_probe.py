"""Float8 numerics of a real fit: PrecisionInspector's float8 statistics over a few inspected steps (GPU, 8.9+).

    python benchmarks/scripts/float8_probe.py --config configs/2.7B_bf16_fp8.yaml --steps 31 --every 10

Trains ``--steps`` steps of the config (random token ids) with ``PrecisionInspector(step=every, float8_every=every,
reference=False)`` and prints, per inspected step, the largest saturated and underflow fractions and relative error
over every float8 layer and GEMM, the layers over the threshold, and the five layers with the largest saturated
fraction at the last inspected step. The TensorBoard logs (``precision/float8`` table) go to ``--logdir``.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger

from lmtrain.analysis.float8 import flagged
from lmtrain.callbacks import PrecisionInspector
from lmtrain.cli_config import resolve_args
from lmtrain.data import LMDataModule
from lmtrain.module import LMModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/2.7B_bf16_fp8.yaml")
    parser.add_argument("--steps", type=int, default=31)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--threshold", type=float, default=1e-3)
    parser.add_argument("--logdir", default="logs/float8_probe")
    args = parser.parse_args()
    resolved = resolve_args(["--config", args.config])
    config = resolved.model_config()
    pl.seed_everything(0)
    module = LMModule(**{k: v for k, v in resolved.model.items() if v is not None})
    data = LMDataModule(source="synthetic", batch_size=int(resolved.data["batch_size"]),
                        context_length=config.context_length, vocab_size=config.vocab_size,
                        train_batches=args.steps + 10, val_batches=1)
    inspector = PrecisionInspector(step=args.every, float8_every=args.every, reference=False,
                                   float8_threshold=args.threshold)
    steps: list[tuple[int, float, float, float, list[str]]] = []

    class Collect(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object,
                               batch: object, batch_idx: int) -> None:
            result = inspector.float8_result
            if result and (not steps or steps[-1][0] != result[0].step):
                worst = [s.worst() for s in result]
                steps.append((result[0].step, max(w[0] for w in worst), max(w[1] for w in worst),
                              max(g.rel_err for s in result for g in s.gemms.values()),
                              flagged(result, args.threshold)))

    trainer = pl.Trainer(accelerator="gpu", devices=1, precision=resolved.precision, max_steps=args.steps,
                         logger=TensorBoardLogger(args.logdir, name="float8"), callbacks=[inspector, Collect()],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, data)
    print(f"\n{args.config}: float8 {config.float8}, {len(inspector.float8_result)} float8 layers inspected\n")
    print("| step | max saturated | max underflow | max rel. err | layers over threshold |")
    print("| ---: | ---: | ---: | ---: | --- |")
    for step, sat, under, rel, over in steps:
        print(f"| {step} | {sat:.3g} | {under:.3g} | {rel:.3g} | {', '.join(over) or '-'} |")
    top = sorted(inspector.float8_result, key=lambda s: -s.worst()[0])[:5]
    print("\nlargest saturated fractions at the last inspected step: "
          + ", ".join(f"{s.layer} {s.worst()[0]:.3g}" for s in top))


if __name__ == "__main__":
    main()
