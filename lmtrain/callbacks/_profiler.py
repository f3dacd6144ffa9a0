"""The torch.profiler session behind KernelShare: start on a schedule, phase ranges, export, stop and clean up."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator

import torch

from lmtrain.annotate import disable_ranges, enable_ranges
from lmtrain.callbacks._common import request_cupti_teardown


@contextlib.contextmanager
def kineto_markers_dropped() -> Iterator[None]:
    """Drop the ``USDT: ... profiler_start`` / ``profiler_stop`` lines that the profiler's C++ library (Kineto)
    writes to standard error whenever a trace starts or stops, whatever its log level: markers for tracing tools,
    meaningless in a training log. Everything else written to standard error meanwhile is passed on afterwards.

    Works on file descriptor 2 (Kineto writes there directly, past ``sys.stderr``) and only for the length of the
    block. Kineto's own setting for it (``KINETO_LOG_LEVEL`` above 5) would also silence its errors, and is read
    once per process.
    """
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no standard error to filter
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().splitlines(keepends=True) if not line.startswith(b"USDT:")]
            if kept:
                os.write(2, b"".join(kept))


@contextlib.contextmanager
def ranges_only() -> Iterator[bool]:
    """While the block runs, a profiler that starts its trace records, on the host, only ``record_function`` ranges
    (``RecordScope.USER_SCOPE``: lmtrain's phases, ``ProfilerStep#``, the optimizer's step) and no operators; CUDA
    activities (kernels, copies, the runtime's launch calls) come from CUPTI as before. Yields False, changing
    nothing, where this torch has no scoped ``_enable_profiler``.

    Recording an operator costs the host a few microseconds, with ``with_flops`` more: an eager 2.7B step launches
    thousands, and profiled with them it ran 1.75x as long as an ordinary step on an H200 (its GPU then waits for the
    host, which it does not in an ordinary step). The scopes are an argument of ``_enable_profiler`` that
    ``torch.profiler`` does not expose; it is passed by wrapping the function for the length of the block.
    """
    import torch.autograd.profiler as autograd_profiler

    enable = getattr(autograd_profiler, "_enable_profiler", None)
    scope = getattr(getattr(torch._C, "_profiler", None), "RecordScope", None)
    if enable is None or scope is None or not hasattr(scope, "USER_SCOPE"):
        yield False
        return

    def scoped(config: object, activities: object, scopes: object = None) -> None:
        enable(config, activities, {scope.USER_SCOPE})

    autograd_profiler._enable_profiler = scoped
    try:
        yield True
    finally:
        autograd_profiler._enable_profiler = enable


class _Profile(torch.profiler.profile):
    """``torch.profiler.profile`` whose start, steps (where its schedule starts and stops the trace) and stop leave
    out Kineto's ``USDT`` marker lines (:func:`kineto_markers_dropped`); with ``operators=False``, its trace holds
    ranges but no operators (:func:`ranges_only`)."""

    def __init__(self, *args: object, operators: bool = True, **kwargs: object) -> None:
        self.operators = operators
        #: Whether the host side of the trace was restricted to ranges (False with operators, or where this torch
        #: cannot restrict it).
        self.ranges_only = False
        super().__init__(*args, **kwargs)

    def start_trace(self) -> None:
        if self.operators:
            super().start_trace()
            return
        with ranges_only() as restricted:
            super().start_trace()
        self.ranges_only = restricted

    def start(self) -> None:
        with kineto_markers_dropped():
            super().start()

    def step(self) -> None:
        with kineto_markers_dropped():
            super().step()

    def stop(self) -> None:
        with kineto_markers_dropped():
            super().stop()


def add_op_flops(path: str, flops: dict[int, int]) -> int:
    """Write each operator's FLOPs into the Chrome trace at ``path`` as its ``flops`` argument, where
    ``lmtrain.analysis.ceilings`` reads them; returns how many operators got one.

    Args:
        path: an exported (uncompressed) Chrome trace.
        flops: the operator's ``External id`` (its profiler event's ``correlation_id()``) -> its FLOPs.
    """
    with open(path) as f:
        trace = json.load(f)
    written = 0
    for event in trace.get("traceEvents", []):
        args = event.get("args")
        if event.get("cat") == "cpu_op" and args and args.get("External id") in flops:
            args["flops"] = flops[args["External id"]]
            written += 1
    if written:
        with open(path, "w") as f:
            json.dump(trace, f)
    return written


class ProfilerSession:
    """One ``torch.profiler.profile`` run over ``warmup`` + ``active`` steps, exporting its Chrome trace to a
    temporary folder (:attr:`trace_path` once the active steps are done), with ``lmtrain.annotate``'s profiler
    ranges on while it runs and one phase ``record_function`` range open at a time.

    Args:
        cuda: record CUDA activities too (else CPU operators only).
        warmup: profiled steps discarded before the active ones.
        active: steps recorded in the trace.
        record_shapes: record operator input shapes.
        release_cupti: tear CUPTI down when the trace stops (``request_cupti_teardown``).
        device: the CUDA device to synchronise before the first recorded step when there is no warm-up.
        with_flops: the profiler's FLOP estimate of matrix products and convolutions (``with_flops``), written into
            the exported trace as a ``flops`` argument of those operators (:func:`add_op_flops`: the profiler
            computes them but its Chrome export leaves them out). Needs ``operators``.
        operators: record every operator on the host side of the trace; False: ranges only (:func:`ranges_only`;
            :attr:`ranges_only` says whether this torch could restrict it).
    """

    def __init__(self, cuda: bool, warmup: int, active: int, record_shapes: bool, release_cupti: bool,
                 device: torch.device | None = None, with_flops: bool = False, operators: bool = True) -> None:
        if not operators and (with_flops or record_shapes):
            raise ValueError("with_flops and record_shapes are facts of operators: they need operators=True")
        from torch.profiler import ProfilerActivity, schedule

        self.with_flops = with_flops
        #: Once the trace has stopped: its host side holds ranges only, no operators (``operators=False`` on a torch
        #: that allows it).
        self.ranges_only = False
        self.trace_path: str | None = None
        self._open: list[torch.profiler.record_function] = []
        self._tmpdir: str | None = tempfile.mkdtemp(prefix="lmtrain_kernels_")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda and release_cupti:
            request_cupti_teardown()
        if cuda and warmup == 0:
            torch.cuda.synchronize(device)
        enable_ranges(nvtx=False, profiler=True)
        self._ranges_on = True
        self.prof: torch.profiler.profile | None = _Profile(
            activities=activities, on_trace_ready=self._export, record_shapes=record_shapes, with_flops=with_flops,
            schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1), operators=operators)
        self.prof.start()

    def _export(self, prof: torch.profiler.profile) -> None:
        path = os.path.join(self._tmpdir, "trace.json")
        prof.export_chrome_trace(path)
        if self.with_flops:
            # The raw events, not prof.events(): building those FunctionEvents takes about 20 times as long
            add_op_flops(path, {e.correlation_id(): e.flops() for e in prof.profiler.kineto_results.events()
                                if e.flops()})
        self.trace_path = path

    def open_range(self, name: str) -> None:
        """Open phase range ``name`` (closing the one open)."""
        self.close_ranges()
        self._open.append(torch.profiler.record_function(name))
        self._open[-1].__enter__()

    def close_ranges(self) -> None:
        while self._open:
            self._open.pop().__exit__(None, None, None)

    def finish(self) -> str | None:
        """Stop the profiler (exporting the trace when the schedule is complete); returns the trace's path."""
        self.close_ranges()
        if self.prof is not None:
            prof, self.prof = self.prof, None
            with contextlib.suppress(Exception):  # stopping a profiler that already stopped itself
                prof.stop()
            self.ranges_only = bool(getattr(prof, "ranges_only", False))
        return self.trace_path

    def close(self) -> None:
        """Stop everything and delete the temporary trace (safe to call more than once)."""
        self.finish()
        if self._ranges_on:
            disable_ranges(nvtx=False, profiler=True)
            self._ranges_on = False
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
