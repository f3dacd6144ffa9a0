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


class _Profile(torch.profiler.profile):
    """``torch.profiler.profile`` whose start, steps (where its schedule starts and stops the trace) and stop leave
    out Kineto's ``USDT`` marker lines (:func:`kineto_markers_dropped`)."""

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
            computes them but its Chrome export leaves them out).
    """

    def __init__(self, cuda: bool, warmup: int, active: int, record_shapes: bool, release_cupti: bool,
                 device: torch.device | None = None, with_flops: bool = False) -> None:
        from torch.profiler import ProfilerActivity, schedule

        self.with_flops = with_flops
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
            schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1))
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
