"""MemorySnapshot: CPU behaviour through Trainer.fit, snapshot analysis on a synthetic snapshot, OOM summary."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tb import images, scalars, texts

import lmtrain
from lmtrain.analysis.memory import (
    GIB,
    PhaseMark,
    informative_frame,
    live_at_end,
    live_at_peak,
    live_by_category_table,
    memory_by_category,
    memory_curve,
    oom_summary,
    render_timeline,
    tensor_labels,
    top_allocations_table,
)
from lmtrain.callbacks import MemorySnapshot
from lmtrain.callbacks.memory import AllocatorHistory
from lmtrain.data import LMDataModule
from lmtrain.module import LMModule

MIB = 1024**2
T = 16
LMTRAIN = Path(lmtrain.__file__).parent
SITE = "/usr/lib/python3/site-packages"
USER_SCRIPT = {"filename": "/home/user/train.py", "line": 7, "name": "<module>"}
LIGHTNING = {"filename": f"{SITE}/lightning/pytorch/trainer/trainer.py", "line": 500, "name": "fit"}
MLP_FRAMES = [{"filename": f"{SITE}/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
              {"filename": f"{SITE}/torch/nn/modules/module.py", "line": 1700, "name": "_call_impl"},
              {"filename": str(LMTRAIN / "model.py"), "line": 92, "name": "forward"}, LIGHTNING, USER_SCRIPT]
OPT_FRAMES = [{"filename": f"{SITE}/torch/optim/adamw.py", "line": 160, "name": "_init_group"},
              {"filename": f"{SITE}/torch/optim/optimizer.py", "line": 480, "name": "wrapper"}, LIGHTNING, USER_SCRIPT]

# Addresses: A, B, C allocated in the window; P freed in it and Q still live, both allocated before recording.
A, B, C, P, Q = 0x1000, 0x2000, 0x3000, 0x4000, 0x5000


def synthetic_snapshot() -> dict:
    """Shaped like torch.cuda.memory._snapshot(): segments with blocks, and one trace per device."""
    trace = [
        {"action": "segment_alloc", "addr": A, "size": 200 * MIB, "stream": 0, "time_us": 90, "frames": []},
        {"action": "alloc", "addr": A, "size": 100 * MIB, "stream": 0, "time_us": 100, "frames": MLP_FRAMES},
        {"action": "alloc", "addr": B, "size": 50 * MIB, "stream": 0, "time_us": 200, "frames": []},
        {"action": "free_requested", "addr": A, "size": 100 * MIB, "stream": 0, "time_us": 300, "frames": []},
        {"action": "free_completed", "addr": A, "size": 100 * MIB, "stream": 0, "time_us": 300, "frames": []},
        {"action": "free_completed", "addr": P, "size": 30 * MIB, "stream": 0, "time_us": 400, "frames": []},
        {"action": "alloc", "addr": C, "size": 10 * MIB, "stream": 0, "time_us": 500, "frames": OPT_FRAMES},
    ]
    blocks = [
        {"address": B, "size": 50 * MIB, "requested_size": 50 * MIB, "state": "active_allocated", "frames": []},
        {"address": C, "size": 10 * MIB, "requested_size": 10 * MIB, "state": "active_allocated",
         "frames": OPT_FRAMES},
        {"address": Q, "size": 200 * MIB, "requested_size": 200 * MIB, "state": "active_allocated", "frames": []},
        {"address": A, "size": 100 * MIB, "requested_size": 0, "state": "inactive", "frames": []},
    ]
    segments = [{"device": 0, "address": A, "total_size": 512 * MIB, "stream": 0, "segment_type": "large",
                 "allocated_size": 260 * MIB, "active_size": 260 * MIB, "blocks": blocks}]
    return {"segments": segments, "device_traces": [trace]}


MARKS = [PhaseMark(5, "forward", 50, 250), PhaseMark(5, "backward", 250, 450), PhaseMark(5, "optimizer", 450, 600)]


def test_memory_curve_counts_blocks_from_before_the_recording():
    positions, totals = memory_curve(synthetic_snapshot(), 0)
    assert positions == [-1, 1, 2, 4, 5, 6]
    assert [t // MIB for t in totals] == [230, 330, 380, 280, 250, 260]  # starts at P + Q


def test_live_at_peak_and_top_table():
    live, peak = live_at_peak(synthetic_snapshot(), 0)
    assert peak == 380 * MIB
    assert sorted((a.size // MIB, a.address) for a in live) == [(30, P), (50, B), (100, A), (200, Q)]
    table = top_allocations_table(live, 3, MARKS, labels_before={P: "gradient blocks.0.mlp.w2.weight"},
                                  labels_after={Q: "parameter blocks.0.mlp.w1.weight", A: "stale"})
    lines = table.splitlines()
    assert len(lines) == 2 + 3
    assert "200.0" in lines[2] and "before window" in lines[2] and "parameter blocks.0.mlp.w1.weight" in lines[2]
    # A was freed after the peak: its address no longer names a tensor, its frame does.
    assert "100.0" in lines[3] and "step 5 forward" in lines[3] and "lmtrain/model.py:92 forward" in lines[3]
    assert "stale" not in table
    assert "no Python frame" in lines[4] and "step 5 forward" in lines[4]
    cats = live_by_category_table(live, MARKS, labels_before={P: "gradient blocks.0.mlp.w2.weight"},
                                  labels_after={Q: "parameter blocks.0.mlp.w1.weight"})
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in cats.splitlines()[2:]]
    assert rows == [["parameters", "1", "0.20", "53%"], ["allocated in forward", "2", "0.15", "39%"],
                    ["gradients", "1", "0.03", "8%"]]


def test_live_at_end():
    assert sorted(a.size // MIB for a in live_at_end(synthetic_snapshot(), 0)) == [10, 50, 200]


def test_informative_frame():
    assert informative_frame(MLP_FRAMES)["filename"].endswith("model.py")  # model code, not torch.nn
    assert informative_frame(OPT_FRAMES)["name"] == "_init_group"  # not the script below Lightning
    assert informative_frame([]) is None
    assert informative_frame([USER_SCRIPT]) == USER_SCRIPT


def test_render_timeline_png(tmp_path):
    fig = render_timeline(synthetic_snapshot(), 0, MARKS, title="synthetic")
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["forward", "backward", "optimizer"]
    path = tmp_path / "timeline.png"
    fig.savefig(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_by_category_on_a_fake():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    state_bytes = sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values())
    shared = model[1].weight.view(-1)  # a view: same storage, counted once
    cats = memory_by_category(model, [opt], allocated=param_bytes * 2 + state_bytes + 1000)
    assert cats == {"parameters": param_bytes, "gradients": param_bytes, "optimizer state": state_bytes,
                    "activations and other": 1000}
    assert shared.untyped_storage().data_ptr() == model[1].weight.untyped_storage().data_ptr()
    labels = tensor_labels(model, [opt])
    assert labels[model[0].weight.data_ptr()] == "parameter 0.weight"
    assert labels[model[0].weight.grad.data_ptr()] == "gradient 0.weight"
    assert labels[opt.state[model[0].weight]["exp_avg"].data_ptr()] == "optimizer exp_avg 0.weight"
    text = oom_summary(cats, step=3, phase="backward", reserved=2**30, device_total=80 * 2**30, device_free=0,
                       top="(table)", snapshot_name="memory_snapshot_oom_step3.pickle")
    assert "step 3 (backward)" in text and "activations and other" in text and "memory_viz" in text
    assert len(text.splitlines()) < 25  # one screen


def fit(tmp_path, callbacks, steps=3, accelerator="cpu", module=None):
    pl.seed_everything(0)
    module = module or LMModule(size="tiny", vocab_size=256, context_length=T, num_layers=2, warmup_steps=1)
    data = LMDataModule(source="synthetic", batch_size=2, context_length=T, vocab_size=256, train_batches=64)
    trainer = pl.Trainer(max_steps=steps, accelerator=accelerator, devices=1, callbacks=callbacks,
                         logger=TensorBoardLogger(tmp_path, name="tb"), enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(module, data)
    return trainer


def test_cpu_warns_once_and_logs_nothing(tmp_path):
    cb = MemorySnapshot(start_step=1, num_steps=1, on_oom=True)
    with pytest.warns(UserWarning, match="need a CUDA device") as record:
        fit(tmp_path, [cb])
    assert sum("CUDA device" in str(w.message) for w in record) == 1
    assert not [t for t in scalars(tmp_path) if t.startswith("memory/")]
    assert cb.files == []


# -- the per-step logic on CPU, with torch.cuda's allocator counters and history replaced by fakes ---------


class FakeAllocator:
    """Stands in for torch.cuda's allocator counters (host-side) and allocation history; counts every read."""

    def __init__(self) -> None:
        self.allocated = 0
        self.peak = 0
        self.reads = 0
        self.resets = 0
        self.recording = False
        self.recording_in_step: list[bool] = []  # per step run by run_step: history recorded during the step

    def set(self, gib: float) -> None:
        self.allocated = int(gib * GIB)
        self.peak = max(self.peak, self.allocated)

    def reset_peak_memory_stats(self, device=None) -> None:  # noqa: ANN001
        self.resets += 1
        self.peak = self.allocated

    def max_memory_allocated(self, device=None) -> int:  # noqa: ANN001
        self.reads += 1
        return self.peak

    def memory_stats(self, device=None) -> dict[str, int]:  # noqa: ANN001
        self.reads += 1
        return {"allocated_bytes.all.peak": self.peak, "allocated_bytes.all.current": self.allocated,
                "reserved_bytes.all.current": 2 * GIB}


class ListLogger:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((step, dict(metrics)))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[FakeAllocator, SimpleNamespace]:
    alloc = FakeAllocator()
    for name in ("reset_peak_memory_stats", "max_memory_allocated", "memory_stats"):
        monkeypatch.setattr(torch.cuda, name, getattr(alloc, name))
    monkeypatch.setattr(AllocatorHistory, "start", staticmethod(lambda max_entries: setattr(alloc, "recording", True)))
    monkeypatch.setattr(AllocatorHistory, "stop", staticmethod(lambda: setattr(alloc, "recording", False)))
    monkeypatch.setattr(AllocatorHistory, "snapshot", staticmethod(synthetic_snapshot))
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), global_rank=0,
                              loggers=[ListLogger()], optimizers=[], log_dir=str(tmp_path),
                              default_root_dir=str(tmp_path), global_step=0, accumulate_grad_batches=1,
                              lightning_module=None)
    return alloc, trainer


def run_step(cb: MemorySnapshot, trainer: SimpleNamespace, module: torch.nn.Module, alloc: FakeAllocator) -> int:
    """One training step's hooks with allocations in between; returns the counter reads it made."""
    reads = alloc.reads
    alloc.set(1.0)
    cb.on_train_batch_start(trainer, module, None, 0)
    alloc.recording_in_step.append(alloc.recording)
    alloc.set(3.0)  # forward: activations
    alloc.set(2.5)
    cb.on_before_backward(trainer, module, torch.zeros(()))
    alloc.set(4.0)  # backward: gradients
    alloc.set(1.5)
    cb.on_after_backward(trainer, module)
    cb.on_before_optimizer_step(trainer, module, None)
    alloc.set(4.5)  # optimizer: temporaries
    alloc.set(1.25)
    trainer.global_step += 1  # as Lightning does when the optimizer has stepped
    cb.on_train_batch_end(trainer, module, None, None, 0)
    return alloc.reads - reads


def test_exact_peaks_and_nothing_read_on_steps_not_logged(fake_cuda):
    alloc, trainer = fake_cuda
    module = torch.nn.Linear(2, 2)
    cb = MemorySnapshot(start_step=None, log_every_n_steps=2)
    cb.setup(trainer, module, "fit")
    reads = [run_step(cb, trainer, module, alloc) for _ in range(4)]
    cb.teardown(trainer, module, "fit")
    expected = {"memory/peak_after_forward_gib": 3.0, "memory/peak_after_backward_gib": 4.0,
                "memory/peak_after_optimizer_gib": 4.5, "memory/allocated_gib": 1.25, "memory/reserved_gib": 2.0}
    assert trainer.loggers[0].logged == [(0, expected), (2, expected)]
    assert all(f"``{tag}``" in MemorySnapshot.__doc__ for tag in expected)  # every logged tag is documented
    assert reads == [3, 0, 3, 0] and alloc.resets == 2  # two phase reads and one memory_stats per logged step
    assert cb.files == [] and not alloc.recording


def test_default_cadence_is_the_trainers(fake_cuda):
    """log_every_n_steps=None (the default) logs, and reads the counters, on the trainer's logged steps only."""
    alloc, trainer = fake_cuda
    trainer.log_every_n_steps = 3
    module = torch.nn.Linear(2, 2)
    cb = MemorySnapshot(start_step=None)
    assert cb.log_every_n_steps is None
    cb.setup(trainer, module, "fit")
    reads = [run_step(cb, trainer, module, alloc) for _ in range(7)]
    cb.teardown(trainer, module, "fit")
    assert [step for step, _ in trainer.loggers[0].logged] == [0, 3, 6]
    assert reads == [3, 0, 0, 3, 0, 0, 3] and alloc.resets == 3


def test_a_trainer_that_logs_nothing_gets_no_per_step_reads(fake_cuda):
    """Lightning's log_every_n_steps=0 logs nothing: the default cadence follows it (no counter read, no scalar),
    rather than reading and logging every step."""
    alloc, trainer = fake_cuda
    trainer.log_every_n_steps = 0
    module = torch.nn.Linear(2, 2)
    cb = MemorySnapshot(start_step=None)
    cb.setup(trainer, module, "fit")
    reads = [run_step(cb, trainer, module, alloc) for _ in range(3)]
    cb.teardown(trainer, module, "fit")
    assert trainer.loggers[0].logged == [] and reads == [0, 0, 0] and alloc.resets == 0


def test_a_fit_resumed_after_the_window_says_so_at_its_start(fake_cuda):
    """A fit that resumes at step 10 with the window at step 5: one line at its first step says the window lies
    before it, and the end of the fit does not claim that training stopped early."""
    alloc, trainer = fake_cuda
    trainer.global_step = 10
    module = torch.nn.Linear(2, 2)
    cb = MemorySnapshot(start_step=5, num_steps=1)
    cb.setup(trainer, module, "fit")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            run_step(cb, trainer, module, alloc)
        cb.teardown(trainer, module, "fit")
    assert [str(w.message) for w in caught] == [
        "MemorySnapshot: this fit starts at step 10 (resumed), after the snapshot window (step 5); no snapshot is "
        "written in it. Set start_step to a step from 10 on to snapshot this run."]
    assert cb.files == [] and not alloc.recording


def test_explicit_cadence_overrides_the_trainers(fake_cuda):
    alloc, trainer = fake_cuda
    trainer.log_every_n_steps = 3
    module = torch.nn.Linear(2, 2)
    cb = MemorySnapshot(start_step=None, log_every_n_steps=1)
    cb.setup(trainer, module, "fit")
    for _ in range(3):
        run_step(cb, trainer, module, alloc)
    cb.teardown(trainer, module, "fit")
    assert [step for step, _ in trainer.loggers[0].logged] == [0, 1, 2]


def test_window_records_only_its_steps_and_writes_files(fake_cuda):
    alloc, trainer = fake_cuda
    module = torch.nn.Linear(2, 2)
    cb = MemorySnapshot(start_step=1, num_steps=2)
    cb.setup(trainer, module, "fit")
    recording = []
    for _ in range(4):
        run_step(cb, trainer, module, alloc)
        recording.append(alloc.recording)
    cb.teardown(trainer, module, "fit")
    assert recording == [False, True, False, False]
    assert [p.name for p in cb.files] == ["memory_snapshot_steps_1-2.pickle", "memory_timeline_steps_1-2.png"]
    assert [(m.step, m.phase) for m in cb._marks] == [
        (s, p) for s in (1, 2) for p in ("forward", "backward", "after backward", "optimizer")]


def test_window_cut_short_warns_and_stops_recording(fake_cuda):
    alloc, trainer = fake_cuda
    module = torch.nn.Linear(2, 2)
    cb = MemorySnapshot(start_step=1, num_steps=5)
    cb.setup(trainer, module, "fit")
    for _ in range(3):
        run_step(cb, trainer, module, alloc)
    assert alloc.recording
    with pytest.warns(UserWarning, match="stopped after 3 batches, before the end of the snapshot window"):
        cb.teardown(trainer, module, "fit")
    assert not alloc.recording and cb.files == []


def test_exception_in_window_stops_recording(fake_cuda):
    alloc, trainer = fake_cuda
    module = torch.nn.Linear(2, 2)
    cb = MemorySnapshot(start_step=0, num_steps=2)
    cb.setup(trainer, module, "fit")
    alloc.set(1.0)
    cb.on_train_batch_start(trainer, module, None, 0)
    assert alloc.recording
    cb.on_exception(trainer, module, RuntimeError("boom"))  # Lightning calls no teardown after this
    assert not alloc.recording


def test_bad_option_names_the_argument(tmp_path):
    from lmtrain.errors import LmtrainError

    with pytest.raises(LmtrainError, match=r"callbacks\.MemorySnapshot\.num_steps: must be an integer >= 1, got 0"):
        fit(tmp_path, [MemorySnapshot(num_steps=0)], steps=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_window_writes_pickle_png_and_tables(tmp_path):
    cb = MemorySnapshot(start_step=2, num_steps=1, top_n=5, log_every_n_steps=1)
    fit(tmp_path, [cb], steps=4, accelerator="cuda")
    names = sorted(p.name for p in cb.files)
    assert names == ["memory_snapshot_steps_2-2.pickle", "memory_timeline_steps_2-2.png"]
    assert all(p.exists() and p.stat().st_size > 0 for p in cb.files)
    logged = scalars(tmp_path)
    for tag in ["peak_after_forward_gib", "peak_after_backward_gib", "peak_after_optimizer_gib", "allocated_gib",
                "reserved_gib"]:
        assert [s for s, _ in logged[f"memory/{tag}"]] == [0, 1, 2, 3]
    fwd, bwd = logged["memory/peak_after_forward_gib"][-1][1], logged["memory/peak_after_backward_gib"][-1][1]
    assert 0 < fwd <= bwd
    assert "memory/timeline" in images(tmp_path)
    assert "size (MiB)" in texts(tmp_path)["memory/top_allocations"][0]


class OOMAtStep2(LMModule):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            torch.empty(1 << 50, dtype=torch.uint8, device=batch.device)  # 1 PiB
        return super().training_step(batch, batch_idx)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_oom_dumps_snapshot_and_reraises(tmp_path, capsys):
    cb = MemorySnapshot(start_step=None, on_oom=True)
    module = OOMAtStep2(size="tiny", vocab_size=256, context_length=T, num_layers=2, warmup_steps=1)
    with pytest.raises(torch.OutOfMemoryError):
        fit(tmp_path, [cb], steps=4, accelerator="cuda", module=module)
    assert [p.name for p in cb.files] == ["memory_snapshot_oom_step2.pickle"]
    assert "Live memory by category" in capsys.readouterr().err
    assert "parameters" in texts(tmp_path)["memory/oom_summary"][0]


class GraphedModule(torch.nn.Linear):
    """Stands in for ``LMModule(cuda_graphs=True)``: steps from 2 on are replays (2 captures), unless a callback of
    the trainer asks for an eager step."""

    graphed_step = "graphs"  # MemorySnapshot's setup only asks whether there is one

    def __init__(self, trainer: SimpleNamespace) -> None:
        super().__init__(2, 2)
        self._fake_trainer = trainer

    def replays_graph(self, step: int) -> bool:
        from lmtrain.graphs import eager_requested

        return step >= 2 and not eager_requested(self._fake_trainer, step)


def run_replay(cb: MemorySnapshot, trainer: SimpleNamespace, module: torch.nn.Module, alloc: FakeAllocator,
               capture: bool) -> None:
    """One step replayed as a CUDA graph: no allocator calls (the capture step allocates the graph's memory), no
    backward hooks, an optimizer step."""
    alloc.set(1.0)
    cb.on_train_batch_start(trainer, module, None, 0)
    alloc.recording_in_step.append(alloc.recording)
    if capture:
        alloc.set(6.0)  # the dry-run pass and the graph's pool
        alloc.set(1.0)
    cb.on_before_optimizer_step(trainer, module, None)
    trainer.global_step += 1
    cb.on_train_batch_end(trainer, module, None, None, 0)


def test_graphed_steps_log_the_capture_peak_and_the_window_runs_eagerly(fake_cuda, caplog):
    import logging

    alloc, trainer = fake_cuda
    module = GraphedModule(trainer)
    trainer.lightning_module, trainer.callbacks = module, []
    cb = MemorySnapshot(start_step=4, num_steps=1)
    trainer.callbacks.append(cb)
    with caplog.at_level(logging.INFO):
        cb.setup(trainer, module, "fit")
    assert "graph_capture_peak_gib" in caplog.text and "run eagerly" in caplog.text  # said once, at setup
    assert [cb.needs_eager_step(s) for s in range(6)] == [False] * 4 + [True, False]
    for step in range(6):
        if module.replays_graph(step):
            run_replay(cb, trainer, module, alloc, capture=step == 2)
        else:
            run_step(cb, trainer, module, alloc)
    cb.teardown(trainer, module, "fit")
    logged = dict(trainer.loggers[0].logged)
    eager = {"memory/peak_after_forward_gib": 3.0, "memory/peak_after_backward_gib": 4.0,
             "memory/peak_after_optimizer_gib": 4.5, "memory/allocated_gib": 1.25, "memory/reserved_gib": 2.0}
    assert logged[0] == logged[1] == logged[4] == eager  # the warm-up and the window's step ran eagerly
    for step in (2, 3, 5):  # the capture step and the replays: the capture's peak, no per-phase peaks
        assert logged[step] == {"memory/graph_capture_peak_gib": 6.0, "memory/allocated_gib": 1.0,
                                "memory/reserved_gib": 2.0}, step
    assert "``memory/graph_capture_peak_gib``" in MemorySnapshot.__doc__
    assert alloc.recording_in_step == [False] * 4 + [True, False]  # the snapshot recorded the eager step 4
    assert [p.name for p in cb.files] == ["memory_snapshot_steps_4-4.pickle", "memory_timeline_steps_4-4.png"]


@pytest.mark.parametrize("world", [1, 2])
def test_the_snapshot_window_perturbs_the_next_step_on_several_ranks(world: int) -> None:
    """On several ranks the step after the history window waits for the ranks that write its files (0.4 s at 2.7B
    on 4 GPUs); on one process it does not. Off a CUDA device nothing is recorded, so nothing is perturbed."""
    from lmtrain.callbacks._common import StepWindow, waits_after

    cb = MemorySnapshot(start_step=5, num_steps=2)
    cb._cuda, cb._world = True, world
    assert [step for step in range(10) if cb.perturbs_timing(step)] == ([5, 6] if world == 1 else [5, 6, 7])
    cb._cuda = False
    assert not any(cb.perturbs_timing(step) for step in range(10))
    assert waits_after(StepWindow(5, 2), 7, 4) and not waits_after(StepWindow(5, 2), 7, 1)
    assert not waits_after(StepWindow(None), 0, 4) and not waits_after(StepWindow(5, None), 6, 4)
