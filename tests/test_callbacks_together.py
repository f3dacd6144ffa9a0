"""All five callbacks on one CPU Trainer.fit, their windows one after another, TensorBoard files read back."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from subprocs import ROOT, own_job_env
from tb import images, read_events, scalars, texts

from lmtrain.annotate import active_requests
from lmtrain.bench.callbacks import CALLBACKS, window_plan
from lmtrain.callbacks import CudaSyncTimer, KernelShare, MemorySnapshot, NVTXRanges, PrecisionInspector
from lmtrain.data import LMDataModule
from lmtrain.module import LMModule


def _hooks(module: LMModule) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in module.modules())


def test_all_five_callbacks_in_one_fit(tmp_path: Path) -> None:
    start = window_plan(list(CALLBACKS), 2)  # KernelShare 2..4, PrecisionInspector 5, MemorySnapshot 6, NVTX 7..9
    callbacks = [
        CudaSyncTimer(warmup_steps=2, print_summary=False),
        NVTXRanges(depth="op", start_step=start["NVTXRanges"], num_steps=3),
        MemorySnapshot(start_step=start["MemorySnapshot"], num_steps=1),
        KernelShare(wait=start["KernelShare"] - 1, warmup=1, active=3),
        PrecisionInspector(step=start["PrecisionInspector"]),
    ]
    pl.seed_everything(0)
    module = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                      attention="naive", warmup_steps=1)
    data = LMDataModule(source="synthetic", batch_size=2, context_length=16, vocab_size=64, train_batches=20,
                        val_batches=1)
    trainer = pl.Trainer(max_steps=12, precision="32-true", accelerator="cpu", devices=1,
                         logger=TensorBoardLogger(str(tmp_path), name="all"), callbacks=callbacks,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data)

    logged, text = scalars(trainer.log_dir), texts(trainer.log_dir)
    # CudaSyncTimer: every step after its warm-up, and the summary table
    assert [s for s, _ in logged["time/step_ms"]] == list(range(2, 12))
    assert len(logged["time/warmup_step_ms"]) == 2 and "throughput/tokens_per_s" in logged
    assert "Forward (s)" in text["time/summary"][0]
    # ... whose statistics leave out the steps inside the other callbacks' windows, reported apart
    # (KernelShare 2..4, PrecisionInspector 5, NVTXRanges 7..9; MemorySnapshot records nothing on CPU)
    timer = callbacks[0]
    assert timer.excluded_steps == {2: ["KernelShare"], 3: ["KernelShare"], 4: ["KernelShare"],
                                    5: ["PrecisionInspector"], 7: ["NVTXRanges"], 8: ["NVTXRanges"], 9: ["NVTXRanges"]}
    assert [row["step"] for row in timer.step_times] == list(range(2, 12))  # every step measured and logged
    assert timer.summary()["step_ms"]["count"] == 3  # steps 6, 10, 11
    assert timer.summary(excluded=True)["step_ms"]["count"] == 7
    assert "7 step(s) perturbed by other callbacks' measurements excluded" in text["time/summary"][0]
    # KernelShare (CPU operator time on this machine): one report when its window closed
    assert len(logged["kernels/total_ms_per_step"]) == 1 and logged["kernels/total_ms_per_step"][0][1] > 0
    assert "GEMM share" in text["kernels/report"][0] and "kernels/categories" in images(trainer.log_dir)
    # PrecisionInspector at its own step (the global_step while it ran), after the profiler window
    assert [s for s, _ in logged["precision/logits_rel_err"]] == [start["PrecisionInspector"]]
    assert "precision/report" in text
    # MemorySnapshot needs CUDA: it says so once and logs nothing here
    assert sum("need a CUDA device" in str(w.message) for w in caught) == 1
    assert not [t for t in logged if t.startswith("memory/")]
    # NVTXRanges and KernelShare leave nothing behind: ranges off, hooks removed, profiler stopped
    assert active_requests() == (0, 0)
    assert _hooks(module) == 0
    assert callbacks[3]._prof is None


class StepProbe(pl.Callback):
    """Records Lightning's global_step at the start of every training batch (the steps a fit went through)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object,
                             batch_idx: int) -> None:
        self.steps.append(trainer.global_step)


PREFIXES = ("time/", "throughput/", "memory/", "kernels/", "precision/")


def _five() -> list[pl.Callback]:
    # The same configuration for both fits, as a user resuming a run would have it. Windows are in
    # global_step: KernelShare 1..2 and NVTXRanges 3..4 lie in the first fit, PrecisionInspector 7 in the
    # resumed one.
    return [CudaSyncTimer(warmup_steps=1, print_summary=False), NVTXRanges(depth="op", start_step=3, num_steps=2),
            MemorySnapshot(start_step=2), KernelShare(wait=1, warmup=1, active=1),
            PrecisionInspector(step=7)]


def _fit_part(tmp_path: Path, name: str, max_steps: int, ckpt_path: str | None = None,
              ) -> tuple[pl.Trainer, StepProbe, list[pl.Callback]]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(0)
    module = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                      attention="naive", warmup_steps=1)
    data = LMDataModule(source="synthetic", batch_size=2, context_length=16, vocab_size=64, train_batches=40,
                        val_batches=1)
    probe, five = StepProbe(), _five()
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=max_steps, save_top_k=-1)
    trainer = pl.Trainer(max_steps=max_steps, accumulate_grad_batches=2, precision="32-true", accelerator="cpu",
                         devices=1, logger=TensorBoardLogger(str(tmp_path), name=name), callbacks=[probe, *five,
                                                                                                  checkpoint],
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, log_every_n_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer, probe, five


def _steps_by_tag(log_dir: str) -> dict[str, set[int]]:
    logged, text = scalars(log_dir), texts(log_dir)
    out = {tag: {s for s, _ in values} for tag, values in logged.items() if tag.startswith(PREFIXES)}
    acc = read_events(log_dir)
    for tag in acc.Tags()["tensors"]:
        name = tag.removesuffix("/text_summary")
        if name.startswith(PREFIXES) and name in text:
            out[name] = {e.step for e in acc.Tensors(tag)}
    out.update({tag: {e.step for e in acc.Images(tag)} for tag in acc.Tags()["images"] if tag.startswith(PREFIXES)})
    return out


def test_every_tag_on_lightnings_global_step_with_accumulation_and_resume(tmp_path: Path) -> None:
    """All five callbacks, gradient accumulation 2, a checkpoint at step 6 and a resumed fit to step 10: every
    tag of every callback sits on a global_step the fit went through, and the resumed fit continues the axis."""
    first, probe1, five1 = _fit_part(tmp_path, "first", max_steps=6)
    ckpt = tmp_path / "ckpt" / "epoch=0-step=6.ckpt"
    assert first.global_step == 6 and ckpt.is_file()
    second, probe2, five2 = _fit_part(tmp_path, "resumed", max_steps=10, ckpt_path=str(ckpt))
    assert second.global_step == 10

    # what Lightning went through: each optimizer step twice (two micro-batches), from 0, then from 6
    assert probe1.steps == [s for s in range(6) for _ in range(2)]
    assert probe2.steps == [s for s in range(6, 10) for _ in range(2)]
    for trainer, probe, expect in ((first, probe1, {"time/", "throughput/", "kernels/"}),
                                   (second, probe2, {"time/", "throughput/", "precision/"})):
        by_tag = _steps_by_tag(trainer.log_dir)
        assert {p for p in PREFIXES if any(t.startswith(p) for t in by_tag)} == expect
        for tag, steps in by_tag.items():
            assert steps <= set(probe.steps), (tag, sorted(steps), sorted(set(probe.steps)))
    first_tags, second_tags = _steps_by_tag(first.log_dir), _steps_by_tag(second.log_dir)
    # per-step timing: every step after the warm-up, one value per optimizer step (not per micro-batch)
    assert first_tags["time/step_ms"] == set(range(1, 6)) and first_tags["time/warmup_step_ms"] == {0}
    assert second_tags["time/step_ms"] == set(range(7, 10)) and second_tags["time/warmup_step_ms"] == {6}
    assert first_tags["time/summary"] == {5} and second_tags["time/summary"] == {9}
    # windows on the same axis: KernelShare reports at its last step (2); PrecisionInspector inspects step 7
    assert first_tags["kernels/total_ms_per_step"] == first_tags["kernels/categories"] == {2}
    assert second_tags["precision/logits_rel_err"] == second_tags["precision/report"] == {7}
    timer1, timer2 = five1[0], five2[0]
    assert set(timer1.excluded_steps) == {1, 2, 3, 4} and set(timer2.excluded_steps) == {7}
    assert "kernels/total_ms_per_step" not in second_tags  # its window (steps 1..2) lies before the resume
    assert five2[4].result is not None and five2[4].result.step == 7


def _resumable_fit(tmp_path: Path, name: str, callbacks: list[pl.Callback], max_steps: int,
                   ckpt_path: str | None = None) -> list[str]:
    """A tiny CPU fit that checkpoints every 5 steps; returns the warnings it raised."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(0)
    module = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                      attention="naive", warmup_steps=1)
    data = LMDataModule(source="synthetic", batch_size=2, context_length=16, vocab_size=64, train_batches=40,
                        val_batches=1)
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=5, save_top_k=-1)
    trainer = pl.Trainer(max_steps=max_steps, precision="32-true", accelerator="cpu", devices=1,
                         logger=TensorBoardLogger(str(tmp_path), name=name), callbacks=[*callbacks, checkpoint],
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, log_every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data, ckpt_path=ckpt_path)
    return [str(w.message) for w in caught]


def test_a_fit_resumed_inside_kernel_shares_window_profiles_nothing_and_excludes_nothing(tmp_path: Path) -> None:
    """KernelShare's window is steps 4-7; the fit resumes at step 5, inside it. The profiler never runs in that fit,
    so the timer counts every step it measures (none is 'perturbed'), and KernelShare says once why nothing is
    profiled instead of claiming training stopped early."""
    _resumable_fit(tmp_path, "first", [KernelShare(wait=4, warmup=1, active=3)], max_steps=5)
    timer, ks = CudaSyncTimer(warmup_steps=0, print_summary=False), KernelShare(wait=4, warmup=1, active=3)
    said = _resumable_fit(tmp_path, "resumed", [timer, ks], max_steps=10,
                          ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=5.ckpt"))
    assert timer.excluded_steps == {} and timer.summary()["step_ms"]["count"] == 5
    assert ks.summary is None
    assert [m for m in said if m.startswith("KernelShare")] == [
        "KernelShare: this fit starts at step 5 (resumed), past the start of the profiling window (steps 4-7); "
        "nothing is profiled in it. Set wait to a step from 5 on to profile this run."]


#: The tag groups each of the five callbacks logs on a CPU fit (MemorySnapshot logs nothing without CUDA and says so
#: once; NVTXRanges logs no metrics).
CPU_TAGS = {"CudaSyncTimer": ("time/step_ms", "time/summary", "throughput/tokens_per_s"),
            "KernelShare": ("kernels/total_ms_per_step", "kernels/report", "breakdown/compute_share",
                            "breakdown/idle_share", "launch/kernels_per_step"),
            "PrecisionInspector": ("precision/logits_rel_err", "precision/report")}


def _all_tags(log_dir: str) -> set[str]:
    return set(scalars(log_dir)) | set(texts(log_dir))


def _check_defaults(timer_summary: dict, excluded: dict, tags: set[str]) -> None:
    measured = timer_summary["step_ms"]["count"] + len(excluded)
    assert measured == 15  # 20 steps, the timer's 5 warm-up steps apart
    assert timer_summary["step_ms"]["count"] >= 0.8 * measured
    for name, expected in CPU_TAGS.items():
        assert set(expected) <= tags, (name, sorted(set(expected) - tags))


@pytest.mark.slow
def test_five_callbacks_at_their_defaults_in_python(tmp_path: Path) -> None:
    """All five at their defaults: the timer keeps >= 80% of its steps (only KernelShare's profiler window, steps
    5..7, is left out: NVTXRanges at phase depth and the inspected step 0, a warm-up step, perturb nothing counted)."""
    five = [CudaSyncTimer(print_summary=False), NVTXRanges(), MemorySnapshot(), KernelShare(), PrecisionInspector()]
    pl.seed_everything(0)
    module = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                      warmup_steps=1)
    data = LMDataModule(source="synthetic", batch_size=2, context_length=16, vocab_size=64, train_batches=40,
                        val_batches=1)
    trainer = pl.Trainer(max_steps=20, precision="32-true", accelerator="cpu", devices=1,
                         logger=TensorBoardLogger(str(tmp_path), name="defaults"), callbacks=five,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data)
    timer = five[0]
    assert timer.excluded_steps == {5: ["KernelShare"], 6: ["KernelShare"], 7: ["KernelShare"]}
    _check_defaults(timer.summary(), timer.excluded_steps, _all_tags(trainer.log_dir))


@pytest.mark.slow
def test_five_callbacks_at_their_defaults_through_the_cli(tmp_path: Path) -> None:
    """The same through ``--trainer.callbacks+=`` for each callback, on configs/tiny.yaml, 20 steps."""
    names = ("CudaSyncTimer", "NVTXRanges", "MemorySnapshot", "KernelShare", "PrecisionInspector")
    args = [sys.executable, "-m", "lmtrain", "fit", "--config", str(ROOT / "configs" / "tiny.yaml"),
            "--trainer.max_steps", "20", "--trainer.accelerator", "cpu", "--trainer.log_every_n_steps", "1",
            "--data.max_bytes", "200000",
            *[f"--trainer.callbacks+=lmtrain.callbacks.{n}" for n in names]]
    result = subprocess.run(args, cwd=tmp_path, env={**own_job_env(), "CUDA_VISIBLE_DEVICES": ""},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    log_dir = next((tmp_path / "logs").rglob("events.out.tfevents.*")).parent  # the configured logger's folder
    summary = texts(log_dir)["time/summary"][0]
    assert "3 step(s) perturbed by other callbacks' measurements excluded" in summary
    assert "KernelShare: steps 5, 6, 7" in summary
    tags = _all_tags(str(log_dir))
    for name, expected in CPU_TAGS.items():
        assert set(expected) <= tags, (name, sorted(set(expected) - tags))
