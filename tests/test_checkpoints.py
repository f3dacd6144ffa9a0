"""Checkpoints: stop on a signal and resume to the same losses, in the same run folder; refuse another model."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from tb import scalars

from lmtrain.checkpoints import (
    CheckpointOnSignal,
    ResumedProgressBar,
    find_last_checkpoint,
    resolve_ckpt_path,
    run_version,
)
from lmtrain.data import LMDataModule
from lmtrain.errors import LmtrainError
from lmtrain.module import LMModule, lr_factor

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
MODEL = dict(size="tiny", vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64,
             warmup_steps=5)


class SignalAt(pl.Callback):
    """Sends this process a real signal at the end of one training step (a deterministic preemption)."""

    def __init__(self, step: int, signum: int = signal.SIGTERM) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def fit(steps: int, data: dict, ckpt_path: str | None = None, version: int | None = None,
        extra: list[pl.Callback] | None = None, accumulate: int = 1, **model) -> pl.Trainer:
    """A tiny fit logging every step to logs/lmtrain/version_N in the current folder, keeping last.ckpt."""
    pl.seed_everything(0, verbose=False)
    module = LMModule(**{**MODEL, **model})
    datamodule = LMDataModule(**{"batch_size": 2, "train_batches": 15, "val_batches": 2, **data})
    callbacks = [ModelCheckpoint(save_last=True, save_top_k=0, every_n_train_steps=7), *(extra or []),
                 CheckpointOnSignal()]
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, precision="32-true",
                         logger=TensorBoardLogger("logs", name="lmtrain", version=version, default_hp_metric=False),
                         callbacks=callbacks, log_every_n_steps=1, val_check_interval=10, num_sanity_val_steps=0,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=accumulate)
    trainer.fit(module, datamodule, ckpt_path=ckpt_path)
    return trainer


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _data_kwargs(source: str, tmp: Path) -> dict:
    if source == "synthetic":
        return {"source": "synthetic"}
    path = tmp / "tokens.npy"
    np.save(path, np.random.default_rng(1).integers(0, 64, 5000).astype(np.int32))
    return {"source": "tokens", "path": str(path)}


# -- the acceptance test: stopped at step 20 and resumed to 40 equals 40 uninterrupted steps ------------------


@pytest.mark.parametrize("source", ["synthetic", "tokens"])
def test_sigterm_at_20_then_resume_to_40_equals_40_steps(source: str, in_tmp: Path) -> None:
    data = _data_kwargs(source, in_tmp)
    straight = scalars(fit(40, data).log_dir)

    stopped = fit(40, data, extra=[SignalAt(20)])
    assert stopped.global_step == 20  # stopped after the step that the signal interrupted
    run_dir = Path(stopped.log_dir)
    last = find_last_checkpoint("logs", "lmtrain")
    assert last == run_dir / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 20
    version = run_version(last, "logs", "lmtrain")
    assert version == 1 and run_dir.name == "version_1"

    resumed = fit(40, data, ckpt_path=str(last), version=version)
    assert Path(resumed.log_dir) == run_dir  # the same run folder, no version_2
    assert sorted(p.name for p in (in_tmp / "logs" / "lmtrain").iterdir()) == ["version_0", "version_1"]
    logged = scalars(run_dir)  # both event files of the folder
    # Exact equality at every step: same weights, optimizer state, schedule and the same batches.
    assert [s for s, _ in logged["train/loss"]] == list(range(40))
    assert logged["train/loss"] == straight["train/loss"]
    assert logged["train/lr"] == straight["train/lr"]


class SignalAtMicroBatch(pl.Callback):
    """Sends this process SIGTERM at the end of the n-th training batch of the fit (1-based), a micro-batch."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.seen += 1
        if self.seen == self.n:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_inside_an_accumulation_window_stops_at_its_end_and_resumes_exactly(in_tmp: Path) -> None:
    """Two micro-batches per step; SIGTERM after the fifth (the first of step 2's window): the fit stops after the
    sixth, which steps, so the checkpoint holds no half-accumulated gradient, and the resumed run's losses equal an
    uninterrupted run's at every step (saving after the fifth lost its gradient: different weights)."""
    data = {"source": "synthetic"}
    straight = scalars(fit(8, data, accumulate=2).log_dir)
    stopped = fit(8, data, extra=[SignalAtMicroBatch(5)], accumulate=2)
    assert stopped.global_step == 3
    last = find_last_checkpoint("logs", "lmtrain")
    saved = torch.load(last, weights_only=False)
    assert saved["global_step"] == 3 and saved["LMDataModule"]["next_batch"] == 6
    resumed = fit(8, data, ckpt_path=str(last), version=run_version(last, "logs", "lmtrain"), accumulate=2)
    assert resumed.global_step == 8
    logged = scalars(resumed.log_dir)
    assert [s for s, _ in logged["train/loss"]] == [s for s, _ in straight["train/loss"]]
    assert logged["train/loss"] == straight["train/loss"]


class LrAt(pl.Callback):
    """Records the learning rate that each training step uses."""

    def __init__(self) -> None:
        self.lr: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.lr[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]


def test_resume_with_more_steps_keeps_the_checkpoints_schedule(in_tmp: Path) -> None:
    """A run of 20 steps stopped at 8 and resumed with max_steps 40 continues the 20-step cosine decay."""
    fit(20, {}, extra=[SignalAt(8)])
    last = find_last_checkpoint("logs", "lmtrain")
    assert torch.load(last, weights_only=False)["lmtrain_lr_schedule"] == {"decay_steps": 20}
    resumed = LrAt()
    trainer = fit(40, {}, ckpt_path=str(last), version=0, extra=[resumed, SignalAt(11)])
    module = trainer.lightning_module
    assert module.schedule_decay_steps == 20
    # The rates the interrupted 20-step run would have used at steps 8..10 (a 40-step decay would be higher).
    planned = [module.config.lr * lr_factor(s, MODEL["warmup_steps"], 20, module.config.min_lr_ratio)
               for s in range(8, 11)]
    assert [resumed.lr[s] for s in range(8, 11)] == pytest.approx(planned, rel=1e-9)
    assert resumed.lr[8] < module.config.lr * lr_factor(8, MODEL["warmup_steps"], 40, module.config.min_lr_ratio)


class BarTotal(pl.Callback):
    """Reads the total of Lightning's progress bar at the first batch of a fit (after every on_train_start)."""

    total: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if self.total is None:
            bar = next(c for c in trainer.callbacks if isinstance(c, TQDMProgressBar))
            self.total = bar.train_progress_bar.total


def test_progress_bar_has_its_total_after_a_mid_epoch_resume(in_tmp: Path) -> None:
    fit(8, {})  # ends at batch 8 of the first 15-batch epoch

    def resume(extra: list[pl.Callback]) -> BarTotal:
        reader = BarTotal()
        trainer = pl.Trainer(accelerator="cpu", max_steps=12, logger=False, enable_model_summary=False,
                             num_sanity_val_steps=0, callbacks=[TQDMProgressBar(), *extra, reader])
        trainer.fit(LMModule(**MODEL), LMDataModule(batch_size=2, train_batches=15, val_batches=2),
                    ckpt_path=str(find_last_checkpoint("logs", "lmtrain")))
        return reader

    assert resume([]).total != 12  # Lightning alone: 4 steps left, passed by the count 9 at once, or none
    assert resume([ResumedProgressBar()]).total == 12  # the bar counts batches 9..12 of this epoch


def test_checkpoint_at_max_steps_is_refused(in_tmp: Path) -> None:
    fit(9, {})
    config = {"ckpt_path": "last", "trainer": {"max_steps": 9, "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "logs", "name": "lmtrain", "version": None}}}}
    with pytest.raises(LmtrainError) as info:
        resolve_ckpt_path(config, "fit")
    assert info.value.field == "trainer.max_steps" and "at step 9" in info.value.problem
    config["trainer"]["max_steps"] = 10
    resolve_ckpt_path(config, "fit")  # one step left: fine


def test_resume_without_the_data_position_would_differ(in_tmp: Path) -> None:
    """The data position is what makes resume exact: drop it and the losses after step 20 change."""
    straight = scalars(fit(30, {}).log_dir)
    fit(30, {}, extra=[SignalAt(20)])
    last = find_last_checkpoint("logs", "lmtrain")
    checkpoint = torch.load(last, weights_only=False)
    checkpoint["LMDataModule"]["next_batch"] = checkpoint["LMDataModule"]["batch_in_epoch"] = 0
    checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] = [{"next_batch": 0, "batch_in_epoch": 0}]
    torch.save(checkpoint, last)
    resumed = scalars(fit(30, {}, ckpt_path=str(last), version=1).log_dir)
    assert resumed["train/loss"][:20] == straight["train/loss"][:20]
    assert resumed["train/loss"][20:] != straight["train/loss"][20:]


def test_sigint_saves_then_stops_and_a_second_one_interrupts(in_tmp: Path) -> None:
    trainer = fit(40, {}, extra=[SignalAt(5, signal.SIGINT)])
    assert trainer.global_step == 5
    assert torch.load(find_last_checkpoint("logs", "lmtrain"), weights_only=False)["global_step"] == 5
    # The handlers are gone after fit: Python's own SIGINT handler is back.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    callback = CheckpointOnSignal()
    callback.received = "SIGINT"
    with pytest.raises(KeyboardInterrupt):
        callback._handle(signal.SIGINT, None)


def test_last_checkpoint_written_at_the_end_of_training(in_tmp: Path) -> None:
    trainer = fit(9, {})  # ModelCheckpoint saves at step 7 only; the end of training adds step 9
    checkpoint = torch.load(Path(trainer.log_dir) / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 9
    assert checkpoint["lmtrain"]["version"] == 0


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_cli_stopped_by_a_signal_exits_128_plus_its_number(signum: int, status: int, tmp_path: Path) -> None:
    args = ["fit", *SMALL_TINY, "--trainer.max_steps", "20", "--trainer.callbacks+=test_checkpoints.SignalAt",
            "--trainer.callbacks.step", "3", "--trainer.callbacks.signum", str(int(signum))]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    result = subprocess.run([sys.executable, "-m", "lmtrain", *args], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == status, result.stderr
    assert f"{signal.Signals(signum).name}: saved" in result.stderr + result.stdout
    assert torch.load(tmp_path / "logs/lmtrain/version_0/checkpoints/last.ckpt", weights_only=False)["global_step"] == 3


class SignalInFinalValidation(pl.Callback):
    """Sends this process SIGTERM in the validation that follows training step ``step`` of a fit."""

    def __init__(self, step: int) -> None:
        self.step, self.sent = step, False

    def on_validation_batch_end(self, trainer, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        if not self.sent and trainer.state.fn == "fit" and trainer.global_step == self.step:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_a_signal_after_the_last_step_exits_0(tmp_path: Path) -> None:
    """SIGTERM in the validation after the last training step: training is complete and last.ckpt holds its last
    step, so the command exits 0 (143 would make a scheduler resubmit a run that has nothing left to train)."""
    args = ["fit", *SMALL_TINY, "--trainer.max_steps", "10", "--trainer.val_check_interval", "5",
            "--trainer.limit_val_batches", "2", "--trainer.callbacks+=test_checkpoints.SignalInFinalValidation",
            "--trainer.callbacks.step", "10"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    result = subprocess.run([sys.executable, "-m", "lmtrain", *args], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SIGTERM arrived after the last training step (step 10): the run is complete" in result.stderr + \
        result.stdout
    last = tmp_path / "logs/lmtrain/version_0/checkpoints/last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 10


@pytest.mark.slow
def test_sigterm_in_a_subprocess_saves_and_exits_0(tmp_path: Path) -> None:
    script = tmp_path / "preempted.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_checkpoints import SignalAt, fit
        trainer = fit(40, {{}}, extra=[SignalAt(6)])
        print("stopped at", trainer.global_step)
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "stopped at 6" in result.stdout
    assert "SIGTERM: saved" in result.stderr + result.stdout
    assert torch.load(tmp_path / "logs/lmtrain/version_0/checkpoints/last.ckpt", weights_only=False)["global_step"] == 6


def test_no_checkpointing_stops_on_a_signal_and_saves_nothing(in_tmp: Path) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    callback = CheckpointOnSignal()
    trainer = pl.Trainer(accelerator="cpu", max_steps=20, logger=False, enable_checkpointing=False,
                         callbacks=[SignalAt(2, signal.SIGINT), callback], enable_progress_bar=False,
                         limit_val_batches=0)
    trainer.fit(LMModule(**MODEL), LMDataModule(batch_size=2, train_batches=30))
    assert trainer.global_step == 2 and callback.received == "SIGINT"  # stopped after the signalled step
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers are back
    assert not list(in_tmp.rglob("*.ckpt")) and not (in_tmp / "lightning_logs").exists()


# -- resuming with something else ---------------------------------------------------------------------------


def test_another_model_is_refused_with_the_fields(in_tmp: Path) -> None:
    last = str(Path(fit(3, {}).log_dir) / "checkpoints" / "last.ckpt")
    with pytest.raises(LmtrainError) as info:
        fit(6, {}, ckpt_path=last, version=0, num_layers=3, vocab_size=128)
    assert info.value.field == "model.vocab_size, model.num_layers"
    assert "num_layers 2 in the checkpoint, 3 requested" in info.value.problem
    assert "--model.vocab_size 64 --model.num_layers 2" in info.value.fix
    with pytest.raises(LmtrainError):
        LMModule.load_from_checkpoint(last, d_ff=128)
    # Options that do not change the weights may differ.
    trainer = fit(6, {}, ckpt_path=last, version=0, attention="naive", activation_checkpointing=True)
    assert trainer.global_step == 6


def test_another_global_batch_is_refused(in_tmp: Path) -> None:
    last = str(Path(fit(3, {}).log_dir) / "checkpoints" / "last.ckpt")
    with pytest.raises(LmtrainError) as info:
        fit(6, {"batch_size": 4}, ckpt_path=last, version=0)
    assert info.value.field == "data.batch_size" and "2" in info.value.fix


# -- the command line: --ckpt_path last finds the newest run and continues its folder ------------------------


def run_cli(args: list[str]) -> None:
    """LightningCLI as lmtrain's LMCli sets it up, with the resume hook and the signal callback."""

    class Cli(LightningCLI):
        def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001
            parser.link_arguments("model.context_length", "data.context_length")
            parser.link_arguments("model.vocab_size", "data.vocab_size")

        def parse_arguments(self, parser, args) -> None:  # noqa: ANN001
            super().parse_arguments(parser, args)
            resolve_ckpt_path(self.config[self.config.subcommand], self.config.subcommand)

    Cli(LMModule, LMDataModule, args=args, save_config_kwargs={"overwrite": True},
        trainer_defaults={"logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                                     "init_args": {"save_dir": "logs", "name": "lmtrain"}},
                          "callbacks": [CheckpointOnSignal()]})


SMALL_TINY = ["--config", str(TINY), "--model.context_length", "32", "--data.max_bytes", "60000",
              "--data.batch_size", "4", "--data.val_batches", "2", "--trainer.log_every_n_steps", "1",
              "--trainer.val_check_interval", "3", "--trainer.enable_progress_bar", "false"]


@pytest.mark.slow
def test_cli_resume_last_continues_the_same_run_folder(in_tmp: Path) -> None:
    run_cli(["fit", *SMALL_TINY, "--trainer.max_steps", "6"])
    run_dir = in_tmp / "logs" / "lmtrain" / "version_0"
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    run_cli(["fit", *SMALL_TINY, "--trainer.max_steps", "10", "--ckpt_path", "last"])
    assert [p.name for p in (in_tmp / "logs" / "lmtrain").iterdir()] == ["version_0"]
    assert [s for s, _ in scalars(run_dir)["train/loss"]] == list(range(10))
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 10


@pytest.mark.slow
def test_cli_validate_and_test_use_the_checkpoint(in_tmp: Path, recwarn: pytest.WarningsRecorder) -> None:
    run_cli(["fit", *SMALL_TINY, "--trainer.max_steps", "6"])
    recwarn.clear()
    run_cli(["validate", *SMALL_TINY, "--ckpt_path", "last"])
    run_cli(["test", *SMALL_TINY, "--ckpt_path", "last"])
    assert [p.name for p in (in_tmp / "logs" / "lmtrain").iterdir()] == ["version_0"]  # logged beside the fit
    assert not [w for w in recwarn if "untrained" in str(w.message)]
    assert not [w for w in recwarn if "test_fraction" in str(w.message)]  # tiny.yaml has a test split
    with pytest.warns(UserWarning, match="validate is measuring untrained weights"):
        run_cli(["validate", *SMALL_TINY])
    for command in ("validate", "fit"):
        with pytest.raises(LmtrainError) as info:
            run_cli([command, *SMALL_TINY, "--ckpt_path", "last", "--model.num_layers", "2"])
        assert info.value.field == "model.num_layers" and "--model.num_layers 4" in info.value.fix
    # Other options are the checkpoint's (LightningCLI's rule), and the run says so.
    with pytest.warns(UserWarning, match=r"lr=0.003 \(requested 0.001\)"):
        run_cli(["validate", *SMALL_TINY, "--ckpt_path", "last", "--model.lr", "0.001"])


@pytest.mark.slow
def test_cli_last_without_a_checkpoint(in_tmp: Path) -> None:
    with pytest.raises(LmtrainError) as info:
        run_cli(["test", *SMALL_TINY, "--ckpt_path", "last"])
    assert info.value.field == "ckpt_path" and "run fit first" in info.value.fix
    with pytest.warns(UserWarning, match="starting a new run"):
        run_cli(["fit", *SMALL_TINY, "--trainer.max_steps", "2", "--ckpt_path", "last"])
    assert (in_tmp / "logs" / "lmtrain" / "version_0" / "checkpoints" / "last.ckpt").is_file()


def test_resolve_ckpt_path(in_tmp: Path) -> None:
    logger = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
              "init_args": {"save_dir": "logs", "name": "lmtrain", "version": None}}
    for version, age in ((0, 100), (3, 50), (2, 0)):  # version_2 holds the newest last.ckpt
        folder = in_tmp / "logs" / "lmtrain" / f"version_{version}" / "checkpoints"
        folder.mkdir(parents=True)
        (folder / "last.ckpt").write_bytes(b"x")
        os.utime(folder / "last.ckpt", (1e9 - age, 1e9 - age))
    config = {"ckpt_path": "last", "trainer": {"logger": logger}}
    resolve_ckpt_path(config, "fit")
    assert config["ckpt_path"] == os.path.join("logs", "lmtrain", "version_2", "checkpoints", "last.ckpt")
    assert logger["init_args"]["version"] == 2
    # validate and test log into the checkpoint's run folder too (no new version_N).
    for command in ("validate", "test", "fit"):  # an absolute path inside the log folder: its version
        logger["init_args"]["version"] = None
        config = {"ckpt_path": str(in_tmp / "logs/lmtrain/version_3/checkpoints/last.ckpt"),
                  "trainer": {"logger": logger}}
        resolve_ckpt_path(config, command)
        assert logger["init_args"]["version"] == 3
    with pytest.raises(LmtrainError) as info:
        resolve_ckpt_path({"ckpt_path": "nope.ckpt", "trainer": {"logger": logger}}, "fit")
    assert info.value.field == "ckpt_path"
    assert run_version(in_tmp / "elsewhere" / "version_1" / "checkpoints" / "last.ckpt") is None


# -- the real command line: bad checkpoints and bad data stop with one line, exit 2 --------------------------


def _lmtrain(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "lmtrain", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _one_error_line(result: subprocess.CompletedProcess, field: str) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert re.fullmatch(rf"error: {re.escape(field)}: .+ Fix: .+", errors[0]), errors[0]
    return errors[0]


@pytest.mark.slow
def test_cli_mismatched_checkpoint_is_one_line(in_tmp: Path) -> None:
    last = Path(fit(2, {}).log_dir) / "checkpoints" / "last.ckpt"
    args = ["--config", str(TINY), "--model.d_model", "32", "--model.num_layers", "3", "--model.num_heads", "2",
            "--model.d_ff", "64", "--model.vocab_size", "64", "--model.context_length", "16", "--data.source",
            "synthetic", "--ckpt_path", str(last)]
    for command in ("validate", "fit"):
        line = _one_error_line(_lmtrain([command, *args], in_tmp), "model.num_layers")
        assert "--model.num_layers 2" in line


@pytest.mark.slow
def test_cli_negative_token_ids_are_one_line(tmp_path: Path) -> None:
    path = tmp_path / "ids.npy"
    ids = np.arange(2000, dtype=np.int32) % 200
    ids[1234] = -7
    np.save(path, ids)
    cwd = tmp_path / "run"
    cwd.mkdir()
    result = _lmtrain(["fit", "--config", str(TINY), "--trainer.max_steps", "2", "--data.source", "tokens",
                       "--data.path", str(path)], cwd)
    line = _one_error_line(result, "data.path")
    assert "negative token id -7" in line
    assert list(cwd.iterdir()) == []  # nothing written


def test_lightning_per_step_sigterm_broadcast_is_skipped_on_several_ranks_and_restored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    calls: list[torch.Tensor] = []
    monkeypatch.setattr(torch.distributed, "broadcast", lambda tensor, src=0, **_: calls.append(tensor.clone()))
    real = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    loop = real.fit_loop.epoch_loop
    loop._broadcast_sigterm_tensor()  # Lightning's own check: one broadcast of the flag
    assert len(calls) == 1 and calls[0].tolist() == [0]
    callback = CheckpointOnSignal(peer_timeout_s=None)
    one_rank = SimpleNamespace(world_size=1, fit_loop=real.fit_loop, checkpoint_callback=None, received_sigterm=False)
    callback.on_train_start(one_rank, None)  # one process: Lightning does not broadcast there; left alone
    loop._broadcast_sigterm_tensor()
    assert len(calls) == 2
    callback.teardown(one_rank, None, "fit")
    two_ranks = SimpleNamespace(world_size=2, fit_loop=real.fit_loop, checkpoint_callback=None, received_sigterm=True)
    callback.on_train_start(two_ranks, None)
    try:
        loop._broadcast_sigterm_tensor()
        assert len(calls) == 2  # skipped while the callback owns SIGTERM
        assert callback.received == "SIGTERM"  # a SIGTERM Lightning's handler took before training is kept
    finally:
        callback.teardown(two_ranks, None, "fit")
    loop._broadcast_sigterm_tensor()
    assert len(calls) == 3  # Lightning's check is back after the fit


@pytest.mark.parametrize(("saved", "requested"), [(True, False), (False, True)])
def test_resuming_across_master_weights_is_refused(saved: bool, requested: bool, in_tmp: Path) -> None:
    """With master weights the fp32 values of the linear weights live in the optimizer state; resumed across the
    setting they would be rounded to bf16 silently. Resuming is refused in one line naming the checkpoint's value;
    loading the weights alone still works."""
    def trainer(steps: int) -> pl.Trainer:
        return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, precision="bf16-mixed", logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          limit_val_batches=0)

    data = {"batch_size": 2, "train_batches": 15, "val_batches": 2, "source": "synthetic"}
    pl.seed_everything(0, verbose=False)
    first = trainer(2)
    first.fit(LMModule(**MODEL, master_weights=saved), LMDataModule(**data))
    first.save_checkpoint("saved.ckpt")
    with pytest.raises(LmtrainError, match=rf"trained with master_weights {saved}, this run asks for {requested}") \
            as raised:
        trainer(4).fit(LMModule(**MODEL, master_weights=requested), LMDataModule(**data), ckpt_path="saved.ckpt")
    assert raised.value.fix.startswith(f"resume with --model.master_weights {str(saved).lower()}")
    loaded = LMModule.load_from_checkpoint("saved.ckpt", master_weights=requested)
    assert loaded.config.master_weights is requested
