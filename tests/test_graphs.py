"""``LMModule(cuda_graphs=True)`` on a CPU, with ``EmulatedStepGraph`` standing in for the CUDA graph.

The stand-in runs the captured step function at each "replay", so these tests check everything around the graph:
when the module captures, that a replayed step updates exactly once and counts as an optimizer step (global_step,
schedule, logged rate), that eager and graphed runs train identically, and how the callbacks see replayed steps.
The real capture runs in ``tests/test_graphs_gpu.py`` on a GPU.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from fitting import cpu_fit

from lmtrain.callbacks import CudaSyncTimer, PrecisionInspector
from lmtrain.errors import LmtrainError
from lmtrain.graphs import EmulatedStepGraph, GraphedOptimizer, WholeStepGraph
from lmtrain.module import LMModule

TINY = dict(size="tiny", vocab_size=97, context_length=16, warmup_steps=2, decay_steps=8, lr=3e-3)


class Emulated(LMModule):
    graph_class = EmulatedStepGraph


class Record(pl.Callback):
    """Loss, logged rate and global_step at every batch end."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.steps: list[int] = []
        self.lrs: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        self.steps.append(trainer.global_step)
        self.lrs.append(float(trainer.callback_metrics["train/lr"]))


def _fit(module: LMModule, steps: int = 8, callbacks: list[pl.Callback] | None = None, **kw: Any) -> Record:
    torch.manual_seed(0)
    record = Record()
    cpu_fit(module, steps, batch=3, context=16, vocab=97, callbacks=[record, *(callbacks or [])], **kw)
    return record


def _pair(**options: Any) -> tuple[LMModule, LMModule, Record, Record]:
    torch.manual_seed(1)
    eager = LMModule(**TINY, **options)
    torch.manual_seed(1)
    graphed = Emulated(**TINY, cuda_graphs=True, cuda_graph_warmup=2, **options)
    return eager, graphed, _fit(eager), _fit(graphed)


@pytest.mark.parametrize("options", [{}, {"optimizer_in_backward": True}], ids=["adamw", "in-backward"])
def test_graphed_steps_train_exactly_like_eager_steps(options: dict[str, Any]) -> None:
    eager, graphed, a, b = _pair(**options)
    assert graphed.graphed_step.graph.captures == 1 and graphed.graphed_step.capture_step == 2
    assert b.steps == a.steps == list(range(1, 9))  # each replay is one optimizer step for Lightning
    assert b.lrs == pytest.approx(a.lrs, rel=1e-12)  # the schedule steps once per step, warm-up and cosine
    assert len(set(a.lrs)) > 4
    assert b.losses == pytest.approx(a.losses, rel=1e-6, abs=1e-7)
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7, msg=name)
    # no gradients left behind by the captured step's buffers
    assert all(p.grad is None for p in graphed.parameters())


def test_graphed_optimizer_checkpoints_are_the_inner_optimizers() -> None:
    _, graphed, _, _ = _pair()
    opt = graphed.trainer.optimizers[0]
    assert isinstance(opt, GraphedOptimizer)
    state = opt.state_dict()
    assert state == opt.inner.state_dict() and len(state["state"]) == len(list(graphed.parameters()))
    fresh = torch.optim.AdamW([{"params": g["params"]} for g in opt.inner.param_groups], lr=1.0)
    wrapped = GraphedOptimizer(fresh)
    wrapped.load_state_dict(state)
    assert wrapped.param_groups is fresh.param_groups
    assert wrapped.param_groups[0]["lr"] == state["param_groups"][0]["lr"]


class Untimed(EmulatedStepGraph):
    """The stand-in without marks inside the "graph", as where timing events cannot be captured."""

    def __init__(self, timed: bool = True) -> None:
        super().__init__(timed=False)


class EmulatedUntimed(LMModule):
    graph_class = Untimed


class Numbered(EmulatedStepGraph):
    """The stand-in with exact marks that depend on the replay: replay ``r`` has a forward of r + 1 ms, a backward of
    2 (r + 1) ms and an optimizer step of 0.5 ms, so a step given another replay's marks shows it."""

    OFFSETS_MS = {"start": (0, 0.0), "before_backward": (1, 0.0), "after_backward": (3, 0.0),
                  "before_opt": (3, 0.0), "end": (3, 0.5)}

    def mark(self, name: str) -> None:
        if self._recording is not None:
            per_replay, fixed = self.OFFSETS_MS[name]
            self._recording[name] = 10.0 * self.replays + (per_replay * (self.replays + 1) + fixed) / 1000


class EmulatedNumbered(LMModule):
    graph_class = Numbered


def test_timer_reports_the_phases_recorded_inside_replayed_steps() -> None:
    timer = CudaSyncTimer(warmup_steps=0, print_summary=False)
    module = EmulatedNumbered(**TINY, cuda_graphs=True, cuda_graph_warmup=3)
    _fit(module, steps=8, callbacks=[timer])
    by_step = {row["step"]: row for row in timer.step_times}
    phases = {"step", "forward_ms", "backward_ms", "optimizer_ms", "step_ms"}
    assert set(by_step[1]) == phases  # eager warm-up: the hooks' marks
    capture = module.graphed_step.capture_step
    assert capture == 3 and module.graphed_step.graph.replays == 5
    for step in range(capture, 8):  # replayed: each step its own replay's marks; the step from the hooks' marks
        r = step - capture
        row = by_step[step]
        assert set(row) == phases
        assert (row["forward_ms"], row["backward_ms"], row["optimizer_ms"]) == pytest.approx((r + 1, 2 * (r + 1), 0.5))
    # the eager steps, the capture step and the second graph's first launch are reported apart, as the module's window
    assert {s: w for s, w in timer.excluded_steps.items()} == {s: ["EmulatedNumbered"] for s in range(5)}
    assert timer.summary()["step_ms"]["count"] == 3 and timer.summary()["forward_ms"]["count"] == 3


def test_the_module_window_ends_after_each_graphs_first_launch() -> None:
    """Timed: two graphs by turns, so the step after the capture launches the second one for the first time (in the
    window too); untimed: one graph, the window ends with the capture step."""
    timed = Emulated(**TINY, cuda_graphs=True, cuda_graph_warmup=2)
    untimed = EmulatedUntimed(**TINY, cuda_graphs=True, cuda_graph_warmup=2)
    _fit(timed, steps=5)
    _fit(untimed, steps=5)
    assert len(timed.graphed_step.graph.graphs) == 2 and len(untimed.graphed_step.graph.graphs) == 1
    assert [timed.in_window(s) for s in range(5)] == [True, True, True, True, False]
    assert [untimed.in_window(s) for s in range(5)] == [True, True, True, False, False]


def test_timer_reports_whole_steps_where_the_graph_has_no_marks() -> None:
    timer = CudaSyncTimer(warmup_steps=0, print_summary=False)
    module = EmulatedUntimed(**TINY, cuda_graphs=True, cuda_graph_warmup=3)
    _fit(module, steps=6, callbacks=[timer])
    by_step = {row["step"]: row for row in timer.step_times}
    assert set(by_step[5]) == {"step", "step_ms"} and module.graph_phase_marks() is None
    assert "forward_ms" not in timer.summary()


class _FakeGraph:
    def __init__(self, log: list[int], index: int) -> None:
        self.log, self.index = log, index

    def replay(self) -> None:
        self.log.append(self.index)


def test_timed_replays_alternate_between_two_graphs_and_their_marks() -> None:
    """The bookkeeping of ``WholeStepGraph.replay`` (no capture on a CPU): graphs, losses and marks by turns."""
    graph, log = WholeStepGraph(), []
    graph.static_batch = torch.zeros(2, dtype=torch.long)
    graph.graphs = [_FakeGraph(log, 0), _FakeGraph(log, 1)]
    graph.losses = [torch.tensor(0.0), torch.tensor(1.0)]
    graph.marks = [{"start": "a0", "end": "a1"}, {"start": "b0", "end": "b1"}]
    graph.static_loss = graph.losses[0]
    seen = []
    for _ in range(4):
        loss = graph.replay(torch.ones(2, dtype=torch.long))
        seen.append((float(loss), graph.phase_marks["start"]))
    assert log == [0, 1, 0, 1] and seen == [(0.0, "a0"), (1.0, "b0"), (0.0, "a0"), (1.0, "b0")]
    assert graph.static_batch.tolist() == [1, 1]
    untimed = WholeStepGraph(timed=False)
    untimed.static_batch, untimed.graphs, untimed.losses, untimed.marks = graph.static_batch, [_FakeGraph(log, 7)], \
        [torch.tensor(2.0)], [{}]
    untimed.static_loss = untimed.losses[0]
    untimed.replay(torch.ones(2, dtype=torch.long))
    assert log[-1] == 7 and untimed.phase_marks is None


def test_precision_inspector_gets_an_eager_step_inside_a_graphed_run() -> None:
    inspector = PrecisionInspector(step=5, reference=False)
    module = Emulated(**TINY, cuda_graphs=True, cuda_graph_warmup=2)
    _fit(module, steps=7, callbacks=[inspector])
    assert module.replays_graph(4) and not module.replays_graph(5)
    assert inspector.result is not None and inspector.result.modules  # hooks saw the step's modules
    step = module.graphed_step
    assert step.eager_steps == 3 and step.graph.captures == 1  # warm-up 2 + the inspected step


@pytest.mark.parametrize("trainer_kwargs, text", [
    ({"accumulate_grad_batches": 2}, "accumulate"),
    ({"gradient_clip_val": 1.0}, "gradient_clip_val"),
])
def test_graph_refusals_name_the_option(trainer_kwargs: dict[str, Any], text: str) -> None:
    with pytest.raises(LmtrainError, match=text) as info:
        _fit(Emulated(**TINY, cuda_graphs=True), steps=2, **trainer_kwargs)
    assert "model.cuda_graphs" in str(info.value)


def test_graphs_refuse_a_cpu_and_offload_and_other_step_modes() -> None:
    with pytest.raises(LmtrainError, match="needs a CUDA device"):
        _fit(LMModule(**TINY, cuda_graphs=True), steps=2)
    with pytest.raises(LmtrainError, match="offload"):
        _fit(Emulated(**TINY, cuda_graphs=True, activation_checkpointing="offload"), steps=2)
    with pytest.raises(LmtrainError, match="step_mode"):
        LMModule(**TINY, cuda_graphs=True, step_mode="forward_backward")
    with pytest.raises(LmtrainError, match="cuda_graph_warmup"):
        LMModule(**TINY, cuda_graphs=True, cuda_graph_warmup=0)


def test_in_backward_schedule_survives_load_state_dict() -> None:
    """After a resume the schedule sets lr in the loaded param groups; each update must read those."""
    from lmtrain.optim import InBackwardAdamW

    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = InBackwardAdamW([{"params": [w], "weight_decay": 0.0}], lr=1.0, betas=(0.9, 0.95), eps=1e-8)
    opt.step(closure=lambda: (w * w).sum().backward())
    opt.load_state_dict(opt.state_dict())
    opt.param_groups[0]["lr"] = 0.0  # what a schedule does
    before = w.detach().clone()
    opt.step(closure=lambda: (w * w).sum().backward())
    torch.testing.assert_close(w.detach(), before)  # lr 0: no change
    opt.remove_hooks()


# -- master_weights (bf16 linear weights, fp32 masters in the optimizer) ----------------------------------------


def test_master_weights_train_like_bf16_mixed_on_cpu() -> None:
    """bf16 weights + fp32 masters: the arithmetic of bf16-mixed with fp32 weights (autocast's casts, on a CPU)."""
    torch.manual_seed(1)
    plain = LMModule(**TINY)
    torch.manual_seed(1)
    master = LMModule(**TINY, master_weights=True)
    a, b = _fit(plain, precision="bf16-mixed"), _fit(master, precision="bf16-mixed")
    assert b.losses == pytest.approx(a.losses, rel=1e-5)
    opt = master.trainer.optimizers[0]
    for (name, p), q in zip(plain.named_parameters(), master.parameters(), strict=True):
        if q.dtype == torch.bfloat16:  # linear weights: bf16, their masters in the optimizer
            torch.testing.assert_close(opt.state[q]["master"], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(q.detach(), p.detach().bfloat16(), rtol=1e-2, atol=1e-3, msg=name)
        else:  # embedding table and norm gains stay fp32
            assert "embedding" in name or q.ndim == 1
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_optimizer_moments_train_close_to_fp32_moments_on_cpu() -> None:
    """optimizer_state_dtype: bfloat16 keeps the bf16 weights' moments in bf16 (stochastically rounded): losses
    close to fp32 moments, the embedding and gains' moments still fp32."""
    runs = {}
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(1)
        module = LMModule(**TINY, master_weights=True, optimizer_state_dtype=dtype)
        runs[dtype] = (_fit(module, precision="bf16-mixed"), module)
    (ref, _), (cb, module) = runs["float32"], runs["bfloat16"]
    # Stochastic rounding perturbs each moment by about 2^-9 a step: with torch 2.13's CPU build the per-step losses
    # differ by 8e-6 .. 1.4e-3 relative (one step of eight above 5e-4), so 1e-3 was tighter than the rounding noise.
    assert cb.losses == pytest.approx(ref.losses, rel=3e-3)
    opt = module.trainer.optimizers[0]
    for p in module.parameters():
        expected = torch.bfloat16 if p.dtype == torch.bfloat16 else torch.float32
        assert opt.state[p]["exp_avg"].dtype == opt.state[p]["exp_avg_sq"].dtype == expected


def test_master_weights_refusals() -> None:
    with pytest.raises(LmtrainError, match="bf16-mixed"):
        _fit(LMModule(**TINY, master_weights=True), steps=2)
    with pytest.raises(LmtrainError, match="accumulate"):
        _fit(LMModule(**TINY, master_weights=True), steps=2, precision="bf16-mixed", accumulate_grad_batches=2)
    with pytest.raises(LmtrainError, match="optimizer_in_backward"):
        LMModule(**TINY, master_weights=True, optimizer_in_backward=True)
    with pytest.raises(LmtrainError, match="model.master_weights: true"):
        LMModule(**TINY, optimizer_state_dtype="bfloat16")
    with pytest.raises(LmtrainError, match="float32, bfloat16"):
        LMModule(**TINY, master_weights=True, optimizer_state_dtype="fp8")


@pytest.mark.parametrize("options, precision", [
    ({"cuda_graphs": True, "cuda_graph_warmup": 2}, "32-true"),
    ({"master_weights": True}, "bf16-mixed"),
    ({"master_weights": True, "optimizer_state_dtype": "bfloat16"}, "bf16-mixed"),
], ids=["graphs", "master-weights", "compact-optimizer-state"])
def test_resume_continues_exactly(tmp_path: Any, options: dict[str, Any], precision: str) -> None:
    """Stopped after 4 steps and resumed from the checkpoint to 8: the same weights as 8 steps in one fit."""
    def module() -> LMModule:
        torch.manual_seed(1)
        return Emulated(**TINY, **options)

    whole = module()
    _fit(whole, steps=8, precision=precision)
    first = module()
    torch.manual_seed(0)  # as _fit does: the synthetic windows come from the same generator
    trainer = cpu_fit(first, 4, batch=3, context=16, vocab=97, precision=precision)
    path = tmp_path / "step4.ckpt"
    trainer.save_checkpoint(path)
    resumed = module()
    torch.manual_seed(0)
    cpu_fit(resumed, 8, batch=3, context=16, vocab=97, precision=precision, ckpt_path=str(path))
    assert resumed.trainer.global_step == 8
    opt_w, opt_r = whole.trainer.optimizers[0], resumed.trainer.optimizers[0]
    for (name, p), q in zip(whole.named_parameters(), resumed.parameters(), strict=True):
        assert q.dtype == p.dtype, name
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7, msg=name)
        if p.dtype == torch.bfloat16:  # the fp32 masters (split or not) and the moments, stochastic rounding included
            torch.testing.assert_close(opt_r.master(q), opt_w.master(p), rtol=1e-6, atol=1e-7)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt_r.state[q][key], opt_w.state[p][key], rtol=1e-6, atol=1e-7)


def test_validation_between_graphed_steps() -> None:
    """Validation passes (eager, no gradients) between replays leave the graphed training unchanged."""
    torch.manual_seed(1)
    eager = LMModule(**TINY)
    torch.manual_seed(1)
    graphed = Emulated(**TINY, cuda_graphs=True, cuda_graph_warmup=2)
    kw = dict(limit_val_batches=1, val_check_interval=3)
    a, b = _fit(eager, **kw), _fit(graphed, **kw)
    assert b.losses == pytest.approx(a.losses, rel=1e-6, abs=1e-7)
    val = [t.callback_metrics["val/loss"] for t in (eager.trainer, graphed.trainer)]
    torch.testing.assert_close(val[1], val[0], rtol=1e-6, atol=1e-7)
