"""MemorySnapshot: CPU behaviour through Trainer.fit, snapshot analysis on a synthetic snapshot, OOM summary."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tb import images, scalars, texts

import lmtrain
from lmtrain.callbacks import MemorySnapshot
from lmtrain.callbacks.memory import (
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




@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_window_writes_pickle_png_and_tables(tmp_path):
    cb = MemorySnapshot(start_step=2, num_steps=1, top_n=5)
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
