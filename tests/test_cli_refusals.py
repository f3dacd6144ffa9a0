"""Bad input to ``fit``/``validate``/``test`` stops with one line naming the real field, exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from refusals import refused

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("command", ["fit", "validate", "test"])
def test_no_config_is_refused(command: str, in_tmp: Path, capsys: pytest.CaptureFixture) -> None:
    line = refused([command], "--config", capsys, in_tmp)
    assert "small model" in line and "configs/tiny.yaml" in line.split("Fix:")[1]


CALLBACK_ARGUMENTS = [
    (["--trainer.callbacks+=lmtrain.callbacks.CudaSyncTimer", "--trainer.callbacks.warmup", "3"],
     "trainer.callbacks.CudaSyncTimer.warmup", "did you mean warmup_steps?"),
    (["--trainer.callbacks+=lmtrain.callbacks.CudaSyncTimer", "--trainer.callbacks.sync", "bogus"],
     "trainer.callbacks.CudaSyncTimer.sync", "use one of events, synchronize."),
    (["--trainer.callbacks+=lmtrain.callbacks.NVTXRanges", "--trainer.callbacks.depth", "bogus"],
     "trainer.callbacks.NVTXRanges.depth", "use one of step, phase, block, module, op."),
    (["--trainer.callbacks+=lmtrain.callbacks.CudaSyncTimer", "--trainer.callbacks.warmup_steps", "x"],
     "trainer.callbacks.CudaSyncTimer.warmup_steps", "give a value of type int."),
]


@pytest.mark.parametrize(("args", "field", "fix"), CALLBACK_ARGUMENTS)
def test_bad_callback_argument_names_the_argument(args: list[str], field: str, fix: str, in_tmp: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    line = refused(["fit", "--config", TINY, *args], field, capsys, in_tmp)
    assert fix in line.split("Fix:")[1], line
    assert "importable" not in line


def test_bad_callback_argument_in_yaml(in_tmp: Path, capsys: pytest.CaptureFixture) -> None:
    extra = in_tmp / "callbacks.yaml"
    extra.write_text("trainer:\n  callbacks:\n    - class_path: lmtrain.callbacks.CudaSyncTimer\n"
                     "      init_args:\n        warmup: 3\n")
    line = refused(["fit", "--config", TINY, "--config", str(extra)], "trainer.callbacks.CudaSyncTimer.warmup",
                   capsys, in_tmp)
    assert "warmup_steps" in line


@pytest.mark.parametrize(("callback", "argument", "value"), [("CudaSyncTimer", "warmup_steps", "-3"),
                                                             ("MemorySnapshot", "start_step", "-1"),
                                                             ("KernelShare", "active", "0")])
def test_callback_argument_checks_write_nothing(callback: str, argument: str, value: str, in_tmp: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    refused(["fit", "--config", TINY, f"--trainer.callbacks+=lmtrain.callbacks.{callback}",
             f"--trainer.callbacks.{argument}", value], f"callbacks.{callback}.{argument}", capsys, in_tmp)


def test_bad_data_path_is_one_line(in_tmp: Path, capsys: pytest.CaptureFixture) -> None:
    line = refused(["fit", "--config", TINY, "--data.source", "tokens", "--data.path", "nonexist"], "data.path",
                   capsys, in_tmp)
    assert "nonexist does not exist" in line


@pytest.mark.parametrize("command", ["fit", "validate", "test"])
def test_prepared_split_shorter_than_the_context_is_one_line(command: str, in_tmp: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    """A folder that prepare wrote without --context-length, whose validation split (30 tokens) is shorter than
    the run's window: refused at data setup, naming the file, its count and the context length."""
    from lmtrain.cli import main

    (in_tmp / "c.txt").write_text("abcdefghij" * 30 + "\n")  # 301 one-byte tokens: train 256, val 30, test 15
    assert main(["prepare", "--quiet", "--input", "c.txt", "--out", "ds", "--vocab-size", "257"]) == 0
    line = refused([command, "--config", str(ROOT / "configs" / "tiny_bpe.yaml"), "--data.path", "ds",
                    "--model.vocab_size", "257", "--model.context_length", "64"], "data.path", capsys, in_tmp)
    assert "ds/val.bin (the val split) holds 30 tokens, fewer than one window of context_length 64 + 1 = 65." in line
    assert "model.context_length to at most 29" in line.split("Fix:")[1]


@pytest.mark.parametrize(("argument", "value"), [("prompts", "[]"), ("every_n_steps", "0")])
def test_bad_sample_argument_writes_nothing(argument: str, value: str, in_tmp: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    """GenerateSamples' arguments (and its prompts against the data's tokenizer) are checked before the trainer
    reports its devices and before any run folder exists."""
    refused(["fit", "--config", TINY, "--trainer.callbacks+=lmtrain.callbacks.GenerateSamples",
             f"--trainer.callbacks.{argument}", value], f"callbacks.GenerateSamples.{argument}", capsys, in_tmp)


def test_sample_callback_checked_against_the_data_before_the_trainer() -> None:
    """check_callbacks runs GenerateSamples' data checks (here: a tokenizer larger than the model's vocabulary)."""
    from types import SimpleNamespace

    from lmtrain.callbacks import GenerateSamples
    from lmtrain.cli_config import check_callbacks
    from lmtrain.errors import LmtrainError

    data = SimpleNamespace(tokenizer={"kind": "bytes"})
    check_callbacks([GenerateSamples()], 1, data, SimpleNamespace(model=None, hparams={"vocab_size": 256}))
    with pytest.raises(LmtrainError) as info:
        check_callbacks([GenerateSamples()], 1, data, SimpleNamespace(model=None, hparams={"vocab_size": 100}))
    assert info.value.field == "model.vocab_size"


def _truncated_checkpoint(path: Path) -> Path:
    import torch

    torch.save({"state_dict": {"w": torch.zeros(20000)}, "global_step": 3}, path)
    path.write_bytes(path.read_bytes()[:40000])  # cut short, as by a full disk
    return path


@pytest.mark.parametrize("command", ["fit", "validate"])
@pytest.mark.parametrize("kind", ["truncated", "garbage", "folder"])
def test_unreadable_checkpoint_is_one_line(command: str, kind: str, in_tmp: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    inputs = in_tmp / "inputs"
    inputs.mkdir()
    if kind == "truncated":
        ckpt = _truncated_checkpoint(inputs / "last.ckpt")
    elif kind == "garbage":
        ckpt = inputs / "notes.ckpt"
        ckpt.write_text("not a checkpoint\n")
    else:
        ckpt = inputs / "run"
        ckpt.mkdir()
    line = refused([command, "--config", TINY, "--ckpt_path", str(ckpt)], "ckpt_path", capsys, in_tmp)
    expected = {"truncated": "cannot be read as a checkpoint", "garbage": "cannot be read as a checkpoint",
                "folder": "is a folder, not a checkpoint file"}[kind]
    assert expected in line and "does not exist" not in line


def test_log_folder_that_cannot_be_created(in_tmp: Path, capsys: pytest.CaptureFixture) -> None:
    (in_tmp / "a_file").write_text("x")  # no user, root included, can create a folder inside a file
    line = refused(["fit", "--config", TINY, "--trainer.logger.init_args.save_dir", str(in_tmp / "a_file" / "sub")],
                   "trainer.logger.init_args.save_dir", capsys, in_tmp)
    assert "is a file" in line


def test_root_folder_that_cannot_be_created_without_a_logger(in_tmp: Path, capsys: pytest.CaptureFixture) -> None:
    """Without a logger Lightning writes the checkpoints and the saved config under trainer.default_root_dir: a
    path through a file is refused when parsed, not with a traceback once the fit has started."""
    (in_tmp / "a_file").write_text("x")
    line = refused(["fit", "--config", TINY, "--trainer.logger", "false", "--trainer.default_root_dir",
                    str(in_tmp / "a_file" / "sub")], "trainer.default_root_dir", capsys, in_tmp)
    assert "is a file" in line


@pytest.mark.parametrize("devices", ["-1", "0,1", "[0,1]", "0"])
def test_gpu_device_selection_on_the_cpu_is_refused(devices: str, in_tmp: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    """On the CPU devices counts processes: GPU indices or -1 (every GPU) would end in Lightning's traceback."""
    line = refused(["fit", "--config", TINY, "--trainer.accelerator", "cpu", "--trainer.devices", devices],
                   "trainer.devices", capsys, in_tmp)
    assert "on the CPU (trainer.accelerator cpu)" in line and "N >= 1 (or auto)" in line.split("Fix:")[1]


def test_an_accelerator_class_path_is_read_as_its_device(in_tmp: Path, capsys: pytest.CaptureFixture) -> None:
    """trainer.accelerator given as Lightning's CPUAccelerator class is the CPU: 16-mixed is refused when parsed, as
    with accelerator: cpu (it trained in bf16 after a warning)."""
    from lmtrain.cli_config import accelerator_name

    extra = in_tmp / "cpu_accelerator.yaml"
    extra.write_text("trainer:\n  accelerator:\n    class_path: lightning.pytorch.accelerators.CPUAccelerator\n")
    line = refused(["fit", "--config", TINY, "--config", str(extra), "--trainer.precision", "16-mixed"],
                   "trainer.precision", capsys, in_tmp)
    assert "16-mixed needs a CUDA GPU" in line
    assert accelerator_name({"class_path": "lightning.pytorch.accelerators.CUDAAccelerator"}) == "cuda"
    assert accelerator_name("GPU") == "gpu" and accelerator_name(None) == "auto"
    assert accelerator_name({"class_path": "no_such.Accelerator"}) == "no_such.Accelerator"


@pytest.mark.parametrize("command", ["fit", "validate"])
def test_log_folder_that_cannot_be_written(command: str, in_tmp: Path, capsys: pytest.CaptureFixture) -> None:
    # A chmod'ed folder is writable for root; nobody, root included, creates a folder under /proc/1.
    if not Path("/proc/1").is_dir():
        pytest.skip("no /proc on this system")
    line = refused([command, "--config", TINY, "--trainer.logger.init_args.save_dir", "/proc/1/lmtrain-logs"],
                   "trainer.logger.init_args.save_dir", capsys, in_tmp)
    assert "/proc/1/lmtrain-logs cannot be written" in line
    assert not Path("/proc/1/lmtrain-logs").exists()


@pytest.mark.parametrize("out", ["a_file/out", "/proc/1/lmtrain-analysis"])
def test_analyze_out_that_cannot_be_created(out: str, in_tmp: Path, capsys: pytest.CaptureFixture) -> None:
    if out.startswith("/proc") and not Path("/proc/1").is_dir():
        pytest.skip("no /proc on this system")
    (in_tmp / "a_file").write_text("x")
    (in_tmp / "trace.json").write_text("{}")
    refused(["analyze", "kernels", str(in_tmp / "trace.json"), "--out", out], "--out", capsys, in_tmp)


def test_checkpoint_at_or_beyond_max_steps_is_refused(in_tmp: Path, capsys: pytest.CaptureFixture) -> None:
    import torch

    inputs = in_tmp / "inputs"
    inputs.mkdir()
    ckpt = inputs / "step90.ckpt"
    torch.save({"hyper_parameters": {"size": "tiny", "vocab_size": 256, "context_length": 128}, "global_step": 90},
               ckpt)
    line = refused(["fit", "--config", TINY, "--ckpt_path", str(ckpt), "--trainer.max_steps", "1"],
                   "trainer.max_steps", capsys, in_tmp)
    assert "at step 90" in line and "above 90" in line.split("Fix:")[1]


@pytest.mark.parametrize("precision", ["64-true", "64"])
def test_precision_outside_the_five_is_refused(precision: str, in_tmp: Path, capsys: pytest.CaptureFixture) -> None:
    line = refused(["fit", "--config", TINY, "--trainer.precision", precision], "trainer.precision", capsys, in_tmp)
    assert line.endswith("Fix: use one of 32-true, bf16-mixed, 16-mixed, bf16-true, 16-true.")


@pytest.mark.parametrize(("gib", "problem"), [("0", "must be > 0, got 0."), ("-5", "must be > 0, got -5."),
                                              ("0.5", "0.5 GiB leaves nothing to plan for")])
def test_estimate_gpu_memory_must_leave_something(gib: str, problem: str, in_tmp: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    line = refused(["estimate", "--config", TINY, "--gpu-memory-gib", gib], "--gpu-memory-gib", capsys, in_tmp)
    assert problem in line


COMM_ROWS = {"missing bytes": [{"op": "all_gather", "busbw_gbps": 300.0}],
             "not a number": [{"op": "all_gather", "bytes": "x", "busbw_gbps": 300.0}],
             "not an object": [1],
             "zero bandwidth": [{"op": "all_gather", "bytes": 1024, "busbw_gbps": 0.0}]}


@pytest.mark.parametrize(("args", "field", "problem"), [
    (["--mfu", "0"], "--mfu", "must be a finite number above 0, got 0"),
    (["--memory-gbps", "-1"], "--memory-gbps", "must be a finite number above 0, got -1"),
    (["--intra-node-gbps", "inf"], "--intra-node-gbps", "must be a finite number above 0, got inf"),
    (["--data.batch_size", "0"], "data.batch_size", "must be at least 1, got 0"),
    (["--trainer.num_nodes", "-1"], "trainer.num_nodes", "must be at least 1, got -1"),
])
def test_estimate_numbers_that_plan_nothing_are_refused(args: list[str], field: str, problem: str, in_tmp: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    line = refused(["estimate", "--config", TINY, *args], field, capsys, in_tmp)
    assert problem in line


@pytest.mark.parametrize("phases", [{"forward_ms": 0, "backward_ms": 0, "optimizer_ms": 0},
                                    {"forward_ms": -10, "backward_ms": 20, "optimizer_ms": 1}])
def test_estimate_calibration_without_a_step_is_refused(phases: dict, in_tmp: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    import json

    (in_tmp / "phases.json").write_text(json.dumps(phases))
    line = refused(["estimate", "--config", TINY, "--calibrate", str(in_tmp / "phases.json")], "--calibrate",
                   capsys, in_tmp)
    assert "must be finite, at least 0 and not all 0" in line


@pytest.mark.parametrize("case", sorted(COMM_ROWS))
def test_estimate_comm_record_with_bad_rows_is_refused(case: str, in_tmp: Path, capsys: pytest.CaptureFixture) -> None:
    import json

    (in_tmp / "comm.json").write_text(json.dumps({"meta": {"world_size": 2}, "rows": COMM_ROWS[case]}))
    line = refused(["estimate", "--config", TINY, "--comm", str(in_tmp / "comm.json")], "--comm", capsys, in_tmp)
    assert "a row of all_gather" in line


@pytest.mark.parametrize(("args", "field"), [(["attention", "--rep", "0"], "--rep"),
                                             (["attention", "--heads", "0"], "--heads"),
                                             (["attention", "--head-dims", "64", "0"], "--head-dims"),
                                             (["attention", "--seq-lens", "0"], "--seq-lens"),
                                             (["attention", "--batch-size", "-1"], "--batch-size"),
                                             (["model", "--skip-unfit", "-1"], "--skip-unfit"),
                                             (["model", "--sizes", "tiny", "--contexts", "0"], "--contexts"),
                                             (["model", "--sizes", "tiny", "--batch-size", "0"], "--batch-size")])
def test_bench_counts_that_measure_nothing_are_refused(args: list[str], field: str, in_tmp: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """They ran every cell into an error (or silently on the grid's value) and exited 0."""
    refused(["bench", *args], field, capsys, in_tmp)


def test_estimate_refuses_what_fit_refuses(in_tmp: Path, capsys: pytest.CaptureFixture) -> None:
    line = refused(["estimate", "--config", TINY, "--trainer.strategy", "ddp", "--trainer.devices", "2",
                    "--model.optimizer_in_backward", "true"], "model.optimizer_in_backward", capsys, in_tmp)
    assert "under DDP" in line


def test_estimate_plans_a_gpu_per_node_at_least_with_devices_auto() -> None:
    from lmtrain.estimate import parallel_of

    assert parallel_of({"strategy": "ddp", "devices": "auto", "num_nodes": 2})[:2] == ("ddp", 2)
    assert parallel_of({"strategy": "DDP", "devices": 2})[2]["bucket_cap_mb"] == 100  # lmtrain's DDP arguments


# -- model options against the trainer's settings: refused at parse time, before Lightning's device lines ---------

BF16 = ["--trainer.precision", "bf16-mixed"]
TWO_CPU_PROCESSES = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", *BF16]
#: Two processes of Lightning's FSDP1 (``fsdp``), a strategy that is neither DDP nor FSDP2.
TWO_RANKS_OF_FSDP1 = [*TWO_CPU_PROCESSES, "--trainer.strategy", "fsdp"]
TRAINER_SETTING_REFUSALS = [
    (["--model.cuda_graphs", "true", "--trainer.accelerator", "cpu"], "model.cuda_graphs", "this run trains on cpu"),
    (["--model.cuda_graphs", "true", "--model.activation_checkpointing", "offload"], "model.cuda_graphs",
     "activation_checkpointing: offload"),
    (["--model.master_weights", "true", "--trainer.precision", "32-true"], "model.master_weights",
     "needs trainer.precision: bf16-mixed (this run: 32-true)"),
    (["--model.master_weights", "true", *BF16, "--trainer.accumulate_grad_batches", "2"], "model.master_weights",
     "accumulate_grad_batches=2"),
    (["--model.master_weights", "true", *BF16, "--trainer.gradient_clip_val", "1.0"], "model.master_weights",
     "gradient_clip_val=1.0"),
    (["--model.master_weights", "true", *TWO_RANKS_OF_FSDP1], "model.master_weights",
     "2 ranks of another strategy"),
    (["--model.optimizer_in_backward", "true", "--trainer.accumulate_grad_batches", "2"],
     "model.optimizer_in_backward", "accumulate_grad_batches=2"),
    (["--model.optimizer_in_backward", "true", "--trainer.gradient_clip_val", "1.0"], "model.optimizer_in_backward",
     "gradient_clip_val=1.0"),
    (["--model.optimizer_in_backward", "true", *TWO_RANKS_OF_FSDP1], "model.optimizer_in_backward",
     "averaged over the 2 ranks"),
    (["--model.step_mode", "forward_backward", "--trainer.gradient_clip_val", "1.0"], "model.step_mode",
     "gradient_clip_val=1.0"),
    (["--model.step_mode", "forward", "--trainer.accumulate_grad_batches", "2"], "model.step_mode",
     "accumulate_grad_batches=2"),
    # FSDP2 with Lightning's default sizes (auto, auto): one node of 2 processes is a tensor-parallel mesh of 2.
    ([*TWO_CPU_PROCESSES, "--trainer.strategy", '{"class_path": "lightning.pytorch.strategies.ModelParallelStrategy"}'],
     "trainer.strategy.init_args.tensor_parallel_size", "tensor_parallel size 2"),
    ([*TWO_CPU_PROCESSES, "--trainer.strategy", "lightning.pytorch.strategies.ModelParallelStrategy",
      "--trainer.strategy.data_parallel_size", "1", "--trainer.strategy.tensor_parallel_size", "2"],
     "trainer.strategy.init_args.tensor_parallel_size", "tensor_parallel size 2"),
]


@pytest.mark.parametrize(("args", "field", "problem"), TRAINER_SETTING_REFUSALS)
def test_trainer_settings_the_options_cannot_work_with_are_refused_when_parsed(
        args: list[str], field: str, problem: str, in_tmp: Path, capsys: pytest.CaptureFixture) -> None:
    """The refusal is the whole of stderr: checked from the parsed trainer section, before Lightning builds the
    trainer and prints which devices it found."""
    line = refused(["fit", "--config", TINY, *args], field, capsys, in_tmp)
    assert problem in line


#: FSDP2 as the class alone (Lightning's default sizes, auto and auto), and with given sizes.
MODEL_PARALLEL = ["--trainer.strategy", "lightning.pytorch.strategies.ModelParallelStrategy"]


def _sizes(data: str, tensor: str) -> list[str]:
    return [*MODEL_PARALLEL, "--trainer.strategy.data_parallel_size", data,
            "--trainer.strategy.tensor_parallel_size", tensor]


MESH_REFUSALS = [
    # The class named alone is the class with its default sizes: one node of 2 processes is a tensor-parallel mesh.
    ([*TWO_CPU_PROCESSES, *MODEL_PARALLEL], "trainer.strategy.init_args.tensor_parallel_size",
     "the device mesh has tensor_parallel size 2"),
    ([*TWO_CPU_PROCESSES, "--trainer.strategy", "ModelParallelStrategy"],
     "trainer.strategy.init_args.tensor_parallel_size", "the device mesh has tensor_parallel size 2"),
    ([*TWO_CPU_PROCESSES, "--trainer.strategy", "lightning.pytorch.strategies.NoSuchStrategy"], "trainer.strategy",
     "'lightning.pytorch.strategies.NoSuchStrategy' is neither a strategy name of Lightning's nor the import path"),
    # data_parallel_size x tensor_parallel_size against the processes (nodes x devices).
    ([*TWO_CPU_PROCESSES, *_sizes("4", "1")], "trainer.strategy.init_args.data_parallel_size",
     "data_parallel_size 4 x tensor_parallel_size 1 makes a device mesh of size 4, but the run's process count is 2 "
     "(nodes x devices: 1 x 2). Fix: set trainer.strategy.init_args.data_parallel_size: 2 (nodes x devices) and "
     "tensor_parallel_size: 1, or give the run 4 processes (trainer.num_nodes x trainer.devices)."),
    ([*TWO_CPU_PROCESSES, *_sizes("1", "1")], "trainer.strategy.init_args.data_parallel_size",
     "a device mesh of size 1, but the run's process count is 2"),
    ([*TWO_CPU_PROCESSES, *_sizes("auto", "1")], "trainer.strategy.init_args.data_parallel_size",
     "data_parallel_size auto (1: the nodes) x tensor_parallel_size 1 makes a device mesh of size 1"),
    ([*TWO_CPU_PROCESSES, *_sizes("2", "auto")], "trainer.strategy.init_args.tensor_parallel_size",
     "tensor_parallel_size auto (2: the devices of a node) makes a device mesh of size 4"),
    (["--trainer.accelerator", "cpu", "--trainer.devices", "1", *_sizes("2", "1")],
     "trainer.strategy.init_args.data_parallel_size", "a device mesh of size 2, but the run's process count is 1"),
]


@pytest.mark.parametrize(("args", "field", "problem"), MESH_REFUSALS, ids=[
    "class-alone", "class-name-alone", "no-such-class", "data-larger", "data-smaller", "data-auto", "tensor-auto",
    "one-device"])
def test_strategy_and_mesh_that_cannot_run_are_refused_when_parsed(args: list[str], field: str, problem: str,
                                                                   in_tmp: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """Refused before any process starts: Lightning would refuse a class path given as a string with a traceback,
    and a mesh whose size is not the number of processes once every process has started."""
    line = refused(["fit", "--config", TINY, *args], field, capsys, in_tmp)
    assert problem in line


def test_strategy_class_named_alone_is_built_with_its_defaults() -> None:
    """The command line's parse (resolve_config parses as fit does) turns the class named alone into its class_path
    entry, with Lightning's default sizes."""
    from lmtrain.cli_config import resolve_config

    strategy = resolve_config(TINY, MODEL_PARALLEL).trainer["strategy"]
    assert strategy["class_path"] == "lightning.pytorch.strategies.ModelParallelStrategy"
    assert strategy["init_args"]["data_parallel_size"] == strategy["init_args"]["tensor_parallel_size"] == "auto"
    assert resolve_config(TINY, ["--trainer.strategy", "ddp"]).trainer["strategy"] == "ddp"


def test_validate_takes_training_step_options_under_ddp() -> None:
    """validate and test take no training step: a checkpoint's optimizer_in_backward or cuda_graphs passes under
    DDP on 2 ranks (fit refuses them there)."""
    from lmtrain.config import ModelConfig, TrainerSettings
    from lmtrain.errors import LmtrainError
    from lmtrain.module import LMModule

    settings = TrainerSettings(precision="32-true", strategy="ddp", world_size=2, device="cpu",
                               accumulate_grad_batches=1, gradient_clip_val=None)
    cfg = ModelConfig.from_size("tiny", vocab_size=64, context_length=16, optimizer_in_backward=True)
    LMModule.check_settings(cfg, settings, training=False)
    with pytest.raises(LmtrainError, match="model.optimizer_in_backward"):
        LMModule.check_settings(cfg, settings, training=True)


def test_cuda_graphs_on_a_machine_without_a_gpu_is_refused_when_parsed(in_tmp: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """``trainer.accelerator: auto`` (the configs' default) trains on the CPU where no GPU is visible."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: accelerator auto trains on it")
    line = refused(["fit", "--config", TINY, "--model.cuda_graphs", "true"], "model.cuda_graphs", capsys, in_tmp)
    assert "this run trains on cpu" in line


GPU_TRAINER_SETTING_REFUSALS = [
    (["--model.cuda_graphs", "true", "--trainer.accumulate_grad_batches", "2"], "model.cuda_graphs",
     "accumulate_grad_batches=2"),
    (["--model.cuda_graphs", "true", "--trainer.gradient_clip_val", "1.0"], "model.cuda_graphs",
     "gradient_clip_val=1.0"),
    (["--model.cuda_graphs", "true", "--trainer.precision", "16-mixed"], "model.cuda_graphs", "16-mixed"),
    (["--model.optimizer_in_backward", "true", "--trainer.precision", "16-mixed"], "model.optimizer_in_backward",
     "16-mixed"),
    (["--trainer.precision", "16-true", "--trainer.strategy", "lightning.pytorch.strategies.ModelParallelStrategy",
      "--trainer.strategy.data_parallel_size", "1", "--trainer.strategy.tensor_parallel_size", "1"],
     "trainer.precision", "FSDP2"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("args", "field", "problem"), GPU_TRAINER_SETTING_REFUSALS)
def test_gpu_trainer_settings_the_options_cannot_work_with_are_refused_when_parsed(
        args: list[str], field: str, problem: str, in_tmp: Path, capsys: pytest.CaptureFixture) -> None:
    """As above, for the settings a CPU run refuses for another reason first (no CUDA device, 16-bit floats)."""
    line = refused(["fit", "--config", TINY, "--trainer.accelerator", "gpu", "--trainer.devices", "1", *args], field,
                   capsys, in_tmp)
    assert problem in line


@pytest.mark.parametrize(("saved", "args", "field"), [
    ({"global_batch_size": 32}, [], "data.batch_size"),  # tiny.yaml: 16 windows a batch, one process
    ({"global_batch_size": 16}, ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"],
     "data.batch_size"),
    ({"seed": 5}, [], "data.seed"),
], ids=["batch", "batch-on-2-processes", "seed"])
def test_resuming_a_data_order_that_cannot_continue_is_refused_when_parsed(
        saved: dict, args: list[str], field: str, in_tmp: Path, capsys: pytest.CaptureFixture) -> None:
    """The checkpoint's data order against the parsed data options and process count, before the trainer exists:
    when the fit restores the data module, Lightning has printed its device lines and the logger has written."""
    import lightning
    import torch

    from lmtrain.module import LMModule

    inputs = in_tmp / "inputs"
    inputs.mkdir()
    ckpt = inputs / "step3.ckpt"
    model = {"size": "tiny", "vocab_size": 256, "context_length": 128}
    order = {"seed": 0, "source": "text", "global_batch_size": 16, "train_batches": 300, **saved}
    # As much of a checkpoint as Lightning restores before the data module's state (the weights included).
    torch.save({"pytorch-lightning_version": lightning.__version__, "hyper_parameters": model, "global_step": 3,
                "state_dict": LMModule(**model).state_dict(),
                "LMDataModule": {"next_batch": 3, "batch_in_epoch": 3, **order}}, ckpt)
    line = refused(["fit", "--config", TINY, "--ckpt_path", str(ckpt), *args], field, capsys, in_tmp)
    assert "data order cannot continue" in line
