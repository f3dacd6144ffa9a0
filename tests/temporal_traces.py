"""Constructed ``torch.profiler`` Chrome traces for the temporal breakdown, laid out as Kineto writes them (CPU
events on the process's thread, GPU activities on ``pid`` 0 with ``stream`` and ``correlation`` args, the launch
call with the same correlation id, ``ProfilerStep#`` ranges and their GPU annotations, sub-µs timestamps).

Each builder's docstring draws its timeline (µs; launch call start in brackets) and the figures that follow from
it, which ``test_analysis_temporal_cases.py`` expects of lmtrain exactly and ``test_analysis_temporal_hta.py``
compares with HolisticTraceAnalysis. The times are multiples of 0.25 µs, exact in binary floating point.
"""

from __future__ import annotations

GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1_execute_segment_k_off_kernel"
ADD = "triton_poi_fused_add_0"
NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
MEMCPY = "Memcpy HtoD (Pinned -> Device)"
MEMSET = "Memset (Device)"
_GPU_CAT = {MEMCPY: "gpu_memcpy", MEMSET: "gpu_memset"}
_API = {MEMCPY: "cudaMemcpyAsync", MEMSET: "cudaMemsetAsync", NCCL: "cudaLaunchKernelExC"}
_CPU_PID = _CPU_TID = 4242


class TraceBuilder:
    """Appends Kineto-shaped events; :meth:`trace` returns the ``{"traceEvents": [...]}`` object."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._correlation = 100

    def _next(self) -> int:
        self._correlation += 1
        return self._correlation

    def step(self, n: int, ts: float, dur: float, gpu: tuple[float, float] | None = None) -> TraceBuilder:
        """``ProfilerStep#n`` on the CPU over ``[ts, ts + dur)``, with its GPU annotation over ``gpu`` (start, end)."""
        self.events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": _CPU_PID,
                            "tid": _CPU_TID, "ts": ts, "dur": dur, "args": {"External id": n}})
        if gpu is not None:
            self.events.append({"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{n}", "pid": 0,
                                "tid": 7, "ts": gpu[0], "dur": gpu[1] - gpu[0], "args": {"External id": n}})
        return self

    def _activity(self, name: str, ts: float, dur: float, stream: int, correlation: int, **args: object) -> None:
        self.events.append({"ph": "X", "cat": _GPU_CAT.get(name, "kernel"), "name": name, "pid": 0, "tid": stream,
                            "ts": ts, "dur": dur, "args": {"device": 0, "stream": stream,
                                                           "correlation": correlation, **args}})

    def launch(self, at: float | None, name: str, ts: float, dur: float, stream: int = 7) -> TraceBuilder:
        """One activity launched by a runtime call starting at ``at`` (None: the call is not in the trace)."""
        correlation = self._next()
        if at is not None:
            self.events.append({"ph": "X", "cat": "cuda_runtime", "name": _API.get(name, "cudaLaunchKernel"),
                                "pid": _CPU_PID, "tid": _CPU_TID, "ts": at, "dur": 2.5,
                                "args": {"cbid": 211, "correlation": correlation}})
        self._activity(name, ts, dur, stream, correlation)
        return self

    def graph(self, at: float, kernels: list[tuple[str, float, float]], stream: int = 7) -> TraceBuilder:
        """One ``cudaGraphLaunch`` at ``at`` replaying ``kernels`` (name, start, duration): one correlation id."""
        correlation = self._next()
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": _CPU_PID,
                            "tid": _CPU_TID, "ts": at, "dur": 5.0, "args": {"cbid": 311, "correlation": correlation}})
        for node, (name, ts, dur) in enumerate(kernels):
            self._activity(name, ts, dur, stream, correlation, **{"graph id": 1, "graph node id": node + 1})
        return self

    def trace(self) -> dict:
        return {"schemaVersion": 1, "traceEvents": self.events}


def eager() -> dict:
    """Two eager steps on stream 7: gaps after short kernels, queued work, late launches, a memcpy and a memset.

    ``ProfilerStep#1`` [0, 100), ``#2`` [100, 200) on the CPU; step 2's GPU annotation ends at 205.5, so the last
    step ends there (the later end) and the kernel launched at 203 belongs to the window::

        2.5-8.5 gemm (launch not in the trace: still running from before the window; left out)
        10.25-30.25 gemm (1)
        31.5-33 add (5)          gap 1.25, queued: kernel wait
        34.25-35 add (6)         gap 1.25 after a 1.5 µs kernel, queued: kernel wait
        55-60 gemm (50)          gap 20, launched after the GPU went idle: host wait
        60.5-64.5 memcpy (52)    gap 0.5: kernel wait
        65-65.75 memset (53)     gap 0.5: kernel wait
        120-130 gemm (54)        gap 54.25, queued long before: other
        150-170 gemm (140)       gap 20: host wait
        204-205.5 add (203)      gap 34: host wait
        211-215 gemm (210: after the last step; left out)

    Span 195.25; compute 58.75, memory 4.75, idle 131.75: host wait 74, kernel wait 3.5, other 54.25 (one stream,
    so per stream the same).
    """
    b = TraceBuilder().step(1, 0.0, 100.0, (10.25, 130.0)).step(2, 100.0, 100.0, (150.0, 205.5))
    b.launch(None, GEMM, 2.5, 6.0)
    b.launch(1.0, GEMM, 10.25, 20.0).launch(5.0, ADD, 31.5, 1.5).launch(6.0, ADD, 34.25, 0.75)
    b.launch(50.0, GEMM, 55.0, 5.0).launch(52.0, MEMCPY, 60.5, 4.0).launch(53.0, MEMSET, 65.0, 0.75)
    b.launch(54.0, GEMM, 120.0, 10.0)
    b.launch(140.0, GEMM, 150.0, 20.0).launch(203.0, ADD, 204.0, 1.5).launch(210.0, GEMM, 211.0, 4.0)
    return b.trace()


def graphed(kernels: int = 20) -> dict:
    """Two steps, each one eager gemm then one CUDA graph replay of ``kernels`` 2.5 µs kernels 1.25 µs apart.

    Step 1: gemm 5-15 (1); ``cudaGraphLaunch`` at 20, its kernels from 25 every 3.75 µs (the last 96.25-98.75).
    Step 2: ``cudaGraphLaunch`` at 101 (after the GPU went idle at 98.75), kernels from 110 (the last
    181.25-183.75)::

        gap 15-25: host wait 10 (the graph was launched at 20)
        19 gaps of 1.25 inside each replay: kernel wait (the one launch precedes them all)
        gap 98.75-110: host wait 11.25

    Span 178.75; compute 110 (10 + 40 x 2.5), idle 68.75: host wait 21.25, kernel wait 47.5.
    """
    b = TraceBuilder().step(1, 0.0, 100.0, (5.0, 98.75)).step(2, 100.0, 100.0, (110.0, 183.75))
    b.launch(1.0, GEMM, 5.0, 10.0)
    for at, first in ((20.0, 25.0), (101.0, 110.0)):
        b.graph(at, [(GEMM if i % 2 else ADD, first + 3.75 * i, 2.5) for i in range(kernels)])
    return b.trace()


def overlapped() -> dict:
    """Two steps: compute on stream 7, an all-reduce per step on stream 20 that compute partly hides.

    Step 1: gemm 10.5-40.5 (1), NCCL 20.5-60.5 (2), gemm 42.5-52.5 (3).
    Step 2: gemm 110.5-130.5 (101), NCCL 125.5-145.5 (102), gemm 155.5-165.5 (150).

    Span 155; compute 70, communication 25 (of 60 NCCL time, 35 under compute: overlap 35/60), idle 60.
    Whole GPU: gaps 60.5-110.5 and 145.5-155.5, both ended by late launches: host wait 60.
    Per stream: stream 7 waits 2 (kernel wait), 58 and 25 (host wait); stream 20 waits 65 (host wait):
    host wait 148, kernel wait 2.
    """
    b = TraceBuilder().step(1, 0.0, 100.0, (10.5, 60.5)).step(2, 100.0, 100.0, (110.5, 165.5))
    b.launch(1.0, GEMM, 10.5, 30.0).launch(2.0, NCCL, 20.5, 40.0, stream=20).launch(3.0, GEMM, 42.5, 10.0)
    b.launch(101.0, GEMM, 110.5, 20.0).launch(102.0, NCCL, 125.5, 20.0, stream=20)
    b.launch(150.0, GEMM, 155.5, 10.0)
    return b.trace()


def sub_microsecond_memset() -> dict:
    """One step: gemm 0.25-9.5 (0), a 0.5 µs memset 10.25-10.75 (1) alone between kernels, gemm 12.5-20 (2).

    Span 19.75; compute 16.75, memory 0.5, idle 2.5: kernel wait 0.75 + 1.75. HTA's inward rounding to whole µs
    makes the memset [11, 10]: a negative duration, and HTA's non-compute time negative.
    """
    b = TraceBuilder().step(1, 0.0, 25.0, (0.25, 20.0))
    b.launch(0.0, GEMM, 0.25, 9.25).launch(1.0, MEMSET, 10.25, 0.5).launch(2.0, GEMM, 12.5, 7.5)
    return b.trace()


def parallel_branches() -> dict:
    """One step, one graph whose two branches overlap on the launch stream: 10-20, 15-25, then 27-30 (launch 1).

    Span 20, compute 18, idle 2: kernel wait 2, measured from the latest end (25). HTA measures each gap from the
    previous kernel's end: 15 - 20 = -5 and 27 - 25 = 2, a kernel wait of -3.
    """
    b = TraceBuilder().step(1, 0.0, 40.0, (10.0, 30.0))
    b.graph(1.0, [(GEMM, 10.0, 10.0), (ADD, 15.0, 10.0), (GEMM, 27.0, 3.0)])
    return b.trace()


def triton_launch_operators() -> dict:
    """``eager`` plus the CPU operators that launch inductor's Triton kernels, as a compiled model's trace holds
    them: ``cpu_op`` events named like the kernel, on the CPU thread, with a ``stream`` argument. Two of them,
    40-50 and 141-146 (both while the GPU is idle).

    They are CPU time, so lmtrain's figures are ``eager``'s. HTA takes every event with a stream for GPU work and
    counts them as compute: 15 µs more compute and 15 less idle.
    """
    trace = eager()
    for ts, dur in ((40.0, 10.0), (141.0, 5.0)):
        trace["traceEvents"].append({"ph": "X", "cat": "cpu_op", "name": ADD, "pid": _CPU_PID, "tid": _CPU_TID,
                                     "ts": ts, "dur": dur, "args": {"External id": 900 + int(ts), "stream": 7,
                                                                    "kernel_backend": "triton"}})
    return trace
