"""The speed options under DDP and FSDP2 on CPU, 2 processes over gloo: each combination trains or is refused.

The matrix is strategy {ddp, fsdp} x compile {off, on} x optimizer {AdamW, master weights, compact state} x
activation checkpointing {none, full} x attention {flash_pytorch, naive}, plus FSDP2's own options (reshard
policy, prefetching, fullgraph). Every combination of the matrix trains a few steps with finite, falling losses
that are equal on both ranks (every rank reads the same batches, so replicas that stay in step compute the same
loss); the options that cannot work with a strategy (CUDA graphs, the in-backward optimizer under DDP, per-layer
checkpointing under FSDP2) are refused when the command line is parsed, with one line naming both options
(``lmtrain.distributed.check_strategy_options``).

The two processes are started here with the variables a launcher sets (``RANK``, ``WORLD_SIZE``, ...), and each
runs every combination of its list in turn, one ``Trainer`` per combination over the one process group (this file
is the script: ``python tests/test_distributed_matrix.py OUT_PREFIX eager|compiled``).
"""

from __future__ import annotations

import itertools
import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from subprocs import own_job_env

STEPS = 3
BATCH = 2
CONTEXT = 16
VOCAB = 128
STRATEGIES = ("ddp", "fsdp")
OPTIMIZERS = ("adamw", "master", "compact")
ATTENTION = ("flash_pytorch", "naive")

#: Model options of each optimizer choice.
OPTIMIZER_OPTIONS = {"adamw": {}, "master": {"master_weights": True},
                     "compact": {"master_weights": True, "optimizer_state_dtype": "bfloat16"}}


def combo_name(strategy: str, compile: bool, optimizer: str, ac: bool, attention: str, **extra: object) -> str:
    tail = "".join(f"_{k}-{v}" for k, v in sorted(extra.items()))
    return f"{strategy}_{'compiled' if compile else 'eager'}_{optimizer}_{'ac' if ac else 'noac'}_{attention}{tail}"


def eager_combos() -> list[dict]:
    """Every eager combination, and FSDP2's own options and the in-backward optimizer on one of them."""
    combos = [dict(strategy=s, compile=False, optimizer=o, ac=a, attention=n)
              for s, o, a, n in itertools.product(STRATEGIES, OPTIMIZERS, (False, True), ATTENTION)]
    base = dict(strategy="fsdp", compile=False, optimizer="compact", ac=False, attention="naive")
    combos += [{**base, "fsdp_reshard_after_forward": "all"}, {**base, "fsdp_reshard_after_forward": "none"},
               {**base, "fsdp_prefetch": False},
               {**base, "optimizer": "adamw", "optimizer_in_backward": True}]  # updates after each reduce-scatter
    return combos


def compiled_combos() -> list[dict]:
    """Compiled combinations that together take each value of every axis under both strategies (compiling on a
    CPU takes tens of seconds per model)."""
    return [dict(strategy="ddp", compile=True, optimizer="compact", ac=False, attention="naive"),
            dict(strategy="ddp", compile=True, optimizer="master", ac=True, attention="flash_pytorch"),
            dict(strategy="fsdp", compile=True, optimizer="compact", ac=True, attention="naive"),
            dict(strategy="fsdp", compile=True, optimizer="master", ac=False, attention="flash_pytorch",
                 compile_fullgraph=True),
            dict(strategy="fsdp", compile=True, optimizer="adamw", ac=False, attention="naive",
                 fsdp_reshard_after_forward="none")]


# -- the script (one rank) ----------------------------------------------------------------------------------


def _windows() -> torch.Tensor:
    """The batches every rank trains on: counting sequences from random starts (learnable in a few steps)."""
    g = torch.Generator().manual_seed(7)
    starts = torch.randint(0, VOCAB, (STEPS * BATCH, 1), generator=g)
    return (starts + torch.arange(CONTEXT + 1)) % VOCAB


def fit_one(combo: dict) -> list[float]:
    """Train one combination for STEPS steps on this rank; its local losses."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lmtrain.distributed import ddp_strategy
    from lmtrain.module import LMModule

    class SeededLM(LMModule):
        def configure_model(self) -> None:
            torch.manual_seed(0)  # the same initial weights on both ranks, whatever ran before
            super().configure_model()

    class Same(pl.LightningDataModule):
        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(_windows(), batch_size=BATCH, shuffle=False)

    class Losses(pl.Callback):
        def __init__(self) -> None:
            self.values: list[float] = []
            self.ddp_arguments: tuple | None = None

        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            wrapper = trainer.strategy.model  # DistributedDataParallel under DDP (unwrapped again after the fit)
            if isinstance(wrapper, torch.nn.parallel.DistributedDataParallel):
                self.ddp_arguments = (wrapper.gradient_as_bucket_view, wrapper.static_graph, wrapper.bucket_bytes_cap)

        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs, batch, idx) -> None:
            self.values.append(float(outputs["loss"]))

    extra = {k: v for k, v in combo.items() if k not in ("strategy", "compile", "optimizer", "ac", "attention")}
    module = SeededLM(size="tiny", vocab_size=VOCAB, context_length=CONTEXT, lr=1e-2, warmup_steps=0,
                      fused_adamw=False, compile=combo["compile"], attention=combo["attention"],
                      activation_checkpointing=combo["ac"], **OPTIMIZER_OPTIONS[combo["optimizer"]], **extra)
    strategy = (ddp_strategy() if combo["strategy"] == "ddp"
                else ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))
    losses = Losses()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed", max_steps=STEPS,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, use_distributed_sampler=False,
                         callbacks=[losses])
    trainer.fit(module, datamodule=Same())
    if combo["strategy"] == "ddp":  # lmtrain's defaults reached the DistributedDataParallel wrapper
        assert losses.ddp_arguments == (True, True, 100 * 1024 * 1024), losses.ddp_arguments
    return losses.values


def run_rank(prefix: str, which: str) -> None:
    """Run every combination of ``which`` (eager or compiled) on this rank; write ``{name: losses}`` to
    ``PREFIX.RANK.json`` (an error is recorded as its one-line text instead)."""
    import os

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    results: dict[str, object] = {}
    for combo in eager_combos() if which == "eager" else compiled_combos():
        torch._dynamo.reset()  # each combination compiles its own model
        try:
            results[combo_name(**combo)] = fit_one(combo)
        except Exception as exc:  # recorded, so that the test names the combination that failed
            results[combo_name(**combo)] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            break  # the other rank may be waiting in a collective: stop here
    Path(f"{prefix}.{rank}.json").write_text(json.dumps(results))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# -- the tests ----------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_matrix(which: str, tmp_path: Path, timeout: int) -> dict[str, list[float]]:
    prefix = str(tmp_path / which)
    env = {**own_job_env(), "CUDA_VISIBLE_DEVICES": "", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": "2", "NODE_RANK": "0", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, prefix, which], cwd=tmp_path,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs[0][-3000:] + outputs[1][-3000:]
    ranks = [json.loads(Path(f"{prefix}.{r}.json").read_text()) for r in range(2)]
    expected = [combo_name(**c) for c in (eager_combos() if which == "eager" else compiled_combos())]
    for name in expected:
        for r in range(2):
            assert isinstance(ranks[r].get(name), list), f"{name} on rank {r}: {ranks[r].get(name, 'not run')}"
    return {name: ranks[0][name] for name in expected} | {f"{name}@1": ranks[1][name] for name in expected}


def _assert_trained(results: dict[str, list[float]], names: list[str]) -> None:
    for name in names:
        zero, one = results[name], results[f"{name}@1"]
        assert len(zero) == STEPS and all(math.isfinite(x) for x in zero), (name, zero)
        # Same batches, replicas in step: the same loss on both ranks (bf16 compute: within its rounding).
        assert zero == pytest.approx(one, rel=1e-3, abs=1e-3), (name, zero, one)


@pytest.mark.slow
def test_every_eager_combination_trains_with_equal_losses_on_both_ranks(tmp_path: Path) -> None:
    results = _run_matrix("eager", tmp_path, timeout=900)
    names = [combo_name(**c) for c in eager_combos()]
    _assert_trained(results, names)
    # The losses fall: the steps did update the weights on every path.
    for name in names:
        assert results[name][-1] < results[name][0], (name, results[name])


@pytest.mark.slow
def test_compiled_combinations_train_with_equal_losses_on_both_ranks(tmp_path: Path) -> None:
    results = _run_matrix("compiled", tmp_path, timeout=1800)
    _assert_trained(results, [combo_name(**c) for c in compiled_combos()])


REFUSED = [
    (["--model.cuda_graphs", "true"], "ddp", "model.cuda_graphs", "DDP"),
    (["--model.cuda_graphs", "true"], "fsdp", "model.cuda_graphs", "FSDP2"),
    (["--model.optimizer_in_backward", "true"], "ddp", "model.optimizer_in_backward", "DDP"),
    (["--model.activation_checkpointing", "selective"], "fsdp", "model.activation_checkpointing", "FSDP2"),
    (["--model.activation_checkpointing", "full", "--model.checkpoint_layers", "2"], "fsdp",
     "model.checkpoint_layers", "FSDP2"),
    (["--model.compile_fullgraph", "true"], "ddp", "model.compile_fullgraph", "model.compile"),
]

_STRATEGY_ARGS = {
    "ddp": ["--trainer.strategy", "ddp"],
    "fsdp": ["--trainer.strategy", "lightning.pytorch.strategies.ModelParallelStrategy",
             "--trainer.strategy.data_parallel_size", "2", "--trainer.strategy.tensor_parallel_size", "1"],
}


@pytest.mark.parametrize(("options", "strategy", "field", "other"), REFUSED)
def test_combinations_that_cannot_work_are_refused_when_parsed(options: list[str], strategy: str, field: str,
                                                                other: str, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture) -> None:
    """One line naming the option and the strategy (or the other option), exit 2, nothing written."""
    from lmtrain.cli import main

    monkeypatch.chdir(tmp_path)
    config = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    args = ["fit", "--config", config, "--trainer.accelerator", "cpu", "--trainer.devices", "2",
            "--trainer.precision", "bf16-mixed", *_STRATEGY_ARGS[strategy], *options]
    assert main(args) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"error: {field}: ") and other in errors[0] and " Fix: " in errors[0], errors[0]
    assert list(tmp_path.rglob("*")) == []


def test_ddp_arguments_are_lmtrain_defaults_without_a_static_graph_under_accumulation() -> None:
    from lightning.pytorch.strategies import DDPStrategy

    from lmtrain.distributed import DDP_DEFAULTS, ddp_arguments, ddp_strategy

    assert ddp_arguments() == DDP_DEFAULTS == {"gradient_as_bucket_view": True, "bucket_cap_mb": 100,
                                               "static_graph": True}
    assert ddp_arguments(4) == {**DDP_DEFAULTS, "static_graph": False}  # accumulation runs under no_sync
    assert ddp_arguments(1, bucket_cap_mb=25)["bucket_cap_mb"] == 25
    assert isinstance(ddp_strategy(2), DDPStrategy)


def test_reshard_policies_per_block() -> None:
    from lmtrain.distributed import reshard_after_forward_of
    from lmtrain.errors import LmtrainError

    assert [reshard_after_forward_of("blocks", i, 4) for i in range(4)] == [True, True, True, False]
    assert [reshard_after_forward_of("all", i, 4) for i in range(4)] == [True] * 4
    assert [reshard_after_forward_of("none", i, 4) for i in range(4)] == [False] * 4
    with pytest.raises(LmtrainError, match="model.fsdp_reshard_after_forward"):
        reshard_after_forward_of("some", 0, 4)


class _Unit:
    """Records what ``set_prefetch`` asks of an FSDP unit."""

    def __init__(self, name: str) -> None:
        self.name, self.forward, self.backward = name, None, None

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        self.forward = [m.name for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        self.backward = [m.name for m in modules]


@pytest.mark.parametrize("backward", [True, False])
def test_prefetch_is_the_next_block_forward_and_the_previous_backward(backward: bool) -> None:
    from lmtrain.distributed import set_prefetch

    root, blocks = _Unit("root"), [_Unit(f"b{i}") for i in range(3)]
    set_prefetch(root, blocks, backward=backward)
    assert root.forward == ["b0"] and root.backward is None
    assert [b.forward for b in blocks] == [["b1"], ["b2"], None]
    assert [b.backward for b in blocks] == ([None, ["b0"], ["b1"]] if backward else [None] * 3)


if __name__ == "__main__":
    run_rank(sys.argv[1], sys.argv[2])
