"""Pieces of the benchmarks that compare settings (``bench callbacks``, ``bench overhead``).

Both run a baseline first and last, so that a drift of the device between the first and the last run shows,
and both keep the model on the GPU after each fit.
"""

from __future__ import annotations

from typing import Any


def baseline(first: float | None, last: float | None) -> tuple[float | None, float | None]:
    """(mean of the two baseline runs, drift of the last from the first in %) from their median step times.

    With one of the two missing (failed, not run), the other is the baseline and the drift is None.
    """
    values = [v for v in (first, last) if v]
    mean = sum(values) / len(values) if values else None
    drift = 100.0 * (last / first - 1.0) if first and last else None
    return mean, drift


def keep_on_device_strategy() -> Any:
    """A single-GPU strategy whose teardown frees the optimizer state and leaves the model on the GPU.

    Lightning's default teardown copies the model and the optimizer state to the host (about 40 GB for the
    2.7B model with AdamW: tens of seconds per run), which a benchmark does not need. Nothing is measured
    during teardown, so timings are unaffected.
    """
    import torch
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class _KeepOnDevice(SingleDeviceStrategy):
        def teardown(self) -> None:
            for optimizer in self.optimizers:
                optimizer.state.clear()
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()

    return _KeepOnDevice(device=torch.device("cuda", torch.cuda.current_device()))
