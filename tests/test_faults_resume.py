"""FSDP2 distributed checkpoints on 2 CPU processes (gloo): SIGTERM at step 20, resume to 40, equals 40 steps at once.

``python -m lmtrain fit`` under ``ModelParallelStrategy`` saves ``last.ckpt`` as a distributed checkpoint folder
(one shard file per rank plus the loop state). A run sent SIGTERM after step 20 saves it and exits 143; ``--ckpt_path
last`` resumes it to step 40. Its losses, parameters and AdamW state equal those of an uninterrupted 40-step run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from subprocs import ROOT, own_job_env

from lmtrain.checkpoints import find_last_checkpoint, is_distributed_checkpoint, read_checkpoint

STEPS = 40
STOP_AT = 20
#: What both the CPU and the GPU runs add to their model: 40 steps, a checkpoint folder kept, the losses recorded, a
#: SIGTERM after step SIGNAL_STEP (-1: none); the ranks agree on stopping after every step.
OVERLAY = """
trainer:
  max_steps: 40
  log_every_n_steps: 1
  limit_val_batches: 0
  num_sanity_val_steps: 0
  enable_checkpointing: true
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {save_last: true, save_top_k: 0}
    - class_path: loss_recorder.RecordLoss
      init_args: {path: LOSSES}
    - class_path: test_faults_resume.SignalAfterStep
      init_args: {step: SIGNAL_STEP}
"""
CPU_CONFIG = """
seed_everything: 0
model: {size: tiny, vocab_size: 256, context_length: 32, lr: 1.0e-2, warmup_steps: 5, fused_adamw: false}
data: {source: synthetic, batch_size: 2, train_batches: 100, val_batches: 1}
trainer:
  accelerator: cpu
  devices: 2
  strategy:
    class_path: lightning.pytorch.strategies.ModelParallelStrategy
    init_args: {data_parallel_size: 2, tensor_parallel_size: 1}
  precision: 32-true
"""
#: The GPU run: the shipped FSDP2 config cut to 2 of its 32 blocks (261M parameters, 3 GB per checkpoint), naive
#: attention (matrix products only), context 256. Deterministic algorithms: two fresh runs of the shipped config
#: already differ in their first loss on the GPU (by 7e-5 of 9.7), so equality needs them.
GPU_ARGS = ["--config", str(ROOT / "configs" / "2.7B_bf16_fsdp.yaml"), "--config", "overlay.yaml",
            "--model.num_layers", "2", "--model.attention", "naive", "--model.context_length", "256",
            "--data.batch_size", "2", "--trainer.deterministic", "true"]


class SignalAfterStep(pl.Callback):
    """Sends SIGTERM to its own process at the end of optimizer step ``step`` (every rank: as a scheduler does)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _fit(cwd: Path, config_args: list[str], signal_step: int, *extra: str
         ) -> tuple[subprocess.CompletedProcess, list[float]]:
    cwd.mkdir(exist_ok=True)
    losses = cwd / f"losses-{len(list(cwd.glob('losses-*')))}.json"
    (cwd / "overlay.yaml").write_text(OVERLAY.replace("LOSSES", str(losses)).replace("SIGNAL_STEP", str(signal_step)))
    (cwd / "cpu.yaml").write_text(CPU_CONFIG)
    env = own_job_env(ROOT / "tests")
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic cuBLAS asks for (unused on the CPU)
    proc = subprocess.run([sys.executable, "-m", "lmtrain", "fit", *config_args, *extra], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)
    return proc, json.loads(losses.read_text()) if losses.exists() else []


def _state(ckpt: Path) -> dict[str, Any]:
    """The weights and optimizer state of a distributed checkpoint, gathered into one dictionary of full tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(ckpt, out)
    return torch.load(out, weights_only=False)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}/").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in _flat(sub, f"{prefix}{i}/").items()}
    return {prefix.rstrip("/"): tree}


def _check_resume_equals_whole_run(tmp_path: Path, config_args: list[str]) -> None:
    whole, whole_losses = _fit(tmp_path / "whole", config_args, signal_step=-1)
    assert whole.returncode == 0, whole.stderr[-3000:]

    cut = tmp_path / "cut"
    first, first_losses = _fit(cut, config_args, signal_step=STOP_AT)
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-3000:]
    saved = find_last_checkpoint(cut / "logs", "lmtrain")
    assert saved is not None and is_distributed_checkpoint(saved), list(cut.rglob("*"))
    assert read_checkpoint(saved)["global_step"] == STOP_AT
    second, second_losses = _fit(cut, config_args, -1, "--ckpt_path", "last")
    assert second.returncode == 0, second.stderr[-3000:]

    assert len(whole_losses) == STEPS and len(first_losses) == STOP_AT, (len(whole_losses), len(first_losses))
    resumed_losses = first_losses + second_losses
    print("largest loss difference:", max(abs(a - b) for a, b in zip(resumed_losses, whole_losses, strict=True)))
    final = find_last_checkpoint(cut / "logs", "lmtrain")
    assert final == saved and read_checkpoint(final)["global_step"] == STEPS  # the resumed run went on in its folder
    resumed = _flat(_state(final))
    reference = _flat(_state(find_last_checkpoint(tmp_path / "whole" / "logs", "lmtrain")))
    assert resumed.keys() == reference.keys()
    assert any(k.startswith("optimizer_0/state/") and k.endswith("exp_avg_sq") for k in reference), sorted(reference)
    tensors = [k for k, v in reference.items() if isinstance(v, torch.Tensor)]
    print("largest state difference:", max((float((resumed[k].double() - reference[k].double()).abs().max()), k)
                                           for k in tensors))
    assert resumed_losses == whole_losses  # the same numbers, bit for bit
    for key, value in reference.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(resumed[key], value), key
        else:
            assert resumed[key] == value, key


#: The shipped FSDP2 config's optimizer on the CPU: bf16 linear weights whose fp32 shards are the masters, the
#: compact state, torch's AdamW for the other (fp32) parameters, whose state must load too.
MASTER_ARGS = ["--trainer.precision", "bf16-mixed", "--model.master_weights", "true",
               "--model.optimizer_state_dtype", "bfloat16"]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], MASTER_ARGS], ids=["fp32", "master_weights"])
def test_sigterm_then_resume_equals_an_uninterrupted_fsdp2_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                extra: list[str]) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    _check_resume_equals_whole_run(tmp_path, ["--config", "cpu.yaml", "--config", "overlay.yaml", *extra])


@pytest.mark.gpu
def test_sigterm_then_resume_equals_an_uninterrupted_fsdp2_run_on_2_gpus(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _check_resume_equals_whole_run(tmp_path, GPU_ARGS)


def test_last_distributed_checkpoint_is_found_and_read(tmp_path: Path) -> None:
    """A ``last.ckpt`` folder with the loop state beside the shards counts as the run's last checkpoint."""
    older = tmp_path / "lmtrain" / "version_0" / "checkpoints" / "last.ckpt"
    newer = tmp_path / "lmtrain" / "version_1" / "checkpoints" / "last.ckpt"
    for step, folder in enumerate((older, newer)):
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(b"")
        torch.save({"global_step": step + 10}, folder / "meta.pt")
        os.utime(folder / "meta.pt", (1000 + step, 1000 + step))
    os.utime(older / "meta.pt", (2000, 2000))  # rewritten later: the newest, though its folder is older
    (tmp_path / "lmtrain" / "version_2" / "checkpoints" / "last.ckpt").mkdir(parents=True)  # no loop state: not one
    assert find_last_checkpoint(tmp_path, "lmtrain") == older
    assert is_distributed_checkpoint(older) and not is_distributed_checkpoint(older / "meta.pt")
    assert read_checkpoint(older) == {"global_step": 10}
