"""NVTXRanges through a real Trainer.fit on a tiny model: names, nesting, window, balance, hook removal."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

import lmtrain.callbacks.nvtx as nvtx_module
from lmtrain.annotate import active_requests
from lmtrain.callbacks import NVTXRanges
from lmtrain.data import LMDataModule
from lmtrain.module import LMModule

T = 16


class Recorder:
    """Stands in for ``torch.cuda.nvtx``: records every call and checks that pops match pushes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.stack: list[str] = []
        self.open_ids: dict[int, str] = {}
        self.next_id = 0

    def range_push(self, name: str) -> int:
        self.calls.append(("push", name))
        self.stack.append(name)
        return len(self.stack) - 1

    def range_pop(self) -> int:
        assert self.stack, "pop without push"
        self.calls.append(("pop", self.stack.pop()))
        return len(self.stack)

    def range_start(self, name: str) -> int:
        self.next_id += 1
        self.open_ids[self.next_id] = name
        self.calls.append(("start", name))
        return self.next_id

    def range_end(self, range_id: int) -> None:
        self.calls.append(("end", self.open_ids.pop(range_id)))

    def pushed(self) -> list[str]:
        return [name for kind, name in self.calls if kind == "push"]


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(nvtx_module, "nvtx", rec)
    monkeypatch.setattr(nvtx_module, "_nvtx_available", lambda: True)
    return rec


def make(attention: str = "sdpa") -> tuple[LMModule, LMDataModule]:
    pl.seed_everything(0)
    module = LMModule(size="tiny", vocab_size=256, context_length=T, num_layers=2, attention=attention, warmup_steps=1)
    data = LMDataModule(source="synthetic", batch_size=2, context_length=T, vocab_size=256, train_batches=64)
    return module, data


def fit(tmp_path, callbacks: list[pl.Callback], module: LMModule, data: LMDataModule, steps: int) -> pl.Trainer:
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", callbacks=callbacks,
                         logger=TensorBoardLogger(tmp_path, name="tb"), enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(module, data)
    return trainer


def all_hooks_removed(module: torch.nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in module.modules())


def test_ranges_nested_in_window_and_balanced(tmp_path, recorder):
    module, data = make()
    fit(tmp_path, [NVTXRanges(depth="module", start_step=1, num_steps=2)], module, data, steps=4)
    assert recorder.stack == [] and recorder.open_ids == {}
    assert [name for kind, name in recorder.calls if kind == "start"] == ["step/1", "step/2"]
    per_step = ["step", "forward", "blocks.0", "blocks.0.attn", "blocks.0.mlp", "blocks.1", "blocks.1.attn",
                "blocks.1.mlp", "backward", "optimizer"]
    assert recorder.pushed() == per_step * 2
    # Nesting: forward inside step, blocks inside forward, attn inside its block.
    first = recorder.calls[: recorder.calls.index(("pop", "step")) + 1]
    assert first[:4] == [("push", "step"), ("start", "step/1"), ("push", "forward"), ("push", "blocks.0")]
    assert first[4:6] == [("push", "blocks.0.attn"), ("pop", "blocks.0.attn")]
    assert first[-4:] == [("push", "optimizer"), ("pop", "optimizer"), ("end", "step/1"), ("pop", "step")]
    assert all_hooks_removed(module)


@pytest.mark.parametrize("depth, expected", [
    ("step", ["step"]),
    ("phase", ["step", "forward", "backward", "optimizer"]),
    ("block", ["step", "forward", "blocks.0", "blocks.1", "backward", "optimizer"]),
])
def test_depth(tmp_path, recorder, depth, expected):
    module, data = make()
    fit(tmp_path, [NVTXRanges(depth=depth, start_step=0, num_steps=1)], module, data, steps=2)
    assert recorder.pushed() == expected and recorder.stack == []


def test_module_filters(tmp_path, recorder):
    module, data = make()
    cb = NVTXRanges(depth="module", num_steps=1, module_names=["blocks.1", "blocks.1.*"], module_types=["Linear"])
    fit(tmp_path, [cb], module, data, steps=1)
    pushed = recorder.pushed()
    assert "blocks.0" not in pushed and "blocks.1" in pushed and "blocks.1.attn_norm" in pushed
    assert "lm_head" in pushed and "blocks.0.mlp.w1" in pushed  # module_types: every Linear, by path
    assert recorder.stack == []


class RaiseInMLP(pl.Callback):
    """Makes the forward of blocks.1.mlp raise at step 1 (a crash in the middle of the forward)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            def boom(module, args):
                raise RuntimeError("boom")

            pl_module.model.blocks[1].mlp.w2.register_forward_pre_hook(boom)


def test_balanced_when_a_step_raises(tmp_path, recorder):
    module, data = make(attention="naive")
    with pytest.raises(RuntimeError, match="boom"):
        fit(tmp_path, [NVTXRanges(depth="op"), RaiseInMLP()], module, data, steps=3)
    assert recorder.stack == [] and recorder.open_ids == {}
    assert recorder.pushed().count("step") == 2  # the crashing step was opened, and closed by on_exception
    assert active_requests() == (0, 0)  # annotate ranges switched off again
    for m in module.modules():  # only the test's own hook is left
        assert not m._forward_hooks and all(h.__name__ == "boom" for h in m._forward_pre_hooks.values())


def test_record_function_ranges_in_profiler_on_cpu(tmp_path):
    module, data = make(attention="naive")
    with pytest.warns(UserWarning, match="NVTX needs CUDA") as record:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fit(tmp_path, [NVTXRanges(depth="op", start_step=1, num_steps=1)], module, data, steps=3)
    assert sum("NVTX needs CUDA" in str(w.message) for w in record) == 1
    names = {e.key for e in prof.key_averages()}
    for expected in ["step", "step/1", "forward", "backward", "optimizer", "blocks.0", "blocks.1.attn",
                     "blocks.1.mlp", "attention/qk_matmul", "attention/softmax", "attention/pv_matmul"]:
        assert expected in names, expected
    assert "step/0" not in names and "step/2" not in names
    assert all_hooks_removed(module) and active_requests() == (0, 0)


def test_bad_depth(tmp_path):
    from lmtrain.errors import LmtrainError

    module, data = make()
    with pytest.raises(LmtrainError, match="NVTXRanges.depth"):
        fit(tmp_path, [NVTXRanges(depth="kernel")], module, data, steps=1)  # type: ignore[arg-type]


def test_record_function_ranges_only_while_a_profiler_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``record_function`` entered with no profiler recording reaches no trace but costs a dispatch: NVTXRanges
    and ``annotate`` skip it then, and make it while one records."""
    import lmtrain.annotate as annotate_module
    from lmtrain.annotate import annotate, profiler_recording, ranges_enabled

    made: list[str] = []
    real = torch.profiler.record_function

    def counting(name: str) -> torch.profiler.record_function:
        made.append(name)
        return real(name)

    monkeypatch.setattr(torch.profiler, "record_function", counting)
    ranges = NVTXRanges(nvtx=False)
    assert not profiler_recording()
    ranges._open("step")
    ranges._close("step")
    with ranges_enabled(nvtx=False, profiler=True), annotate("attention/softmax"):
        pass
    assert made == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert profiler_recording()
        ranges._open("step")
        ranges._close("step")
        with ranges_enabled(nvtx=False, profiler=True), annotate("attention/softmax"):
            pass
    assert made == ["step", "attention/softmax"]
    assert {"step", "attention/softmax"} <= {e.key for e in prof.key_averages()}
    assert annotate_module.active_requests() == (0, 0)
