"""Distributed checkpoint folders (FSDP2's ``last.ckpt``) read on one process: ``generate``, and ``validate``/``test``
on one device.

A folder holds one shard file per rank (torch.distributed.checkpoint) and ``meta.pt`` (hyperparameters, loops, data
state). ``generate`` and a run without FSDP2 read its weights whole, without a process group; ``fit`` without FSDP2
refuses it in one line (its optimizer states are in FSDP2's layout). The slow test trains on 2 gloo processes under
``ModelParallelStrategy`` and checks the folder against the same weights gathered by torch's own converter.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from subprocs import ROOT, own_job_env

from lmtrain.checkpoints import (
    DISTRIBUTED_METADATA,
    FullCheckpointIO,
    check_checkpoint_model,
    find_last_checkpoint,
    read_full_checkpoint,
    resolve_ckpt_path,
)
from lmtrain.cli import main
from lmtrain.errors import LmtrainError
from lmtrain.module import LMModule

TINY = {"size": "tiny", "vocab_size": 256, "context_length": 16, "d_model": 32, "num_layers": 1, "num_heads": 2,
        "d_ff": 64}
GENERATE = ("--prompt", "def ", "--max-new-tokens", "12", "--seed", "3", "--num-samples", "2", "--temperature", "1.5")


def _module_checkpoint(seed: int = 0) -> dict[str, Any]:
    """A checkpoint as fit writes it (hyperparameters, weights, optimizer state, data state) of an untrained model."""
    torch.manual_seed(seed)
    module = LMModule(**TINY)
    module.configure_model()
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()
    # Larger weights than at initialisation, whose logits are nearly uniform: samples that tell models apart.
    weights = {k: v * 8 if v.ndim == 2 else v for k, v in module.state_dict().items()}
    return {"hyper_parameters": dict(module.hparams), "state_dict": weights, "global_step": 7,
            "optimizer_states": [optimizer.state_dict()], "LMDataModule": {"tokenizer": {"kind": "bytes"}}}


def _save_folder(checkpoint: dict[str, Any], folder: Path) -> None:
    """``checkpoint`` as ``ModelParallelStrategy.save_checkpoint`` lays it out: the weights and optimizer states
    through torch.distributed.checkpoint (here from one process), the rest in ``meta.pt``."""
    from torch.distributed.checkpoint import save

    rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    shards = {"state_dict": checkpoint["state_dict"],
              **{f"optimizer_{i}": s for i, s in enumerate(checkpoint.get("optimizer_states", []))}}
    with warnings.catch_warnings():  # torch says it assumes one process: what no_dist asks for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        save(shards, checkpoint_id=folder, no_dist=True)
    torch.save(rest, folder / DISTRIBUTED_METADATA)


def _generate(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    rc = main(["generate", *map(str, args)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_a_folder_loads_the_weights_it_was_saved_from(tmp_path: Path) -> None:
    checkpoint = _module_checkpoint()
    folder = tmp_path / "last.ckpt"
    _save_folder(checkpoint, folder)
    loaded = read_full_checkpoint(folder)
    assert loaded["global_step"] == 7 and loaded["hyper_parameters"] == checkpoint["hyper_parameters"]
    assert "optimizer_states" not in loaded  # the weights only: enough to evaluate or sample
    assert loaded["state_dict"].keys() == checkpoint["state_dict"].keys()
    for key, value in checkpoint["state_dict"].items():
        assert torch.equal(loaded["state_dict"][key], value), key


def test_generate_from_a_folder_equals_generate_from_its_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    checkpoint = _module_checkpoint()
    folder, file = tmp_path / "run" / "last.ckpt", tmp_path / "same.ckpt"
    _save_folder(checkpoint, folder)
    torch.save({k: v for k, v in checkpoint.items() if k != "optimizer_states"}, file)
    rc, from_file, err = _generate(capsys, "--ckpt_path", file, *GENERATE)
    assert rc == 0, err
    rc, from_folder, err = _generate(capsys, "--ckpt_path", folder, *GENERATE)
    assert rc == 0, err
    assert from_folder == from_file and from_file.startswith("--- sample 1 ---\ndef ")
    assert f"{folder} (step 7)" in err
    _save_folder(_module_checkpoint(seed=1), tmp_path / "other")  # other weights: other samples (the test can fail)
    assert _generate(capsys, "--ckpt_path", tmp_path / "other", *GENERATE)[1] != from_file


def test_generate_refuses_a_broken_folder_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "last.ckpt"
    _save_folder(_module_checkpoint(), folder)
    for shard in folder.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])  # cut short, as by a full disk
    plain = tmp_path / "plain"
    plain.mkdir()
    for path, words in ((folder, "cannot be read"), (plain, f"without {DISTRIBUTED_METADATA}")):
        rc, out, err = _generate(capsys, "--ckpt_path", path, "--prompt", "a")
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert err.startswith("error: ") and words in err and "Fix: " in err, err
    with pytest.raises(LmtrainError, match="cannot be read"):
        read_full_checkpoint(folder)


def test_fit_without_fsdp2_refuses_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = tmp_path / "logs"
    folder = logs / "lmtrain" / "version_0" / "checkpoints" / "last.ckpt"
    _save_folder(_module_checkpoint(), folder)
    before = sorted(tmp_path.rglob("*"))
    model = [f"--model.{k}={v}" for k, v in TINY.items()]
    rc = main(["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), *model, "--trainer.accelerator", "cpu",
               "--trainer.max_steps", "9", "--ckpt_path", "last", "--trainer.logger.init_args.save_dir", str(logs)])
    err = capsys.readouterr().err
    assert rc == 2 and err.splitlines()[-1].startswith("error: ckpt_path: ") and "ModelParallelStrategy" in err, err
    assert "Resuming" not in err  # no word of a run folder for a run that does not start
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


def test_validate_without_fsdp2_reads_the_folder_whole(tmp_path: Path) -> None:
    """``validate``/``test`` of a folder on one device get :class:`FullCheckpointIO`; under FSDP2, Lightning's own
    sharded loading stays."""
    folder = tmp_path / "last.ckpt"
    checkpoint = _module_checkpoint()
    _save_folder(checkpoint, folder)
    fsdp2 = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy"}
    for subcommand, strategy, plugins in (("validate", "auto", None), ("test", None, ["bf16-mixed"]),
                                          ("validate", fsdp2, None)):
        config: dict[str, Any] = {"ckpt_path": str(folder), "model": dict(TINY),
                                  "trainer": {"strategy": strategy, "devices": 1, "plugins": plugins}}
        resolve_ckpt_path(config, subcommand)
        added = [p for p in config["trainer"]["plugins"] or [] if getattr(p, "class_path", None)]
        if strategy is fsdp2:
            assert added == [] and config["trainer"]["plugins"] is None
        else:
            assert [p.class_path for p in added] == ["lmtrain.checkpoints.FullCheckpointIO"]
            assert config["trainer"]["plugins"][:-1] == (plugins or [])  # the given plugins kept, first
    loaded = FullCheckpointIO().load_checkpoint(folder)
    assert loaded["global_step"] == 7 and torch.equal(loaded["state_dict"]["model.embedding.weight"],
                                                      checkpoint["state_dict"]["model.embedding.weight"])


def test_a_folder_keeps_the_requested_model_options(tmp_path: Path) -> None:
    """LightningCLI takes a checkpoint's options from a file only: of a folder the requested ones apply."""
    folder = tmp_path / "last.ckpt"
    _save_folder(_module_checkpoint(), folder)
    with pytest.warns(UserWarning, match=r"the requested model options apply, not the distributed checkpoint's .*"
                                         r"lr=0\.5 \(checkpoint 0\.0003\)"):
        check_checkpoint_model(folder, {**TINY, "lr": 0.5})


# -- 2 FSDP2 processes on the CPU ------------------------------------------------------------------------


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "lmtrain", *args], cwd=cwd, env=own_job_env(ROOT / "tests"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _logged(proc: subprocess.CompletedProcess, name: str) -> float:
    """A metric of the table that validate/test print (plain, or drawn with box characters where ``rich`` is
    installed: ``│ val/loss │ 2.33 │``)."""
    match = re.search(rf"^[\s│┃]*{re.escape(name)}[\s│┃]+([^\s│┃]+)[\s│┃]*$", proc.stdout, re.MULTILINE)
    assert match is not None, proc.stdout[-3000:]
    return float(match.group(1))


def _check_folder_read_on_one_process(tmp_path: Path, capsys: pytest.CaptureFixture[str], config_args: list[str],
                                      generate_args: tuple[str, ...], one_device: list[str], rel: float) -> None:
    """Fit 3 steps on 2 ranks under FSDP2 with ``config_args``; the folder's weights equal torch's own gathering of
    its shards bit for bit, generate from the folder equals generate from a file of those weights, and validate and
    test with ``one_device`` added give the losses of validate and test under FSDP2 (within ``rel``)."""
    from test_faults_resume import _fit, _state

    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(4000)))
    data = ["--data.source", "text", "--data.path", str(text), "--data.test_fraction", "0.1"]
    proc, _ = _fit(tmp_path, config_args, -1, "--trainer.max_steps", "3", *data)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = find_last_checkpoint(tmp_path / "logs", "lmtrain")
    assert folder is not None and folder.is_dir() and len(list(folder.glob("*.distcp"))) == 2

    loaded = read_full_checkpoint(folder)
    gathered = _state(folder)  # torch's converter: every entry of the shards, optimizer states included
    assert loaded["state_dict"].keys() == gathered["state_dict"].keys()
    for key, value in gathered["state_dict"].items():
        assert torch.equal(loaded["state_dict"][key], value), key
    file = tmp_path / "same.ckpt"
    torch.save({**torch.load(folder / DISTRIBUTED_METADATA, weights_only=True), "state_dict": gathered["state_dict"]},
               file)
    results = {}
    for path in (folder, file):
        rc, out, err = _generate(capsys, "--ckpt_path", path, *GENERATE, *generate_args)
        assert rc == 0, err
        results[path] = out
    assert results[folder] == results[file] and results[file].startswith("--- sample 1 ---\ndef ")

    evaluate = [*config_args, *data, "--trainer.limit_val_batches", "1.0", "--trainer.limit_test_batches", "1.0"]
    for command, metric in (("validate", "val/loss"), ("test", "test/loss")):
        fsdp2 = _run(tmp_path, command, *evaluate, "--ckpt_path", "last")
        single = _run(tmp_path, command, *evaluate, *one_device, "--ckpt_path", "last")
        assert f"{command.capitalize()} of {folder.relative_to(tmp_path)}" in single.stderr
        print(command, "under FSDP2:", _logged(fsdp2, metric), "on one device:", _logged(single, metric))
        assert _logged(single, metric) == pytest.approx(_logged(fsdp2, metric), rel=rel)


@pytest.mark.slow
def test_fsdp2_folder_read_on_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    # One device sees the global batch of the 2 ranks (2 x 2 windows) at once.
    one_device = ["--trainer.devices", "1", "--trainer.strategy", "auto", "--data.batch_size", "4"]
    _check_folder_read_on_one_process(tmp_path, capsys, ["--config", "cpu.yaml", "--config", "overlay.yaml"], (),
                                      one_device, rel=1e-5)


@pytest.mark.gpu
def test_fsdp2_folder_read_on_one_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The shipped FSDP2 config (bf16-mixed, master weights, compiled blocks) cut to 2 blocks: its folder sampled
    and evaluated on one GPU (bf16 compute under two layouts: losses within 1%)."""
    from test_faults_resume import GPU_ARGS

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    one_device = ["--trainer.devices", "1", "--trainer.strategy", "auto", "--data.batch_size", "4"]
    _check_folder_read_on_one_process(tmp_path, capsys, GPU_ARGS, ("--device", "cuda"), one_device,
                                      rel=1e-2)
