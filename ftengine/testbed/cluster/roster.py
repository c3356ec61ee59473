"""The cluster's roster: its worker handles and what guards them (one lock with its
condition), the shutdown flag, the event log, and the supervisor's acts on workers (fence,
retire, file an exit, adopt removals).

The step runner, the command relay and the exit watch share the roster rather than the
whole ``Cluster``, which composes them around it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time

import attrs

from ftengine.errors import FTEngineError
from ftengine.testbed.cluster.handles import (
    ClusterEvent,
    WorkerHandle,
    describe_exit,
    kill_all,
    signal_pid,
)
from ftengine.testbed.cluster.lifecycle import WorkerState

logger = logging.getLogger(__name__)

RETIRE_JOIN_S = 10.0  # how long a retire waits for the SIGKILLed process to end
EXIT_JOIN_S = 1.0  # how long filing an exit waits to read the process's exit code


class ClusterError(FTEngineError, RuntimeError):
    """The cluster could not start, was used after shutdown, or was asked for a rank it lacks."""


@attrs.frozen
class Exit:
    """A worker's exit, filed for the first time: how it ended (``info``), whether the
    supervisor had fenced it, whether it was expected (shutdown began, or a scale-down
    retired it) and the workers still alive at that moment."""

    info: str
    fenced: bool
    expected: bool
    survivors: tuple[WorkerHandle, ...]


class Roster:
    """The workers of one cluster and the lock that guards them and their handles."""

    def __init__(self) -> None:
        self.lock = threading.Condition(threading.RLock())
        """Held to read or change any handle; notified whenever a worker's news is filed."""
        self.stopping = threading.Event()
        """Set once shutdown began (exits after it are expected, not faults)."""
        self._workers: list[WorkerHandle] = []
        self._events: list[ClusterEvent] = []

    # -- the workers ------------------------------------------------------------------------
    def add(self, worker: WorkerHandle) -> None:
        """Enrol a freshly spawned worker (ranks are enrolled in order)."""
        with self.lock:
            if worker.rank != len(self._workers):
                raise ClusterError(
                    f"workers are enrolled in rank order: expected rank {len(self._workers)}, "
                    f"found {worker.rank}"
                )
            self._workers.append(worker)

    def replace(self, worker: WorkerHandle) -> WorkerHandle:
        """Enrol ``worker``, a restarted removed rank, in place of its old handle, whose pipe
        is closed and process reaped (no fd left behind). Returns the old handle."""
        with self.lock:
            old = self.worker(worker.rank)
            if not old.removed:
                raise ClusterError(
                    f"rank {worker.rank} is {old.state.value}: only a removed rank can be "
                    "restarted to rejoin (scale it down first)"
                )
            self._workers[worker.rank] = worker
        old.conn.close()
        old.process.join(timeout=EXIT_JOIN_S)
        with contextlib.suppress(ValueError):  # still running: leave it to the finalizer
            old.process.close()
        return old

    def workers(self) -> list[WorkerHandle]:
        """Every worker, by rank (a copy of the list; read their fields under ``lock``)."""
        with self.lock:
            return list(self._workers)

    def worker(self, rank: int) -> WorkerHandle:
        """Worker ``rank``; ClusterError when the cluster has no such rank."""
        with self.lock:
            if not 0 <= rank < len(self._workers):
                raise ClusterError(f"rank must be in [0, {len(self._workers)}), found {rank}")
            return self._workers[rank]

    def kill_all(self) -> None:
        """SIGKILL every worker still running (the cluster's finalizer and its shutdown)."""
        kill_all(self.workers())

    # -- the event log ------------------------------------------------------------------------
    def record(self, kind: str, rank: int | None, detail: str) -> None:
        """Log what the supervisor saw or did (kept for ``events()`` and logged)."""
        with self.lock:
            self._events.append(ClusterEvent(time.monotonic(), kind, rank, detail))
        logger.info("%s rank=%s %s", kind, rank, detail)

    def events(self) -> list[ClusterEvent]:
        """Every recorded event, oldest first."""
        with self.lock:
            return list(self._events)

    # -- acts on workers ------------------------------------------------------------------------
    def fence(self, rank: int, reason: str) -> None:
        """SIGKILL worker ``rank`` as hung unless it is already fenced or gone."""
        worker = self.worker(rank)
        with self.lock:
            kill = worker.fence(reason)
        if kill:
            self._kill(worker, reason)

    def retire(self, rank: int, reason: str) -> None:
        """Fence ``rank`` for a scale-down and wait for its exit (not announced as a fault)."""
        worker = self.worker(rank)
        with self.lock:
            # Marked before the kill so that its exit is not announced as a new fault.
            kill = worker.retire(reason)
        if kill:
            self._kill(worker, reason)
        worker.process.join(timeout=RETIRE_JOIN_S)
        self.file_exit(worker)

    def _kill(self, worker: WorkerHandle, reason: str) -> None:
        self.record("fence", worker.rank, reason)
        if worker.process.pid is not None:
            signal_pid(worker.process.pid, signal.SIGKILL)

    def file_exit(self, worker: WorkerHandle) -> Exit | None:
        """Record that ``worker``'s process ended; None when its exit was already filed."""
        worker.process.join(timeout=EXIT_JOIN_S)
        with self.lock:
            info = describe_exit(worker.process.exitcode)
            if worker.fenced_for is not None:
                info = f"{info} (fenced: {worker.fenced_for})"
            before = worker.exited(info)
            if not before.alive:
                return None
            self.record("exit", worker.rank, info)
            expected = self.stopping.is_set() or before is WorkerState.RETIRING
            if worker.joining:
                # A returning rank that died before admission: no member had it; it is
                # simply removed again (the operator may restart it once more).
                expected = True
                worker.remove()
                self.record("removed", worker.rank, "returning rank exited before admission")
            survivors = tuple(w for w in self._workers if w.member)
            self.lock.notify_all()
        return Exit(info, before.fenced, expected, survivors)

    def file_shutdown(self) -> None:
        """Shutdown reaped every process: file each worker as gone and close its pipe."""
        with self.lock:
            for worker in self._workers:
                worker.exited(None)
        for worker in self.workers():
            worker.conn.close()

    def adopt_removals(self) -> None:
        """Mark dead ranks removed once every live engine removed them (auto scale-down).

        Called with ``lock`` held, by the reader that filed a status report."""
        with self.lock:
            live = [w for w in self._workers if w.member]
            if not live or any(w.status is None for w in live):
                return
            agreed = set.intersection(*(set(w.status["removed_ranks"]) for w in live if w.status))
            for worker in self._workers:
                if worker.rank in agreed and not worker.alive and worker.remove():
                    self.record("removed", worker.rank, "every live engine scaled it away")
