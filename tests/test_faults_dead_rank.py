"""A rank killed mid-run (SIGKILL) stops the other one with one line naming it (``lmtrain.faults.RankWatchdog``).

The two ranks of ``python -m lmtrain fit`` (DDP over gloo, CPU) are started here as a cluster launcher starts them
(``torchrun``, SLURM: one process per rank, ``LOCAL_RANK`` set), so each has its own exit status and no launcher
stops the survivor on the watchdog's behalf. The heartbeat logic itself is tested on an in-process store with a
clock the test moves.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from subprocs import ROOT, own_job_env

from lmtrain.faults import PEER_LOST_STATUS, PeerMonitor

CPU_CONFIG = """
seed_everything: 0
model: {size: tiny, vocab_size: 256, context_length: 32, warmup_steps: 0, fused_adamw: false}
data: {source: synthetic, batch_size: 2, train_batches: 1000, val_batches: 1}
trainer:
  accelerator: cpu
  devices: 2
  strategy: ddp
  max_steps: 1000
  limit_val_batches: 0
  num_sanity_val_steps: 0
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: lmtrain.faults.RankWatchdog
      init_args: {timeout_s: 5.0, interval_s: 0.5}
    - class_path: test_faults_dead_rank.KillAtStep
      init_args: {rank: KILLED, step: 3}
"""
#: The GPU run: the shipped FSDP2 config cut to 2 blocks, with the watchdog that every fit runs (30 s).
GPU_OVERLAY = """
trainer:
  max_steps: 1000
  enable_progress_bar: false
  callbacks:
    - class_path: test_faults_dead_rank.KillAtStep
      init_args: {rank: KILLED, step: 5}
"""


class KillAtStep(pl.Callback):
    """SIGKILLs rank ``rank``'s own process at the end of optimizer step ``step``: a rank lost without a word."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_one_rank(tmp_path: Path, config_args: list[str], killed: int, env: dict[str, str]) -> None:
    """Start both ranks, let rank ``killed`` SIGKILL itself, check that the other stops naming it."""
    base = {**own_job_env(ROOT / "tests"), **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
            "WORLD_SIZE": "2", "NODE_RANK": "0"}
    args = [sys.executable, "-m", "lmtrain", "fit", *config_args]
    ranks = [subprocess.Popen(args, cwd=tmp_path, env={**base, "LOCAL_RANK": str(r), "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        # The guard against the collective's own timeout (30 min): the survivor stops long before it.
        outputs = [p.communicate(timeout=600) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    survivor = 1 - killed
    assert ranks[killed].returncode == -signal.SIGKILL, outputs[killed][1][-3000:]
    assert ranks[survivor].returncode == PEER_LOST_STATUS, outputs[survivor][1][-3000:]
    lines = [line for line in outputs[survivor][1].splitlines() if line.startswith("error:")]
    print(lines)
    assert len(lines) == 1 and lines[0].startswith(f"error: rank {killed} stopped"), lines
    assert f"Stopping rank {survivor}" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("killed", [0, 1])
def test_a_killed_rank_stops_the_other_naming_it(killed: int, tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text(CPU_CONFIG.replace("KILLED", str(killed)))
    _kill_one_rank(tmp_path, ["--config", "run.yaml"], killed, {"CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.gpu
@pytest.mark.parametrize("killed", [0, 1])
def test_a_killed_rank_stops_the_other_on_2_gpus(killed: int, tmp_path: Path) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    (tmp_path / "overlay.yaml").write_text(GPU_OVERLAY.replace("KILLED", str(killed)))
    _kill_one_rank(tmp_path, ["--config", str(ROOT / "configs" / "2.7B_bf16_fsdp.yaml"), "--config", "overlay.yaml",
                              "--model.num_layers", "2"], killed, {})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _monitors(world: int = 3) -> tuple[list[PeerMonitor], Clock]:
    store, clock = dist.HashStore(), Clock()
    return [PeerMonitor(store, r, world, timeout_s=10.0, interval_s=1.0, clock=clock) for r in range(world)], clock


def test_a_rank_whose_heartbeat_stops_is_named_after_the_timeout() -> None:
    (zero, one, two), clock = _monitors()
    for m in (zero, one, two):
        m.beat()
    assert zero.check() is None
    for _ in range(3):  # ranks 0 and 1 go on beating, rank 2 does not
        clock.now += 4.0
        zero.beat()
        one.beat()
        verdict = zero.check()
    assert clock.now == 12.0 and verdict is not None
    assert verdict.startswith("rank 2 stopped: no heartbeat for 12 s"), verdict
    assert one.check() is None  # rank 1 looks for the first time: it counts from now
    clock.now += 11.0
    zero.beat()
    assert one.check().startswith("rank 2 stopped: no heartbeat for 11 s")


def test_finished_and_failed_ranks() -> None:
    (zero, one, two), clock = _monitors()
    zero.check()
    two.mark("done")  # a rank that finished is not dead, however long it is silent
    clock.now += 100.0
    one.beat()
    assert zero.check() is None
    one.mark("failed")
    assert zero.check() == "rank 1 stopped: it failed with an error (see its own output)."
    one.mark("interrupted")
    assert zero.check() == "rank 1 stopped: it was interrupted (Ctrl+C)."


class GoneStore:
    """A store whose server has gone: every call raises as a TCPStore client's does."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any) -> Any:
            raise RuntimeError("Connection reset by peer\nmore")
        return fail


def test_a_store_that_stops_answering_means_rank_0_is_gone() -> None:
    verdict = PeerMonitor(GoneStore(), 1, 2).check()
    assert verdict == "rank 0 stopped: its heartbeat store does not answer (Connection reset by peer)."
    assert PeerMonitor(GoneStore(), 0, 2).check() is None  # rank 0 serves the store: no verdict on itself


def test_own_errors_are_reported_at_once_and_collective_errors_wait_for_the_verdict() -> None:
    from lmtrain.faults import RankWatchdog, may_be_a_lost_peer

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:65240.")
    wrapped = ValueError("step failed")
    wrapped.__cause__ = gloo
    assert may_be_a_lost_peer(gloo) and may_be_a_lost_peer(wrapped)
    assert may_be_a_lost_peer(dist.DistBackendError("NCCL error"))
    oom = RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.10 GiB")
    assert not may_be_a_lost_peer(oom) and not may_be_a_lost_peer(ValueError("bad shape"))

    # The watchdog has already named a dead rank: a collective's error defers to that verdict (this rank is not
    # marked failed, so the others name the dead rank); this rank's own error is marked at once regardless.
    for exception, marked in ((oom, True), (gloo, False)):
        (zero, one), _ = _monitors(2)
        dog = RankWatchdog(timeout_s=5.0, interval_s=0.5)
        dog.monitor, dog._verdict = one, "rank 0 stopped: no heartbeat for 5 s."
        dog._thread = threading.Thread(target=dog._stop.wait, daemon=True)  # the watchdog's thread, alive
        dog._thread.start()
        dog.on_exception(None, None, exception)  # type: ignore[arg-type]
        verdict = zero.check()
        dog._stop.set()
        assert (verdict == "rank 1 stopped: it failed with an error (see its own output).") is marked, verdict
