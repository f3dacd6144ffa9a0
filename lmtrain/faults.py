"""A dead rank stops the others within a minute, with one line naming it, not after a collective's timeout.

When one process of a multi-process run dies (killed, out of host memory, a node lost), the others wait in their
next collective: under NCCL until the process group's timeout (10 to 30 minutes), under gloo until the socket
closes, after which each survivor prints a traceback that does not say which rank is gone. ``RankWatchdog`` watches
liveness apart from the collectives, so it works alike for NCCL and gloo:

- Each rank runs a daemon thread that increments its own heartbeat counter in a small key-value store
  (``torch.distributed.TCPStore``, served by rank 0 on a free port that rank 0 broadcasts once at setup) every
  ``interval_s`` seconds, and reads the other ranks' counters.
- A counter that has not moved for ``timeout_s`` seconds means that rank is dead (or hung outside Python's reach);
  a store that stops answering means rank 0, which serves it, is gone. The watchdog then prints
  ``error: rank R stopped: ...`` on stderr and ends its own process with exit status :data:`PEER_LOST_STATUS`
  (``os._exit``: the main thread may be blocked in a collective that never returns).
- A rank that finishes (``teardown``), fails with an exception of its own or is interrupted (``on_exception``) says
  so in the store first: the others do not count a finished rank as dead, and stop at once, naming it, when one
  failed or was interrupted.
- When a collective fails first (gloo notices a closed socket at once), ``on_exception`` waits up to ``timeout_s``
  for the watchdog's verdict, so that the line names the rank instead of a socket. Any other exception (out of
  memory, a bug) is this rank's own (:func:`may_be_a_lost_peer`): it is marked at once, with no wait.

The heartbeat thread needs the Python interpreter only every ``interval_s``; a main thread that holds the GIL longer
than ``timeout_s`` in one call would look dead to the others. The default of 30 s keeps the stop within a minute.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl

#: Exit status of a rank that stops because another one died (``EX_TEMPFAIL``: trying again may work).
PEER_LOST_STATUS = 75
_BEAT, _STATE = "lmtrain/beat/{}", "lmtrain/state/{}"


class PeerMonitor:
    """Heartbeats of the ranks of one job through a ``TCPStore``, and the verdict on which rank is gone.

    Args:
        store: the store every rank of the job reaches (``torch.distributed.Store``).
        rank: this process's rank.
        world_size: ranks in the job.
        timeout_s: seconds without a heartbeat after which a rank counts as dead.
        interval_s: seconds between two heartbeats of this rank (and two looks at the others').
        clock: the monotonic clock (seconds) the staleness is measured on.
    """

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float = 30.0, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.interval_s, self.clock = timeout_s, interval_s, clock
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (its counter, when it last moved)
        self.finished: set[int] = set()  # ranks seen to have finished normally

    def beat(self) -> None:
        """Advance this rank's heartbeat counter."""
        self.store.add(_BEAT.format(self.rank), 1)

    def mark(self, state: str) -> None:
        """Record this rank's end state: ``done`` (left normally), ``failed`` (an exception of its own) or
        ``interrupted`` (Ctrl+C)."""
        self.store.set(_STATE.format(self.rank), state)

    def wait_for_others(self) -> None:
        """Wait (at most ``timeout_s``) until every other rank has recorded its end state: rank 0, which serves the
        store, must not leave before the others have read that it finished, or they would take it for dead."""
        deadline = self.clock() + self.timeout_s
        while self.clock() < deadline and any(self._state(r) is None for r in range(self.world_size) if r != self.rank):
            time.sleep(self.interval_s / 4)

    def _state(self, rank: int) -> str | None:
        key = _STATE.format(rank)
        return self.store.get(key).decode() if self.store.check([key]) else None

    def check(self) -> str | None:
        """One look at the other ranks: a one-line reason naming the first rank that is gone, or None.

        A store that raises means rank 0 (which serves it) is gone, unless this is rank 0.
        """
        try:
            now = self.clock()
            for rank in range(self.world_size):
                if rank == self.rank:
                    continue
                state = self._state(rank)
                if state == "failed":
                    return f"rank {rank} stopped: it failed with an error (see its own output)."
                if state == "interrupted":
                    return f"rank {rank} stopped: it was interrupted (Ctrl+C)."
                if state == "done":
                    self.finished.add(rank)
                    continue
                count = self.store.add(_BEAT.format(rank), 0)  # reads the counter without waiting for the key
                last = self._seen.get(rank)
                if last is None or count != last[0]:
                    self._seen[rank] = (count, now)
                elif now - last[1] > self.timeout_s:
                    return (f"rank {rank} stopped: no heartbeat for {now - last[1]:.0f} s (the process was killed, "
                            f"or hangs).")
        except Exception as exc:  # noqa: BLE001 - any store failure: its server (rank 0) is unreachable
            if self.rank == 0 or 0 in self.finished:
                return None  # the store is local here; or rank 0 finished and took it along
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            return f"rank 0 stopped: its heartbeat store does not answer ({first})."
        return None


class RankWatchdog(pl.Callback):
    """Stop this rank within ``timeout_s`` (plus ``interval_s``) when another rank of the run dies; name that rank.

    Does nothing in a single-process run. See the module docstring for how liveness is watched.

    Args:
        timeout_s: seconds without a heartbeat after which a rank counts as dead.
        interval_s: seconds between heartbeats.
    """

    def __init__(self, timeout_s: float = 30.0, interval_s: float = 1.0) -> None:
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.monitor: PeerMonitor | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._verdict: str | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        import torch.distributed as dist

        if trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()) or self._thread is not None:
            return
        store = _job_store(trainer.global_rank, trainer.world_size, timeout_s=self.timeout_s)
        self.monitor = PeerMonitor(store, trainer.global_rank, trainer.world_size, self.timeout_s, self.interval_s)
        self.monitor.beat()
        self._stop.clear()
        self._verdict = None
        self._thread = threading.Thread(target=self._watch, name="lmtrain-rank-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        assert self.monitor is not None
        while not self._stop.wait(self.interval_s):
            try:
                self.monitor.beat()
            except Exception:  # noqa: BLE001 - the store is gone: check() names rank 0
                pass
            verdict = self.monitor.check()
            if verdict is not None:
                self._verdict = verdict
                if not self._stop.is_set():
                    stop_process(verdict, self.monitor.rank)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.monitor is None:
            return
        if isinstance(exception, KeyboardInterrupt):
            self._end("interrupted")  # a second Ctrl+C stops at once: the others stop too, naming this rank
            return
        if not may_be_a_lost_peer(exception):  # this rank's own failure (out of memory, a bug): say so at once
            self._end("failed")
            return
        # A collective may fail before the heartbeats tell (gloo sees the closed socket at once): wait for the
        # watchdog's verdict, which names the rank, before this exception's traceback would.
        deadline = time.monotonic() + self.timeout_s + 2 * self.interval_s
        while self._verdict is None and time.monotonic() < deadline and self._thread and self._thread.is_alive():
            time.sleep(self.interval_s / 4)
        if self._verdict is None:  # the others live: the failure is this rank's own
            self._end("failed")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._end("done")

    def _end(self, state: str) -> None:
        if self.monitor is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.monitor.mark(state)
            if self.monitor.rank == 0:
                self.monitor.wait_for_others()
        except Exception:  # noqa: BLE001 - rank 0's store may be gone already; nothing is left to tell
            pass
        self.monitor, self._thread = None, None


#: Words of the errors a collective raises when another rank is gone (gloo: "Connection closed by peer" from
#: gloo's transport; NCCL: "remote process exited or there was a network error").
_PEER_WORDS = ("gloo", "nccl", "connection", "socket", "peer", "remote", "network", "timed out", "timeout")


def may_be_a_lost_peer(exception: BaseException) -> bool:
    """Whether ``exception`` (or one it was raised from) may come from a collective whose peer is gone.

    Such a failure waits for the watchdog's verdict, which names the dead rank; any other exception is this rank's
    own and is reported at once. Errs towards waiting: an unrecognised collective error would name this rank.
    """
    import torch.distributed as dist

    seen: set[int] = set()
    current: BaseException | None = exception
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, getattr(dist, "DistError", ())) or any(
                word in str(current).lower() for word in _PEER_WORDS):
            return True
        current = current.__cause__ or current.__context__
    return False


def stop_process(reason: str, rank: int) -> None:
    """Print ``error: <reason>`` for this rank on stderr and end the process at once (:data:`PEER_LOST_STATUS`)."""
    print(f"error: {reason} Stopping rank {rank}; resume from the last checkpoint with --ckpt_path last.",
          file=sys.stderr, flush=True)
    os._exit(PEER_LOST_STATUS)


def _job_store(rank: int, world_size: int, timeout_s: float) -> Any:
    """A ``TCPStore`` shared by the job's ranks: rank 0 serves it on a free port and broadcasts the address once.

    A store of its own, not the process group's (whose handle is private to torch), reached at ``MASTER_ADDR`` as
    the process group itself is.
    """
    import torch.distributed as dist

    address = [None]
    server = None
    if rank == 0:
        server = dist.TCPStore("0.0.0.0", 0, world_size, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=timeout_s))
        address = [(os.environ.get("MASTER_ADDR", "127.0.0.1"), server.port)]
    dist.broadcast_object_list(address, src=0)
    if server is not None:
        return server
    host, port = address[0]
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
