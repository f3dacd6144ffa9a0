"""KernelShare: category rules on real kernel names, exact shares from records and traces, a real Trainer.fit."""

from __future__ import annotations

import csv
import os
import re
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from tb import images, scalars, texts

from lmtrain.analysis.kernels import (
    CATEGORIES,
    _self_times,
    gpu_timeline,
    records_from_trace,
    short_name,
    softmax_matmul_flop_ratio,
    summarize,
    timeline_text,
)
from lmtrain.annotate import active_requests
from lmtrain.callbacks import CudaSyncTimer, KernelShare
from lmtrain.callbacks.kernel_share import request_cupti_teardown
from lmtrain.data import LMDataModule
from lmtrain.errors import LmtrainError
from lmtrain.module import LMModule


def test_short_name() -> None:
    name = ("void at::native::elementwise_kernel<(int)128, (int)2, void at::native::gpu_kernel_impl_nocast<at::"
            "native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float>>>(at::"
            "TensorIteratorBase &, const T1 &)::[lambda(int) (instance 1)]>(int, T3)")
    assert short_name(name, 200) == ("elementwise_kernel<128, 2, void gpu_kernel_impl_nocast<BinaryFunctor<float, "
                                     "float, float, MulFunctor<float>>>(TensorIteratorBase &, const T1 &)::"
                                     "[lambda (instance 1)]>")
    assert short_name("cutlass::Kernel2<cutlass_80_simt_sgemm_128x32_8x5_nt_align1>(T1::Params)") == \
        "Kernel2<cutlass_80_simt_sgemm_128x32_8x5_nt_align1>"
    assert short_name("ampere_sgemm_128x64_tn") == "ampere_sgemm_128x64_tn"
    assert short_name("x" * 100, 10) == "x" * 9 + "…"


def test_flop_ratio() -> None:
    assert softmax_matmul_flop_ratio(64) == 5 / 256


# -- summarize: exact values from synthetic records -------------------------------------------------

GEMM, EW, SM, OPT, CP = "ampere_sgemm_128x64_tn", "vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", \
    "softmax_warp_forward<float>", "multi_tensor_apply_kernel<FusedAdamMathFunctor>", "Memcpy HtoD"

RECORDS = [
    # two steps; forward: GEMM 60+60, softmax 10 (stage softmax), elementwise 30 (stage qk) -> 160 per 2 steps
    (GEMM, "forward", 30.0, "attention/qk_matmul"), (GEMM, "forward", 30.0, None), (SM, "forward", 5.0,
                                                                                    "attention/softmax"),
    (EW, "forward", 15.0, "attention/qk_matmul"),
    (GEMM, "forward", 30.0, "attention/qk_matmul"), (GEMM, "forward", 30.0, None), (SM, "forward", 5.0,
                                                                                    "attention/softmax"),
    (EW, "forward", 15.0, "attention/qk_matmul"),
    # backward: GEMM 200, elementwise 100
    (GEMM, "backward", 100.0), (GEMM, "backward", 100.0), (EW, "backward", 50.0), (EW, "backward", 50.0),
    # optimizer: 40; outside: a memcpy of 20
    (OPT, "optimizer", 20.0), (OPT, "optimizer", 20.0), (CP, "outside", 10.0), (CP, "outside", 10.0),
]


def test_summarize_exact() -> None:
    s = summarize(RECORDS, steps=2)
    assert s.phase_us == {"forward": 80.0, "backward": 150.0, "optimizer": 20.0, "outside": 10.0}
    assert s.total_us == 260.0
    assert s.share("gemm", "forward") == 60.0 / 80.0
    assert s.share("gemm", "backward") == 100.0 / 150.0
    assert s.share("gemm", "optimizer") == 0.0
    assert s.share("gemm") == 160.0 / 260.0
    assert s.share("optimizer") == 20.0 / 260.0
    assert s.share("copy") == 10.0 / 260.0
    assert s.share("attention") == 0.0
    for scope in ("forward", "backward", "optimizer", "outside", "step"):
        assert sum(s.category_us[scope].values()) == pytest.approx(s.scope_us(scope))
    top = s.top("forward")
    assert (top.name, top.calls, top.total_us, top.share, top.mean_us) == (GEMM, 2.0, 60.0, 0.75, 30.0)
    assert s.top("step").name == GEMM and s.top("step").calls == 3.0
    assert s.top("forward", exclude=("gemm",)).name == EW
    assert s.stage_us == {"attention/qk_matmul": {"gemm": 30.0, "elementwise": 15.0},
                          "attention/softmax": {"softmax": 5.0}}
    m = s.metrics(head_dim=64)
    assert m["kernels/total_ms_per_step"] == 0.26
    assert m["kernels/forward_ms_per_step"] == 0.08
    assert m["kernels/gemm_share_forward"] == 0.75
    assert m["kernels/gemm_share_step"] == 160.0 / 260.0
    assert m["kernels/gemm_share_optimizer"] == 0.0
    assert m["kernels/top_kernel_share_forward"] == 0.75
    assert m["kernels/top_kernel_calls_forward"] == 2.0
    assert m["kernels/top_kernel_calls_step"] == 3.0
    assert m["kernels/attn_softmax_ms_per_step"] == 0.005
    assert m["kernels/attn_matmul_ms_per_step"] == 0.045
    assert m["kernels/attn_softmax_to_matmul_time_ratio"] == 5.0 / 45.0
    assert m["kernels/attn_softmax_to_matmul_flop_ratio"] == 5 / 256
    assert sum(m[f"kernels/{c}_share_step"] for c in CATEGORIES) == pytest.approx(1.0)


def test_summarize_leaves_out_what_does_not_exist() -> None:
    m = summarize([(GEMM, "forward", 10.0)]).metrics(head_dim=64)
    assert "kernels/gemm_share_backward" not in m and "kernels/attn_softmax_ms_per_step" not in m
    assert m["kernels/gemm_share_forward"] == 1.0
    with pytest.raises(ValueError):
        summarize([], steps=0)


# -- trace parsing: a synthetic Kineto trace -----------------------------------------------------------


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args: int) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


def test_records_from_trace_phases_by_launch_time() -> None:
    trace = {"traceEvents": [
        _x("user_annotation", "ProfilerStep#3", 0, 1000),
        _x("user_annotation", "forward", 10, 300),
        _x("user_annotation", "attention/softmax", 100, 50),
        _x("cpu_op", "aten::mm", 20, 20, **{"External id": 7}),
        _x("cuda_runtime", "cudaLaunchKernel", 25, 5, correlation=101),
        _x("cuda_runtime", "cudaLaunchKernel", 120, 5, correlation=102),
        _x("user_annotation", "backward", 320, 400),
        # the autograd device thread (tid 2) launches backward kernels while the main thread waits
        _x("cuda_driver", "cuLaunchKernelEx", 400, 5, tid=2, correlation=103),
        _x("user_annotation", "optimizer", 730, 200),
        _x("cuda_runtime", "cudaLaunchKernel", 800, 5, correlation=104),
        _x("cuda_runtime", "cudaMemcpyAsync", 950, 5, correlation=105),
        # GPU side (times later than the launches)
        _x("kernel", GEMM, 200, 40, tid=7, correlation=101, **{"External id": 7}),
        _x("kernel", SM, 250, 10, tid=7, correlation=102),
        _x("kernel", GEMM, 500, 100, tid=7, correlation=103),
        _x("kernel", OPT, 900, 30, tid=7, correlation=104),
        _x("gpu_memcpy", CP, 960, 4, tid=8, correlation=105),
        _x("kernel", OPT, 1, 7, tid=7, correlation=99),  # launched before the window: left out
        _x("kernel", EW, 980, 3, tid=7, correlation=106, **{"External id": 7}),  # no launch: its op stands in
        _x("gpu_user_annotation", "forward", 200, 60, tid=7),  # GPU-side spans are not kernels
    ]}
    tr = records_from_trace(trace, "cuda")
    assert tr.steps == 1 and tr.step_wall_us == 1000.0
    assert (tr.unattributed_kernels, tr.unattributed_us) == (1, 7.0)
    # (name, phase, us, stage, category override): no Optimizer.step range in this trace, so no override
    assert sorted(tr.records) == sorted([
        (GEMM, "forward", 40.0, None, None), (SM, "forward", 10.0, "attention/softmax", None),
        (GEMM, "backward", 100.0, None, None), (OPT, "optimizer", 30.0, None, None), (CP, "outside", 4.0, None, None),
        (EW, "forward", 3.0, None, None),
    ])
    # GPU timeline of the attributed activities: 200 .. 983, busy 187, gaps charged to the phase they end in
    tl = tr.timeline
    assert tl is not None and (tl.span_us, tl.busy_us, tl.idle_us) == (783.0, 187.0, 596.0)
    assert tl.idle_by_phase_us == {"forward": 26.0, "backward": 240.0, "optimizer": 300.0, "outside": 30.0}
    assert tl.largest_gaps[:2] == [(300.0, "optimizer", GEMM, OPT), (240.0, "backward", SM, GEMM)]


def test_gpu_timeline_overlap_and_steps() -> None:
    # two streams overlap (counted once); 2 steps halve the per-step values; an activity inside another adds no gap
    tl = gpu_timeline([(0, 100, "a", "forward"), (50, 100, "b", "forward"), (60, 10, "c", "forward"),
                       (200, 50, "d", "backward"), (400, 100, "e", "optimizer")], steps=2)
    assert tl is not None
    assert (tl.span_us, tl.busy_us, tl.idle_us) == (250.0, 150.0, 100.0)
    assert tl.idle_by_phase_us == {"backward": 25.0, "optimizer": 75.0}
    assert tl.largest_gaps == [(150.0, "optimizer", "d", "e"), (50.0, "backward", "b", "d")]
    assert gpu_timeline([]) is None
    text = timeline_text(tl)
    assert "0.25 ms per step" in text and "(60.0%)" in text and "waited 0.10 ms per step" in text
    assert text.index("before optimizer kernels") < text.index("backward kernels")  # largest first


def test_records_from_trace_cpu_self_time() -> None:
    trace = {"traceEvents": [
        _x("user_annotation", "forward", 0, 100),
        _x("cpu_op", "aten::linear", 10, 50),
        _x("cpu_op", "aten::t", 12, 3),
        _x("cpu_op", "aten::addmm", 20, 30),
        _x("cpu_op", "aten::copy_", 25, 10),
        _x("cpu_op", "aten::add", 200, 5),
    ]}
    tr = records_from_trace(trace, "cpu")
    assert sorted(tr.records) == sorted([
        ("aten::linear", "forward", 17.0, None, None), ("aten::t", "forward", 3.0, None, None),
        ("aten::addmm", "forward", 20.0, None, None), ("aten::copy_", "forward", 10.0, None, None),
        ("aten::add", "outside", 5.0, None, None),
    ])
    assert len(_self_times([])) == 0


def test_optimizer_category_from_the_optimizer_step_range() -> None:
    # Lightning runs forward and backward inside the optimizer's closure, so torch.optim's Optimizer.step range
    # encloses them; only the work outside forward and backward is the optimizer's. CPU AdamW runs per-parameter
    # aten::mul_ / aten::lerp_ that the name rules call elementwise: the range makes them optimizer work, so the
    # optimizer category's share matches the optimizer phase's time (it was 0 before).
    trace = {"traceEvents": [
        _x("user_annotation", "Optimizer.step#AdamW.step", 0, 400),
        _x("user_annotation", "forward", 0, 100),
        _x("cpu_op", "aten::mul", 10, 50),
        _x("user_annotation", "backward", 100, 100),
        _x("cpu_op", "aten::mul", 110, 40),
        _x("user_annotation", "optimizer", 300, 100),
        _x("cpu_op", "aten::mul_", 310, 20),
        _x("cpu_op", "aten::lerp_", 340, 10),
        _x("cpu_op", "aten::mul_", 500, 5),  # after the optimizer step (logging): the name decides
    ]}
    tr = records_from_trace(trace, "cpu")
    assert sorted(tr.records) == sorted([
        ("aten::mul", "forward", 50.0, None, None), ("aten::mul", "backward", 40.0, None, None),
        ("aten::mul_", "optimizer", 20.0, None, "optimizer"), ("aten::lerp_", "optimizer", 10.0, None, "optimizer"),
        ("aten::mul_", "outside", 5.0, None, None),
    ])
    summary = summarize(tr.records, tr.steps)
    metrics = summary.metrics()
    assert metrics["kernels/optimizer_ms_per_step"] == pytest.approx(30.0 / 1e3)
    assert metrics["kernels/optimizer_share_step"] == pytest.approx(30.0 / 125.0)
    assert metrics["kernels/elementwise_share_step"] == pytest.approx(95.0 / 125.0)
    # one name, two categories: two rows
    assert sorted((r.name, r.category) for r in summary.rows["step"] if r.name == "aten::mul_") == [
        ("aten::mul_", "elementwise"), ("aten::mul_", "optimizer")]


# -- the callback through a real Trainer.fit on CPU ---------------------------------------------------


class RequestProbe(Callback):
    """Records lmtrain.annotate's (nvtx, profiler) requests at the start of each training batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []
        self.folders: set[str] = set()  # the profiler sessions' temporary trace folders

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.seen.append(active_requests())
        session = next((cb._prof for cb in trainer.callbacks if isinstance(cb, KernelShare)), None)
        if session is not None:
            self.folders.add(session._tmpdir)


def _fit(tmp_path: Path, callbacks: list, max_steps: int, optimizer_in_backward: bool = False) -> pl.Trainer:
    pl.seed_everything(0)
    model = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                     attention="naive", warmup_steps=1, optimizer_in_backward=optimizer_in_backward)
    data = LMDataModule(source="synthetic", batch_size=2, context_length=16, vocab_size=64, train_batches=20,
                        val_batches=1)
    trainer = pl.Trainer(max_steps=max_steps, precision="32-true", accelerator="cpu", devices=1,
                         logger=TensorBoardLogger(str(tmp_path), name="ks"), callbacks=callbacks,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, data)
    return trainer


def test_kernel_share_fit_on_cpu(tmp_path: Path) -> None:
    cb, probe = KernelShare(wait=1, warmup=1, active=2, export_trace=True), RequestProbe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(tmp_path, [cb, probe], max_steps=5)
    assert sum("CPU operator self time" in str(w.message) for w in caught) == 1
    # annotate ranges on for the window's batches only (warmup + active), back to zero after it
    assert probe.seen == [(0, 0), (0, 1), (0, 1), (0, 1), (0, 0)]
    assert active_requests() == (0, 0)
    assert cb._prof is None and len(probe.folders) == 1 and not any(map(os.path.exists, probe.folders))
    logged = scalars(trainer.log_dir)
    for tag in ("kernels/total_ms_per_step", "kernels/forward_ms_per_step", "kernels/backward_ms_per_step",
                "kernels/optimizer_ms_per_step", "kernels/gemm_share_forward", "kernels/gemm_share_backward",
                "kernels/gemm_share_step", "kernels/top_kernel_share_forward", "kernels/top_kernel_calls_step",
                "kernels/attn_softmax_ms_per_step", "kernels/attn_matmul_ms_per_step",
                "kernels/attn_softmax_to_matmul_flop_ratio", "kernels/step_wall_ms", "kernels/busy_share",
                *[f"kernels/{c}_share_step" for c in CATEGORIES]):
        assert tag in logged, tag
    # logged at the window's last step (global_step while it ran): wait + warmup + active - 1
    assert [step for step, _ in logged["kernels/gemm_share_step"]] == [cb.wait + cb.warmup + cb.active - 1]
    # the optimizer category holds the optimizer's own work (CPU AdamW: per-parameter ops in Optimizer.step)
    assert logged["kernels/optimizer_share_step"][0][1] > 0
    for tag in [t for t in logged if t.startswith("kernels/")]:  # documented (phase, category: as placeholders)
        generic = re.sub(r"^kernels/(forward|backward|optimizer|outside)_ms", "kernels/{phase}_ms", tag)
        generic = re.sub(rf"^kernels/({'|'.join(CATEGORIES)})_share_step$", "kernels/{category}_share_step", generic)
        assert f"    {generic}  " in KernelShare.__doc__, tag
    timeline = [t for t in logged if t.startswith(("breakdown/", "idle/", "launch/"))]
    assert {"breakdown/compute_share", "breakdown/idle_share", "idle/host_wait_share", "launch/bound"} <= set(timeline)
    for tag in timeline:  # documented too (phase, kind, idle cause as placeholders)
        generic = re.sub(r"^breakdown/(forward|backward|optimizer|outside)_", "breakdown/{phase}_", tag)
        generic = re.sub(r"(compute|communication|memory|idle)_(ms_per_step|share)$", r"{kind}_\2", generic)
        generic = re.sub(r"^idle/(host_wait|kernel_wait|other)_", "idle/{host_wait,kernel_wait,other}_", generic)
        assert generic in KernelShare.__doc__, tag
    assert logged["kernels/attn_softmax_to_matmul_flop_ratio"][0][1] == pytest.approx(5 / (4 * 16))
    assert logged["kernels/gemm_share_forward"][0][1] > 0  # aten::mm / aten::bmm self time
    assert sum(logged[f"kernels/{c}_share_step"][0][1] for c in CATEGORIES) == pytest.approx(1.0, abs=1e-5)
    assert cb.summary is not None and cb.summary.steps == 2
    text = texts(trainer.log_dir)
    assert "GEMM share" in text["kernels/report"][0] and "Softmax vs matmul" in text["kernels/report"][0]
    assert {"kernels/table_step", "kernels/table_forward", "kernels/table_backward"} <= set(text)
    assert "kernels/categories" in images(trainer.log_dir)
    rows = list(csv.DictReader(open(Path(trainer.log_dir) / "kernel_table.csv")))
    assert {r["scope"] for r in rows} >= {"step", "forward", "backward", "optimizer"}
    assert all(r["category"] in CATEGORIES for r in rows)
    assert (Path(trainer.log_dir) / "kernel_trace.json.gz").stat().st_size > 0
    # validate after the fit runs setup/teardown("validate"): the fit's results stay
    summary, report = cb.summary, cb.report
    trainer.validate(trainer.lightning_module, datamodule=trainer.datamodule, verbose=False)
    assert cb.summary is summary and cb.report == report


def test_kernel_share_window_not_reached(tmp_path: Path) -> None:
    cb = KernelShare(wait=1, warmup=1, active=5)
    with pytest.warns(UserWarning, match="ends after the last step of max_steps 3") as caught:
        trainer = _fit(tmp_path, [cb], max_steps=3)
    assert len([w for w in caught if "max_steps" in str(w.message)]) == 1  # said at setup, once
    assert active_requests() == (0, 0) and cb._prof is None
    assert not any(t.startswith("kernels/") for t in scalars(trainer.log_dir))


def test_kernel_share_warns_when_window_never_starts(tmp_path: Path) -> None:
    cb = KernelShare(wait=10, warmup=1, active=1)
    with pytest.warns(UserWarning, match="ends after the last step of max_steps 2") as caught:
        trainer = _fit(tmp_path, [cb], max_steps=2)
    assert not [w for w in caught if "stopped after" in str(w.message)]  # not again at the end
    assert cb.summary is None and active_requests() == (0, 0)
    assert not any(t.startswith("kernels/") for t in scalars(trainer.log_dir))


class RaiseAtBatch(Callback):
    """Raises in the forward of training batch ``index`` (a crash in the middle of a step)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if batch_idx == self.index:
            def boom(module, args):  # noqa: ANN001, ANN202
                raise RuntimeError("boom")

            pl_module.model.blocks[0].mlp.register_forward_pre_hook(boom)


def test_kernel_share_cleans_up_when_a_step_raises(tmp_path: Path) -> None:
    cb = KernelShare(wait=1, warmup=1, active=2)
    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, [cb, RaiseAtBatch(2)], max_steps=5)
    assert active_requests() == (0, 0) and not torch.autograd._profiler_enabled()
    assert cb._prof is None and cb.summary is None


def test_kernel_share_rejects_bad_window(tmp_path: Path) -> None:
    with pytest.raises(LmtrainError, match="KernelShare.active"):
        _fit(tmp_path, [KernelShare(active=0)], max_steps=1)


# -- GPU ------------------------------------------------------------------------------------------------


class StepEvents(Callback):
    """CUDA events around every training batch."""

    def __init__(self) -> None:
        self.events: list[list[torch.cuda.Event]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.events.append([torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)])
        self.events[-1][0].record()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.events[-1][1].record()


@pytest.mark.gpu
@pytest.mark.gpu_alone  # kernel time against step time: another process's kernels would lengthen only the steps
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_share_cuda(tmp_path: Path) -> None:
    pl.seed_everything(0)
    # Big enough per kernel that the GPU, not Python, sets the pace of a step.
    model = LMModule(size="small", vocab_size=10_000, context_length=512, num_layers=4, attention="naive",
                     warmup_steps=1)
    data = LMDataModule(source="synthetic", batch_size=32, context_length=512, vocab_size=10_000, train_batches=20,
                        val_batches=1)
    cb, timer = KernelShare(wait=2, warmup=1, active=3), StepEvents()
    trainer = pl.Trainer(max_steps=10, precision="bf16-mixed", accelerator="gpu", devices=1,
                         logger=TensorBoardLogger(str(tmp_path), name="ks"), callbacks=[cb, timer],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, data)
    torch.cuda.synchronize()
    s = cb.summary
    assert s is not None
    assert s.share("gemm", "forward") > 0.1 and any(r.category == "gemm" for r in s.rows["step"])
    for scope in ("forward", "backward", "optimizer", "step"):
        assert sum(s.share(c, scope) for c in CATEGORIES) == pytest.approx(1.0, abs=1e-6)
    assert s.stage_us["attention/softmax"]["softmax"] > 0
    # the window's own steps (3, 4 and 5: after 2 waiting and 1 warm-up): the kernels of one step cannot take
    # longer than the step, and with the GPU to itself (gpu_alone) they fill at least half of it
    window = sorted(a.elapsed_time(b) for a, b in timer.events[3:6])
    step_ms = window[len(window) // 2]
    kernel_ms = s.total_us / 1e3
    assert kernel_ms <= 1.05 * step_ms
    assert kernel_ms >= 0.5 * step_ms, (kernel_ms, step_ms)
    # with_flops (the default): the matrix products' FLOPs reach the GEMM kernels
    logged = scalars(trainer.log_dir)
    assert logged["roofline/gemm_tflops"][0][1] > 1.0 and "roofline/model_tflops" in logged


def test_request_cupti_teardown_respects_a_set_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    assert request_cupti_teardown() is True and os.environ["TEARDOWN_CUPTI"] == "1"
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")  # e.g. set by torch.compile with CUDA graphs
    assert request_cupti_teardown() is False and os.environ["TEARDOWN_CUPTI"] == "0"


def test_the_profilers_flops_reach_the_trace_and_the_gemm_roofline(tmp_path: Path) -> None:
    """A real CPU profile with ``with_flops``: the exported trace carries each matrix product's FLOPs (2 M N K),
    and ``achieved`` charges them to the kernels that operator launched (a CPU trace has no kernels: one GEMM
    kernel with the operator's External id, as CUPTI records it, stands in for the GPU's)."""
    import json

    from lmtrain.analysis.ceilings import achieved
    from lmtrain.callbacks._profiler import ProfilerSession

    a, b = torch.randn(24, 40), torch.randn(40, 16)
    session = ProfilerSession(cuda=False, warmup=0, active=1, record_shapes=False, release_cupti=False,
                              with_flops=True)
    try:
        torch.mm(a, b)
        session.prof.step()
        trace = json.loads(Path(session.finish()).read_text())
    finally:
        session.close()
    mm = [e for e in trace["traceEvents"] if e.get("cat") == "cpu_op" and e["name"] == "aten::mm"]
    assert [e["args"]["flops"] for e in mm] == [2 * 24 * 40 * 16]
    trace["traceEvents"].append({"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 0, "dur": 10,
                                 "args": {"External id": mm[0]["args"]["External id"], "correlation": 1}})
    assert achieved(trace)["gemm"] == pytest.approx({"us": 10.0, "flops": 2 * 24 * 40 * 16})


def test_kernel_share_measures_no_ceilings_off_a_cuda_device(tmp_path: Path) -> None:
    """The ceilings come from the module's own device: on a CPU nothing is measured, nothing cached, said once."""
    cache = tmp_path / "ceilings.json"
    cb = KernelShare(ceilings=str(cache))
    module = torch.nn.Linear(2, 2)
    module.device = torch.device("cpu")
    with pytest.warns(UserWarning, match="no ceilings measured on cpu") as caught:
        assert cb._ceilings(module) is None and cb._ceilings(module) is None
    assert len(caught) == 1 and not cache.exists()
    assert KernelShare(ceilings={"copy_gbps": 1.0})._ceilings(module) == {"copy_gbps": 1.0}


class LateTimer(CudaSyncTimer):
    """Reads each step one step late, as the events mode does on a GPU: its last step is read in its own
    on_train_end (on a CPU the host clock's steps are read at once)."""

    ending = False

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.ending = True
        super().on_train_end(trainer, pl_module)

    def _collect(self, trainer, lag: int) -> None:  # noqa: ANN001
        super()._collect(trainer, 0 if self.ending else max(lag, 1))


class SteppedClockTimer(LateTimer):
    """LateTimer on a host-clock stand-in: each mark of step s moves the clock on by (s + 1) x 250 ms, so step s
    lasts exactly (s + 1) x 1000 ms and every step's time names the step."""

    now = 0.0

    def _mark(self, name: str) -> None:
        if self._batch is not None:
            self.now += (self._current.index + 1) * 0.25
            self._batch[name] = self.now


@pytest.mark.parametrize("timer_first", [True, False])
def test_the_step_comparison_reads_every_step_of_the_timer_in_either_order(tmp_path: Path, timer_first: bool) -> None:
    """Wherever KernelShare stands in the callbacks list, the comparison has every step the timer measured (it reads
    its last steps in its own on_train_end): kernels/timer_step_ms is the timer's final median over the unprofiled
    steps 1 and 2 ((2000 + 3000) / 2 ms), and kernels/timer_profiled_step_ms its mean over the window's active steps
    4 and 5 exactly ((5000 + 6000) / 2 ms; the window is steps 3..5), which its statistics leave out; the ratios
    divide by them. A timer standing after KernelShare ends step 5 only after KernelShare has closed its window:
    then step 5 counts less that closing time (close_ms; this clock stand-in never counted it, so the mean shows it
    taken out). On a CPU there is no GPU span: no span ratio."""
    cb = KernelShare(wait=3, warmup=1, active=2, chart=False)
    timer = SteppedClockTimer(warmup_steps=1, print_summary=False)
    trainer = _fit(tmp_path, [timer, cb] if timer_first else [cb, timer], max_steps=6)
    assert timer.step_ms(range(8)) == {s: (s + 1) * 1000.0 for s in range(6)}  # warm-up and excluded steps too
    assert set(timer.excluded_steps) == {3, 4, 5} and timer.summary()["step_ms"]["count"] == 2
    wall, busy = cb.metrics["kernels/step_wall_ms"], cb.metrics["kernels/total_ms_per_step"]
    assert cb.close_ms > 0
    profiled = (5000.0 + 6000.0 - (0.0 if timer_first else cb.close_ms)) / 2
    expected = {"kernels/timer_step_ms": 2500.0, "kernels/timer_profiled_step_ms": profiled,
                "kernels/busy_to_timer_profiled": busy / profiled, "kernels/wall_to_timer_profiled": wall / profiled,
                "kernels/busy_to_timer_step": busy / 2500.0, "kernels/wall_to_timer_step": wall / 2500.0}
    assert cb.comparison == pytest.approx(expected)
    logged = scalars(trainer.log_dir)
    assert {tag: logged[tag][0][1] for tag in expected} == pytest.approx(expected)
    assert all(logged[tag][0][0] == 5 for tag in expected)  # at the fit's last step
    assert "kernels/span_to_timer_profiled" not in logged
    text = texts(trainer.log_dir)["kernels/step_comparison"][0]
    rows = {cells[0]: cells[1:] for line in text.splitlines()
            if line.startswith("|") and (cells := [c.strip() for c in line.strip("|").split("|")])}
    assert rows["timer step, median of 2 unprofiled steps"] == ["2500.000", "1.000", f"{2500 / profiled:.3f}"]
    assert rows["timer step, mean of 2 profiled steps"] == [f"{profiled:.3f}", f"{profiled / 2500:.3f}", "1.000"]
    assert ("is taken less the" in text) is not timer_first


class FailingAnalysis(KernelShare):
    """KernelShare whose analysis fails; records what ``_report`` was given."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.reported: list[object] = []

    def _analyze(self, trainer, pl_module, path):  # noqa: ANN001, ANN202
        raise RuntimeError("broken trace")

    def _report(self, trainer, found):  # noqa: ANN001, ANN202
        self.reported.append(found)
        super()._report(trainer, found)


def test_a_failed_analysis_still_reaches_the_ranks_collective(tmp_path: Path) -> None:
    """The analysis fails on the profiling rank: one warning names the error, the fit goes on, and ``_report``
    (which holds the gather every rank takes part in) still runs, with nothing to report."""
    cb = FailingAnalysis(wait=1, warmup=1, active=1, chart=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(tmp_path, [cb], max_steps=4)
    said = [str(w.message) for w in caught if "could not be analysed" in str(w.message)]
    assert said == ["KernelShare: rank 0: the profiled window could not be analysed (RuntimeError: broken trace); "
                    "this rank reports nothing."]
    assert cb.reported == [None] and cb._prof is None and trainer.global_step == 4
    assert not any(t.startswith("kernels/") for t in scalars(trainer.log_dir))


def test_kernel_share_under_the_in_backward_optimizer(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With ``model.optimizer_in_backward`` setup says once that the updates fall in the backward phase, and the
    summary has no optimizer phase."""
    cb = KernelShare(wait=1, warmup=1, active=1, chart=False)
    with caplog.at_level("INFO"):
        _fit(tmp_path, [cb], max_steps=3, optimizer_in_backward=True)
    assert sum("optimizer's updates run inside the backward pass" in r.getMessage() for r in caplog.records) == 1
    assert set(cb.summary.phase_us) == {"forward", "backward", "outside"}


class Perturbs(Callback):
    """A callback that perturbs the timing of ``steps`` (the duck-typed ``perturbs_timing`` protocol)."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def perturbs_timing(self, step: int) -> bool:
        return step in self.steps


def test_kernel_share_moves_its_window_past_steps_other_callbacks_perturb(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Window 1-3 (wait 1, warm-up 1, active 2) would report steps 2 and 3, which another callback perturbs; 2-4
    would report 3. The first window whose active steps are clear is 3-5 (its warm-up, step 3, may be perturbed),
    said in one line; its active steps 4 and 5 are the ones reported."""
    cb = KernelShare(wait=1, warmup=1, active=2, chart=False)
    with caplog.at_level("INFO"):
        trainer = _fit(tmp_path, [Perturbs({2, 3}), cb], max_steps=8)
    moved = [r.getMessage() for r in caplog.records if "instead of" in r.getMessage()]
    assert moved == ["KernelShare: profiling steps 3-5 instead of steps 1-3 (wait=3, not 1): Perturbs perturb the "
                     "timing of a step it would report. Set wait to place the window."]
    assert cb._active_steps == range(4, 6) and cb.summary.steps == 2
    assert [step for step, _ in scalars(trainer.log_dir)["kernels/gemm_share_step"]] == [5]


def test_kernel_share_keeps_its_window_when_a_perturbed_step_is_only_a_warm_up(tmp_path: Path,
                                                                               caplog: pytest.LogCaptureFixture
                                                                               ) -> None:
    cb = KernelShare(wait=1, warmup=1, active=2, chart=False)
    with caplog.at_level("INFO"):
        _fit(tmp_path, [Perturbs({1}), cb], max_steps=5)
    assert not [r for r in caplog.records if "instead of" in r.getMessage()]
    assert cb._active_steps == range(2, 4)


def test_kernel_share_does_not_ask_the_module_whose_graph_window_is_not_known_yet() -> None:
    """Before its graphs are captured, a CUDA-graph module's ``in_window`` answers yes for every step: the window is
    placed by the callbacks' answers alone (``timing_perturbed_by(..., module=False)``): it neither moves nor
    warns."""
    from types import SimpleNamespace

    from lmtrain.callbacks._common import StepWindow, timing_perturbed_by

    class Uncaptured:
        def in_window(self, step: int) -> bool:
            return True

    cb = KernelShare()
    cb._window = StepWindow(cb.wait, cb.warmup + cb.active)
    trainer = SimpleNamespace(callbacks=[cb, Perturbs({0})], lightning_module=Uncaptured(), max_steps=20)
    assert timing_perturbed_by(trainer, 6, exclude=cb) == ["Uncaptured"]
    assert timing_perturbed_by(trainer, 6, exclude=cb, module=False) == []
    assert timing_perturbed_by(trainer, 0, exclude=cb, module=False) == ["Perturbs"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cb.on_fit_start(trainer, None)
    assert (cb._window.start_step, cb._window.num_steps) == (5, 3)


def test_kernel_share_keeps_its_window_when_no_clear_one_fits(tmp_path: Path) -> None:
    cb = KernelShare(wait=1, warmup=1, active=2, chart=False)
    with pytest.warns(UserWarning, match="no later window of the same length ends before max_steps") as caught:
        _fit(tmp_path, [Perturbs({2, 3, 4, 5}), cb], max_steps=6)
    assert sum("Perturbs perturb" in str(w.message) for w in caught) == 1
    assert cb._active_steps == range(2, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("timer_first", [True, False])
def test_the_step_comparison_on_a_gpu_in_either_order(tmp_path: Path, timer_first: bool) -> None:
    """The timer's events are read a step late on a GPU: kernels/timer_step_ms still holds every summarised step."""
    pl.seed_everything(0)
    model = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                     attention="naive", warmup_steps=1)
    data = LMDataModule(source="synthetic", batch_size=2, context_length=16, vocab_size=64, train_batches=20,
                        val_batches=1)
    cb, timer = KernelShare(wait=1, warmup=1, active=1, chart=False), CudaSyncTimer(warmup_steps=0,
                                                                                     print_summary=False)
    trainer = pl.Trainer(max_steps=6, precision="32-true", accelerator="gpu", devices=1,
                         logger=TensorBoardLogger(str(tmp_path), name="ks"),
                         callbacks=[timer, cb] if timer_first else [cb, timer], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0)
    trainer.fit(model, data)
    final = timer.summary()["step_ms"]
    assert final["count"] == 6 - 2
    assert "median of 4 unprofiled steps" in texts(trainer.log_dir)["kernels/step_comparison"][0]
    assert cb.comparison["kernels/timer_step_ms"] == pytest.approx(final["median"])
    # the profiled (active) step 2 against the timer's events on that same step, read a step late; a timer after
    # KernelShare counted the window's closing in it, taken out again
    profiled = timer.step_ms([2])[2] - (0.0 if timer_first else cb.close_ms)
    assert cb.comparison["kernels/timer_profiled_step_ms"] == pytest.approx(profiled)
    span = cb.metrics["kernels/gpu_busy_ms_per_step"] + cb.metrics["kernels/gpu_idle_ms_per_step"]
    assert cb.comparison["kernels/span_to_timer_profiled"] == pytest.approx(span / profiled)
    assert scalars(trainer.log_dir)["kernels/span_to_timer_profiled"][0][1] == pytest.approx(span / profiled)


def test_without_operators_the_trace_holds_ranges_and_no_operators() -> None:
    """``operators=False`` (KernelShare's default on a GPU): the profiler records the ranges (steps, phases) and no
    operator; with operators, both. Checked with a real CPU profile (the scopes are the host side's, alike on
    both devices)."""
    import json

    from lmtrain.callbacks._profiler import ProfilerSession

    found = {}
    for operators in (True, False):
        session = ProfilerSession(cuda=False, warmup=1, active=1, record_shapes=False, release_cupti=False,
                                  operators=operators)
        try:
            a = torch.randn(16, 16)
            for _ in range(2):
                session.open_range("forward")
                torch.mm(a, a).relu()
                session.close_ranges()
                session.prof.step()
            trace = json.loads(Path(session.finish()).read_text())
            restricted = session.ranges_only
        finally:
            session.close()
        names = {(e.get("cat"), e.get("name")) for e in trace["traceEvents"] if e.get("ph") == "X"}
        found[operators] = (restricted, names)
    restricted, names = found[False]
    assert restricted and ("user_annotation", "forward") in names and ("user_annotation", "ProfilerStep#1") in names
    assert not any(cat == "cpu_op" for cat, _ in names)
    restricted, names = found[True]
    assert not restricted and ("cpu_op", "aten::mm") in names and ("user_annotation", "forward") in names


def test_operator_facts_need_operators() -> None:
    from lmtrain.callbacks._profiler import ProfilerSession
    from lmtrain.errors import LmtrainError

    assert KernelShare().with_flops is False and KernelShare(operators=True).with_flops is True
    for name in ("with_flops", "record_shapes"):
        with pytest.raises(LmtrainError, match=rf"KernelShare.{name}: .* Fix: set operators: true"):
            KernelShare(**{name: True}).check_arguments()
        KernelShare(operators=True, **{name: True}).check_arguments()
    with pytest.raises(ValueError, match="need operators=True"):
        ProfilerSession(cuda=False, warmup=0, active=1, record_shapes=False, release_cupti=False, with_flops=True,
                        operators=False)


def test_kernel_share_window_is_clear_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank marks which window starts are clear for it and the window takes the first start clear on all:
    here rank 0 is perturbed at steps 6 and 8, the other rank at 6 and 7. Start 7 (the other rank's first clear one)
    would report step 8, which rank 0's callback perturbs; both agree on start 8, reporting step 9."""
    from types import SimpleNamespace

    import lmtrain.callbacks.kernel_share as kernel_share
    from lmtrain.callbacks._common import StepWindow

    seen: list[list[float]] = []

    def gather(trainer: object, marks: list[float]) -> list[list[float]]:
        seen.append(list(marks))
        other = [float(start + 1 not in {6, 7}) for start in range(5, 5 + len(marks))]
        return [list(marks), other]

    monkeypatch.setattr(kernel_share, "gather_values", gather)
    cb = KernelShare(wait=5, warmup=1, active=1, chart=False)
    cb._window = StepWindow(cb.wait, cb.warmup + cb.active)
    trainer = SimpleNamespace(callbacks=[Perturbs({6, 8}), cb], max_steps=100)
    cb.on_fit_start(trainer, None)
    assert seen[0][:5] == [0.0, 1.0, 0.0, 1.0, 1.0]  # rank 0's own marks for starts 5..9
    assert cb._window.start_step == 8
