"""The host time each callback's hooks take per training step, measured inside the fit that runs them.

A Lightning profiler (``--trainer.profiler hook_cost.HookCost --trainer.profiler.path FILE``, this folder on
``PYTHONPATH``) that times every ``[Callback]<name>.<hook>`` action Lightning profiles and writes, when the fit ends,
per callback the median over steps of its hooks' host time per step (and the maximum, which the callbacks' own
window steps set). A step is the interval from one ``run_training_batch`` to the next: a callback's
``on_train_batch_end`` of step k counts with step k+1's ``on_train_batch_start`` and the hooks inside step k+1.

Why: on a host-bound step two fits (with the callbacks and without) differ by more than the callbacks can cost (the
host's speed varies between processes by several percent), so their step times cannot show a 1% overhead. The
hooks' own host time, measured in one process, bounds what the callbacks add to a step outside their windows: a
host-bound step is longer by at most that time, a GPU-bound one by less. Lightning's other profiled actions are not
timed (only their names are read), so the profiler itself adds two ``perf_counter`` calls per hook.

    python -m lmtrain fit --config configs/small_bf16.yaml --trainer.max_steps 40 \
        --trainer.profiler hook_cost.HookCost --trainer.profiler.path hooks.json \
        --trainer.callbacks+=lmtrain.callbacks.CudaSyncTimer ...
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from lightning.pytorch.profilers import Profiler

CALLBACK = "[Callback]"
STEP = "run_training_batch"


class HookCost(Profiler):
    """Host time of each callback's hooks per training step (see the module docstring).

    Args:
        path: JSON file written at the fit's end (rank 0's name; other ranks add ``.rank{r}``).
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, path: str | Path = "hook_cost.json", clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__()
        self.path = Path(path)
        self._clock = clock
        self._started: dict[str, float] = {}
        self._step = -1  # hooks before the first training batch (setup, on_fit_start) are not a step
        #: callback -> step -> seconds
        self.seconds: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))

    def start(self, action_name: str) -> None:
        if action_name == STEP:
            self._step += 1
        elif action_name.startswith(CALLBACK) and self._step >= 0:
            self._started[action_name] = self._clock()

    def stop(self, action_name: str) -> None:
        began = self._started.pop(action_name, None)
        if began is not None:
            callback = action_name[len(CALLBACK):].rsplit(".", 1)[0]
            self.seconds[callback][self._step] += self._clock() - began

    def report(self) -> dict[str, dict[str, float]]:
        """Per callback: ``median_us`` and ``max_us`` of its hooks' host time per step over every step the fit ran
        (a step in which none of its hooks ran counts as 0), and ``steps``."""
        steps = self._step + 1
        out = {}
        for callback, per_step in self.seconds.items():
            values = [per_step.get(s, 0.0) * 1e6 for s in range(steps)]
            out[callback] = {"median_us": statistics.median(values), "max_us": max(values), "steps": steps}
        return out

    def summary(self) -> str:
        return "\n".join(f"{name}: median {r['median_us']:.1f} us per step, max {r['max_us']:.1f} us"
                         for name, r in self.report().items())

    def teardown(self, stage: str | None) -> None:
        if stage == "fit" and self._step >= 0:
            rank = self._local_rank or 0
            path = self.path if rank == 0 else self.path.with_name(f"{self.path.name}.rank{rank}")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.report(), indent=1) + "\n")
        super().teardown(stage)
