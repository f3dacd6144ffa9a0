"""The speed options under DDP and FSDP2 on CPU, 2 processes over gloo: each combination trains or is refused.

The matrix is strategy {ddp, fsdp} x compile {off, on} x optimizer {AdamW, master weights, compact state} x
activation checkpointing {none, full} x attention {flash_pytorch, naive}, plus FSDP2's own options (reshard
policy, prefetching, fullgraph). Each rank reads its own windows (rank r of W the r-th of every W, so that at each
step the ranks' batches together are one global batch of W x BATCH windows), so only gradients that are reduced
over the ranks keep the replicas equal. Every combination of the matrix trains a few steps with finite losses
(each step on new windows, too few steps for the loss to fall reliably); after the fit the parameters have moved
from the initial ones and (gathered whole under FSDP2) are the same on both ranks; and for the combinations whose
model options have a one-process reference (:data:`REFERENCES`, a fit of the same options on the global batches)
the parameters' change is that reference's, within bf16's rounding. The options that cannot work with a strategy
(CUDA graphs, the in-backward optimizer under DDP, per-layer checkpointing under FSDP2) are refused when the
command line is parsed, with one line naming both options (``lmtrain.distributed.check_strategy_options``).

The two processes are started here with the variables a launcher sets (``RANK``, ``WORLD_SIZE``, ...), and each
runs every combination of its list in turn, one ``Trainer`` per combination over the one process group (this file
is the script: ``python tests/test_distributed_matrix.py OUT_PREFIX eager|compiled``; after the eager list, rank 0
fits the references on its own).
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
from refusals import refused
from subprocs import own_job_env

STEPS = 3
BATCH = 2  # windows per rank and step
WORLD = 2
CONTEXT = 16
VOCAB = 128
STRATEGIES = ("ddp", "fsdp")
OPTIMIZERS = ("adamw", "master", "compact")
ATTENTION = ("flash_pytorch", "naive")
#: The model options that a one-process fit on the global batches is run for; every eager combination with these
#: options (under either strategy, whatever its strategy options) is compared with it.
REFERENCES = (dict(optimizer="adamw", ac=False, attention="naive"),
              dict(optimizer="compact", ac=False, attention="naive"),
              dict(optimizer="master", ac=True, attention="flash_pytorch"))
#: Largest ||change of the 2-rank fit - change of the reference|| / ||change of the reference|| over the
#: parameters. In sync the distance is bf16's rounding made larger by AdamW's first steps (an update is about lr x
#: the sign of the gradient, so rounding that flips a near-zero gradient's sign flips a whole update): measured 0.04
#: under DDP and 0.12 to 0.15 under FSDP2 (its bf16 policy computes more in bf16 than the reference's autocast).
#: Ranks that step on their own gradients land 0.97 to 1.0 away (measured with DDP's all-reduce and FSDP2's
#: reduce-scatter replaced by local copies).
REFERENCE_TOLERANCE = 0.3

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


def reference_combos() -> list[dict]:
    """The one-process fits of :data:`REFERENCES`."""
    return [dict(strategy="single", compile=False, **options) for options in REFERENCES]


def reference_of(combo: dict) -> str | None:
    """The name of the reference an eager combination is compared with (None: it has none)."""
    options = {k: combo[k] for k in ("optimizer", "ac", "attention")}
    if combo["compile"] or options not in REFERENCES:
        return None
    return combo_name(strategy="single", compile=False, **options)


# -- the script (one rank, or the references in one process) -------------------------------------------------


def _windows() -> torch.Tensor:
    """All the windows of a fit, in the order of the global batches: counting sequences from distinct random starts
    (learnable in a few steps; no two windows alike, so that no two ranks read the same one)."""
    g = torch.Generator().manual_seed(7)
    starts = torch.randperm(VOCAB, generator=g)[:STEPS * WORLD * BATCH, None]
    return (starts + torch.arange(CONTEXT + 1)) % VOCAB


def _rank_windows(rank: int, world: int) -> torch.Tensor:
    """The windows rank ``rank`` of ``world`` reads, in order, ``WORLD * BATCH // world`` a step: every
    ``world``-th from ``rank``, so that at each step the ranks' batches together are one global batch."""
    return _windows()[rank::world]


def _parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters, whole (an FSDP2 shard is gathered: a collective, every rank calls it), in fp64."""
    from torch.distributed.tensor import DTensor

    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().double() for p in model.parameters()]


def fit_one(combo: dict, delta_path: Path | None = None) -> dict:
    """Train one combination for STEPS steps on this rank (strategy ``single``: one process on the global
    batches). Returns its local losses, how far the parameters moved (||final - initial|| / ||initial||) and each
    final parameter's sum and sum of squares; writes the parameters' change to ``delta_path`` if given."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lmtrain.distributed import ddp_strategy
    from lmtrain.module import LMModule

    single = combo["strategy"] == "single"

    class SeededLM(LMModule):
        def configure_model(self) -> None:
            torch.manual_seed(0)  # the same initial weights on both ranks, whatever ran before
            super().configure_model()

    class OwnWindows(pl.LightningDataModule):
        def train_dataloader(self) -> torch.utils.data.DataLoader:
            rank, world = self.trainer.global_rank, self.trainer.world_size
            return torch.utils.data.DataLoader(_rank_windows(rank, world), batch_size=WORLD * BATCH // world,
                                               shuffle=False)

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.values: list[float] = []
            self.initial: list[torch.Tensor] = []
            self.ddp_arguments: tuple | None = None

        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            self.initial = _parameters(module.model)
            wrapper = trainer.strategy.model  # DistributedDataParallel under DDP (unwrapped again after the fit)
            if isinstance(wrapper, torch.nn.parallel.DistributedDataParallel):
                self.ddp_arguments = (wrapper.gradient_as_bucket_view, wrapper.static_graph, wrapper.bucket_bytes_cap)

        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs, batch, idx) -> None:
            self.values.append(float(outputs["loss"]))

    extra = {k: v for k, v in combo.items() if k not in ("strategy", "compile", "optimizer", "ac", "attention")}
    module = SeededLM(size="tiny", vocab_size=VOCAB, context_length=CONTEXT, lr=1e-2, warmup_steps=0,
                      fused_adamw=False, compile=combo["compile"], attention=combo["attention"],
                      activation_checkpointing=combo["ac"], **OPTIMIZER_OPTIONS[combo["optimizer"]], **extra)
    strategy = {"single": "auto", "ddp": ddp_strategy(),
                "fsdp": ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)}[combo["strategy"]]
    record = Record()
    trainer = pl.Trainer(accelerator="cpu", devices=1 if single else WORLD, strategy=strategy,
                         precision="bf16-mixed", max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         use_distributed_sampler=False, callbacks=[record])
    trainer.fit(module, datamodule=OwnWindows())
    if combo["strategy"] == "ddp":  # lmtrain's defaults reached the DistributedDataParallel wrapper
        assert record.ddp_arguments == (True, True, 100 * 1024 * 1024), record.ddp_arguments
    final = _parameters(module.model)
    delta = torch.cat([(f - i).flatten() for f, i in zip(final, record.initial, strict=True)])
    if delta_path is not None:
        torch.save(delta.float(), delta_path)
    initial_norm = torch.cat([i.flatten() for i in record.initial]).norm()
    return {"losses": record.values, "moved": float(delta.norm() / initial_norm),
            "checksums": [float(x) for f in final for x in (f.sum(), f.square().sum())]}


def delta_path(prefix: str, name: str) -> Path:
    """Where a fit compared with a reference (or the reference itself) writes its parameters' change."""
    return Path(f"{prefix}.{name}.delta.pt")


def run_rank(prefix: str, which: str) -> None:
    """Run every combination of ``which`` (eager or compiled) on this rank; write ``{name: fit_one's result}`` to
    ``PREFIX.RANK.json`` (an error is recorded as its one-line text instead). For eager, rank 0 writes the
    parameters' change of each combination that has a reference, then (the process group gone) fits the
    references in this process and writes theirs and ``PREFIX.single.json``."""
    import os

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    results = _fit_all(eager_combos() if which == "eager" else compiled_combos(), prefix,
                       compared=which == "eager" and rank == 0)
    Path(f"{prefix}.{rank}.json").write_text(json.dumps(results))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if which == "eager" and rank == 0:
        for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
            os.environ.pop(name, None)  # a process of its own now, not a rank
        Path(f"{prefix}.single.json").write_text(json.dumps(_fit_all(reference_combos(), prefix, compared=True)))


def _fit_all(combos: list[dict], prefix: str, compared: bool) -> dict[str, object]:
    """``fit_one`` of each combination (``compared``: writing the change of those that have a reference, and of
    the references); stops at the first error, recorded as its one-line text (the other rank may be waiting in a
    collective)."""
    results: dict[str, object] = {}
    for combo in combos:
        torch._dynamo.reset()  # each combination compiles its own model
        name = combo_name(**combo)
        with_delta = compared and (combo["strategy"] == "single" or reference_of(combo) is not None)
        try:
            results[name] = fit_one(combo, delta_path(prefix, name) if with_delta else None)
        except Exception as exc:  # recorded, so that the test names the combination that failed
            results[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            break
    return results


# -- the tests ----------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_matrix(which: str, tmp_path: Path, timeout: int) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """Run the ``which`` combinations on 2 ranks: ``{name: [rank 0's result, rank 1's]}`` and, for eager,
    ``{reference name: its result}``."""
    prefix = str(tmp_path / which)
    env = {**own_job_env(), "CUDA_VISIBLE_DEVICES": "", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(WORLD), "NODE_RANK": "0", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, prefix, which], cwd=tmp_path,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs[0][-3000:] + outputs[1][-3000:]
    ranks = [json.loads(Path(f"{prefix}.{r}.json").read_text()) for r in range(WORLD)]
    expected = [combo_name(**c) for c in (eager_combos() if which == "eager" else compiled_combos())]
    for name in expected:
        for r in range(WORLD):
            assert isinstance(ranks[r].get(name), dict), f"{name} on rank {r}: {ranks[r].get(name, 'not run')}"
    references = {}
    if which == "eager":
        references = json.loads(Path(f"{prefix}.single.json").read_text())
        for c in reference_combos():
            assert isinstance(references.get(combo_name(**c)), dict), (combo_name(**c), references)
    return {name: [ranks[r][name] for r in range(WORLD)] for name in expected}, references


def test_the_ranks_batches_of_a_step_are_the_references_batch() -> None:
    """Rank r's windows are every W-th from r: at each step the ranks' batches together are the one-process
    reference's batch, and no two ranks share a window."""
    windows = _windows()
    assert len({tuple(w.tolist()) for w in windows}) == len(windows)  # distinct: a window read twice would show
    assert [len(_rank_windows(r, 1)) for r in range(1)] == [len(windows)]  # the reference reads them all
    for step in range(STEPS):
        ranks = [_rank_windows(r, WORLD)[step * BATCH:(step + 1) * BATCH] for r in range(WORLD)]
        together = sorted(tuple(w.tolist()) for rank in ranks for w in rank)
        assert together == sorted(tuple(w.tolist()) for w in windows[step * WORLD * BATCH:(step + 1) * WORLD * BATCH])


def _assert_trained_in_sync(results: dict[str, list[dict]], names: list[str]) -> None:
    for name in names:
        zero, one = results[name]
        for rank in (zero, one):
            assert len(rank["losses"]) == STEPS and all(math.isfinite(x) for x in rank["losses"]), (name, rank)
        # The steps updated the weights (AdamW at lr 1e-2 moves each weight by about 1e-2 a step).
        assert zero["moved"] > 1e-3 and one["moved"] > 1e-3, (name, zero["moved"], one["moved"])
        # Different batches on the two ranks: only reduced gradients keep the replicas equal (FSDP2's parameters
        # are gathered whole on each rank, so there this holds by construction; the references check FSDP2).
        assert zero["checksums"] == pytest.approx(one["checksums"], rel=1e-6, abs=1e-6), name


def _assert_like_reference(tmp_path: Path, results: dict[str, list[dict]], references: dict[str, dict]) -> None:
    compared = [c for c in eager_combos() if reference_of(c) is not None]
    assert {c["strategy"] for c in compared} == set(STRATEGIES)
    for combo in compared:
        name, reference = combo_name(**combo), reference_of(combo)
        mine = torch.load(delta_path(str(tmp_path / "eager"), name))
        theirs = torch.load(delta_path(str(tmp_path / "eager"), reference))
        distance = float((mine - theirs).norm() / theirs.norm())
        print(f"{name}: {distance:.4f} from {reference}")  # for the record (pytest -s)
        assert distance < REFERENCE_TOLERANCE, (name, reference, distance)
        # The mean of the ranks' first losses is the reference's first loss (same weights, same global batch).
        first = sum(rank["losses"][0] for rank in results[name]) / WORLD
        assert first == pytest.approx(references[reference]["losses"][0], rel=1e-2), (name, first)


@pytest.mark.slow
def test_every_eager_combination_trains_in_sync_like_one_process(tmp_path: Path) -> None:
    results, references = _run_matrix("eager", tmp_path, timeout=900)
    names = [combo_name(**c) for c in eager_combos()]
    _assert_trained_in_sync(results, names)
    _assert_like_reference(tmp_path, results, references)


@pytest.mark.slow
def test_compiled_combinations_train_in_sync(tmp_path: Path) -> None:
    results, _ = _run_matrix("compiled", tmp_path, timeout=1800)
    _assert_trained_in_sync(results, [combo_name(**c) for c in compiled_combos()])


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
    """One line naming the option and the strategy (or the other option), the whole of stderr, exit 2, nothing
    written."""
    monkeypatch.chdir(tmp_path)
    config = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    args = ["fit", "--config", config, "--trainer.accelerator", "cpu", "--trainer.devices", "2",
            "--trainer.precision", "bf16-mixed", *_STRATEGY_ARGS[strategy], *options]
    assert other in refused(args, field, capsys, tmp_path)
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


def test_ddp_is_built_on_the_current_stream_not_a_side_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning builds DistributedDataParallel under a fresh side stream; lmtrain's strategy builds it on the stream
    the steps run on (PyTorch warns that the side stream's gradient accumulators may add synchronisation)."""
    import pickle

    import torch.nn.parallel

    import lmtrain.distributed as distributed

    built: list[dict] = []
    monkeypatch.setattr(torch.cuda, "stream", lambda *a, **k: pytest.fail("DDP built under a side stream"))
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: pytest.fail("a side stream was made"))
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", lambda **kw: built.append(kw) or "ddp")
    strategy = distributed.ddp_strategy(1)
    monkeypatch.setattr(type(strategy), "determine_ddp_device_ids", lambda self: [3])  # as on GPU 3
    model = torch.nn.Linear(2, 2)
    assert strategy._setup_model(model) == "ddp"
    assert built == [{"module": model, "device_ids": [3], **distributed.DDP_DEFAULTS}]
    assert pickle.loads(pickle.dumps(type(strategy))) is distributed.SameStreamDDPStrategy
    # a fresh process (a spawned rank) finds the class by name before anything has made it
    import subprocess
    import sys
    found = subprocess.run([sys.executable, "-c", "import pickle, sys; print(pickle.loads(sys.stdin.buffer.read()))"],
                           input=pickle.dumps(type(strategy)), capture_output=True, check=True).stdout
    assert found.decode().strip() == "<class 'lmtrain.distributed.SameStreamDDPStrategy'>"
