"""CudaSyncTimer through a real Trainer.fit on a tiny model, with the host clock patched to exact values."""

from __future__ import annotations

import itertools

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tb import scalars, texts

import lmtrain.callbacks.timer as timer_module
from lmtrain.callbacks import CudaSyncTimer
from lmtrain.data import LMDataModule
from lmtrain.errors import LmtrainError
from lmtrain.flops import flops_per_step
from lmtrain.module import LMModule

B, T = 2, 32


class FakeClock:
    """perf_counter stand-in: each call returns the previous value + 250 ms (exact in binary floating point)."""

    def __init__(self) -> None:
        self.ticks = itertools.count()

    def __call__(self) -> float:
        return next(self.ticks) * 0.25


def fit(tmp_path, timer: CudaSyncTimer, steps: int = 4, step_mode: str = "train", **trainer_kwargs) -> LMModule:
    pl.seed_everything(0)
    module = LMModule(size="tiny", vocab_size=256, context_length=T, step_mode=step_mode, warmup_steps=1)
    data = LMDataModule(source="synthetic", batch_size=B, context_length=T, vocab_size=256, train_batches=64)
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", callbacks=[timer], logger=TensorBoardLogger(tmp_path, name="tb"),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
        **trainer_kwargs,
    )
    trainer.fit(module, data)
    return module


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(timer_module, "perf_counter", clock)
    return clock


def test_exact_phase_times_tokens_and_mfu(tmp_path, fake_clock):
    peak = 1e9
    timer = CudaSyncTimer(warmup_steps=1, sync="synchronize", peak_flops=peak, print_summary=False)
    module = fit(tmp_path, timer, steps=4)
    # Five marks per step (start, before/after backward, before optimizer, end), 250 ms apart.
    assert timer.warmup_times == [1000.0]
    assert [row["step"] for row in timer.step_times] == [1, 2, 3]
    for row in timer.step_times:
        assert row == {"step": row["step"], "forward_ms": 250.0, "backward_ms": 250.0, "optimizer_ms": 250.0,
                       "step_ms": 1000.0}
    s = timer.summary()
    assert s["step_ms"] == {"mean": 1000.0, "std": 0.0, "median": 1000.0, "min": 1000.0, "max": 1000.0,
                          "count": 3.0}
    assert set(s) == {"forward_ms", "backward_ms", "optimizer_ms", "step_ms"}

    logged = scalars(tmp_path)
    assert logged["time/warmup_step_ms"] == [(0, 1000.0)]
    for tag, value in [("time/forward_ms", 250.0), ("time/backward_ms", 250.0), ("time/optimizer_ms", 250.0),
                       ("time/step_ms", 1000.0), ("throughput/tokens_per_s", B * T / 1.0)]:
        assert [s for s, _ in logged[tag]] == [1, 2, 3], tag
        assert [v for _, v in logged[tag]] == [value] * 3, tag
    ours = [tag for tag in logged if tag.startswith(("time/", "throughput/"))]
    assert all(f"``{tag}``" in CudaSyncTimer.__doc__ for tag in ours)  # every logged tag is documented
    expected_mfu = flops_per_step(module.config, B, T, "train") / 1.0 / peak
    assert 0 < expected_mfu < 1
    assert all(v == pytest.approx(expected_mfu, rel=1e-6) for _, v in logged["throughput/mfu"])

    summary = texts(tmp_path)["time/summary"][0]
    assert "| step " in summary and "1000.000 ± 0.000" in summary
    assert "Forward (s)" in summary and "Backward (s)" in summary
    assert "tiny" in summary and f"{sum(p.numel() for p in module.parameters()):,}" in summary
    assert "0.250000±0.000000" in summary


def test_mfu_clipped_with_one_warning(tmp_path, fake_clock):
    timer = CudaSyncTimer(warmup_steps=0, sync="synchronize", peak_flops=1.0, print_summary=False)
    with pytest.warns(UserWarning, match="MFU .* > 1") as record:
        fit(tmp_path, timer, steps=3)
    assert sum("MFU" in str(w.message) for w in record) == 1
    assert [v for _, v in scalars(tmp_path)["throughput/mfu"]] == [1.0, 1.0, 1.0]


def test_forward_only_steps_have_no_backward_or_optimizer(tmp_path, fake_clock):
    timer = CudaSyncTimer(warmup_steps=0, print_summary=False)  # events mode falls back to the host clock
    fit(tmp_path, timer, steps=3, step_mode="forward", max_epochs=1, limit_train_batches=3)
    # Forward only: two marks per step (start, end).
    assert timer.step_times == [{"step": i, "forward_ms": 250.0, "step_ms": 250.0} for i in range(3)]
    logged = scalars(tmp_path)
    assert "time/backward_ms" not in logged and "time/optimizer_ms" not in logged
    assert "throughput/mfu" not in logged  # no peak FLOP/s for a CPU


def test_gradient_accumulation_sums_micro_batches(tmp_path, fake_clock):
    timer = CudaSyncTimer(warmup_steps=0, sync="synchronize", print_summary=False, log_every_n_steps=2)
    fit(tmp_path, timer, steps=3, accumulate_grad_batches=2)
    # Micro-batch 1: start, bwd0, bwd1, end (4 marks); micro-batch 2: + before-optimizer (5 marks).
    assert timer.step_times == [
        {"step": i, "forward_ms": 500.0, "backward_ms": 500.0, "optimizer_ms": 250.0, "step_ms": 1750.0}
        for i in range(3)
    ]
    logged = scalars(tmp_path)
    assert [s for s, _ in logged["time/step_ms"]] == [0, 2]  # every 2nd step
    assert all(v == pytest.approx(2 * B * T / 1.75) for _, v in logged["throughput/tokens_per_s"])


def test_summary_printed(tmp_path, fake_clock, capsys):
    fit(tmp_path, CudaSyncTimer(warmup_steps=1, sync="synchronize"), steps=2)
    out = capsys.readouterr().out
    assert "Forward (s)" in out and "1 warm-up step(s) excluded (ms: 1000.0)" in out


def test_bad_mode_is_rejected(tmp_path):
    from lmtrain.errors import LmtrainError

    with pytest.raises(LmtrainError, match="CudaSyncTimer.sync"):
        fit(tmp_path, CudaSyncTimer(sync="wallclock"), steps=1)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_events_mode_on_cuda(tmp_path):
    timer = CudaSyncTimer(warmup_steps=2, print_summary=False)
    pl.seed_everything(0)
    module = LMModule(size="tiny", vocab_size=256, context_length=T, warmup_steps=1)
    data = LMDataModule(source="synthetic", batch_size=B, context_length=T, vocab_size=256, train_batches=64)
    trainer = pl.Trainer(max_steps=6, accelerator="cuda", devices=1, callbacks=[timer],
                         logger=TensorBoardLogger(tmp_path, name="tb"), enable_progress_bar=False,
                         enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(module, data)
    assert len(timer.warmup_times) == 2 and [r["step"] for r in timer.step_times] == [2, 3, 4, 5]
    for row in timer.step_times:
        phases = row["forward_ms"] + row["backward_ms"] + row["optimizer_ms"]
        assert 0 < phases <= row["step_ms"] * (1 + 1e-3)
    logged = scalars(tmp_path)
    assert {"time/step_ms", "throughput/tokens_per_s", "time/warmup_step_ms"} <= set(logged)


def test_phases_of_a_graphed_step_from_marks_recorded_inside_the_graph() -> None:
    """A module whose graph records phase marks (``graph_phase_marks``: here host times standing in for the events a
    CUDA graph records, with phase lengths that grow with the replay number) gives each replayed step the forward /
    backward / optimizer split of its own replay; the step time stays the host's own marks around the replay."""
    from test_graphs import TINY, Emulated, _fit

    class Marked(Emulated):
        def graph_phase_marks(self) -> dict[str, float]:
            r = self.graphed_step.graph.replays  # the replay just run is number r (1 for the first)
            return {"start": 1.0, "before_backward": 1.0 + 0.002 * r, "after_backward": 1.0 + 0.005 * r,
                    "before_opt": 1.0 + 0.006 * r, "end": 1.0 + 0.0065 * r}

    timer = CudaSyncTimer(warmup_steps=0, print_summary=False)
    _fit(Marked(**TINY, cuda_graphs=True, cuda_graph_warmup=3), steps=7, callbacks=[timer])
    by_step = {row["step"]: row for row in timer.step_times}
    for step in (3, 4, 5, 6):  # the capture step (replay 1) and the replays after it
        r = step - 2
        replayed = by_step[step]
        assert (replayed["forward_ms"], replayed["backward_ms"], replayed["optimizer_ms"]) == pytest.approx(
            (2.0 * r, 3.0 * r, 0.5 * r)), step
        assert replayed["step_ms"] != pytest.approx(6.5 * r)  # the host's marks, not the graph's
    assert by_step[1]["forward_ms"] != pytest.approx(2.0)  # eager warm-up steps keep their own marks


class HalfFloat8Module(LMModule):
    """A module whose steps run half their FLOPs as float8 GEMMs (float8 itself needs a GPU; the timer only reads
    ``float8_flops_per_batch``)."""

    @property
    def float8_flops_per_batch(self) -> float | None:
        flops = self.flops_per_batch
        return None if flops is None else flops / 2


def test_mfu_against_the_float8_steps_own_peak(tmp_path, fake_clock):
    peak, float8_peak = 1e9, 2e9
    timer = CudaSyncTimer(warmup_steps=1, sync="synchronize", peak_flops=peak, float8_peak_flops=float8_peak,
                          print_summary=False)
    pl.seed_everything(0)
    module = HalfFloat8Module(size="tiny", vocab_size=256, context_length=T, warmup_steps=1)
    data = LMDataModule(source="synthetic", batch_size=B, context_length=T, vocab_size=256, train_batches=64)
    pl.Trainer(max_steps=3, accelerator="cpu", callbacks=[timer], logger=TensorBoardLogger(tmp_path, name="tb"),
               enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
               limit_val_batches=0).fit(module, data)
    logged = scalars(tmp_path)
    mfu = flops_per_step(module.config, B, T, "train") / 1.0 / peak  # 1000 ms steps (the fake clock)
    # Half the FLOPs at 2e9 and half at 1e9: the step's own peak is 1 / (0.25e-9 + 0.5e-9) = 4/3 e9.
    assert [v for _, v in logged["throughput/mfu"]] == pytest.approx([mfu] * 2, rel=1e-6)
    assert [v for _, v in logged["throughput/mfu_float8_peak"]] == pytest.approx([mfu * 0.75] * 2, rel=1e-6)
    assert "``throughput/mfu_float8_peak``" in CudaSyncTimer.__doc__


def test_no_float8_figure_without_float8_layers(tmp_path, fake_clock):
    fit(tmp_path, CudaSyncTimer(warmup_steps=0, sync="synchronize", peak_flops=1e9, float8_peak_flops=2e9,
                                print_summary=False), steps=2)
    assert "throughput/mfu_float8_peak" not in scalars(tmp_path)
    with pytest.raises(LmtrainError, match="float8_peak_flops"):
        CudaSyncTimer(float8_peak_flops=-1.0).check_arguments()


class FakeEvent:
    """``torch.cuda.Event`` stand-in: ``record`` takes the next tick (1 ms each) of a shared clock; ``query`` says
    whether the "GPU" has passed the event (``done``); ``synchronize`` counts the host's waits."""

    ticks = itertools.count()
    done = True
    waits = 0

    def __init__(self, enable_timing: bool = True) -> None:
        self.tick: int | None = None

    def record(self) -> None:
        self.tick = next(FakeEvent.ticks)

    def query(self) -> bool:
        return FakeEvent.done

    def synchronize(self) -> None:
        FakeEvent.waits += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        return float(end.tick - self.tick)


@pytest.mark.parametrize("world", [1, 2], ids=["one-rank", "rank-of-two"])
@pytest.mark.parametrize("done", [True, False], ids=["events-passed", "events-pending"])
def test_events_of_a_step_are_read_when_the_step_after_next_starts(monkeypatch, done, world):
    """Events mode reads step N when step N + 2 starts, whether or not its events completed earlier and on one rank
    as on several (so every rank reads, and gathers, the same steps at the same hook, without waiting for the step
    just ended), and the rest at the fit's end. Several ranks: the gather is stubbed with this rank's values twice."""
    from types import SimpleNamespace

    gathered = []

    def gather(trainer_, values):  # noqa: ANN001, ANN202
        gathered.append(trainer_.global_step)
        return [list(values), list(values)]

    monkeypatch.setattr(timer_module, "gather_values", gather)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(FakeEvent, "done", done)
    monkeypatch.setattr(FakeEvent, "waits", 0)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), precision="32-true",
                              world_size=world, global_rank=0, global_step=0, accumulate_grad_batches=1,
                              lightning_module=None, callbacks=[], loggers=[])
    module = torch.nn.Linear(2, 2)
    timer = CudaSyncTimer(warmup_steps=0, print_summary=False)
    trainer.callbacks.append(timer)
    timer.setup(trainer, module, "fit")
    timer._cuda = True  # events mode, with the stand-in events
    read_at_start = []
    for i in range(5):
        timer.on_train_batch_start(trainer, module, torch.zeros(B, T + 1, dtype=torch.long), i)
        read_at_start.append([row["step"] for row in timer.step_times])
        timer.on_before_backward(trainer, module, torch.zeros(()))
        timer.on_after_backward(trainer, module)
        timer.on_before_optimizer_step(trainer, module, None)
        trainer.global_step += 1
        timer.on_train_batch_end(trainer, module, None, None, i)
    assert read_at_start == [[], [], [0], [0, 1], [0, 1, 2]]
    timer.on_train_end(trainer, module)
    assert timer.step_times == [{"step": i, "forward_ms": 1.0, "backward_ms": 1.0, "optimizer_ms": 1.0,
                                 "step_ms": 4.0} for i in range(5)]
    assert FakeEvent.waits == (0 if done else 5)  # the host waits only for events not passed yet
    # Several ranks: each step gathered once, steps 0-2 when steps 2-4 start (global_step is then the step's
    # index), steps 3 and 4 at the end.
    assert gathered == ([2, 3, 4, 5, 5] if world == 2 else [])


def test_a_fit_of_warm_up_steps_only_says_why_it_has_no_summary(tmp_path, fake_clock):
    """Three steps with warmup_steps=5: all three are warm-up steps; one warning says so (no silent missing
    summary), and no time/summary is logged."""
    timer = CudaSyncTimer(warmup_steps=5, sync="synchronize")
    with pytest.warns(UserWarning, match=r"every step of this fit \(3\) was a warm-up step \(warmup_steps=5\); no "
                                         r"summary\. Lower warmup_steps or train for more steps\.") as caught:
        fit(tmp_path, timer, steps=3)
    assert sum("warm-up step" in str(w.message) for w in caught) == 1
    assert timer.warmup_times == [1000.0] * 3 and timer.step_times == []
