"""The supervisor's exit and heartbeat watch: the verdicts the survivors cannot reach alone.

One thread waits on the workers' process sentinels. An exit marks the worker gone (its
engine reads DEAD) and, with fault tolerance on, is announced to the survivors as a dead
peer with its rank, so an idle cluster goes UNHEALTHY without sacrificing a request; a
worker whose heartbeats stop for ``heartbeat_timeout_s`` is declared hung and fenced
(SIGKILL, only ever the cluster's own pids). With fault tolerance off, exits are only
recorded: nobody is told and nobody is fenced.
"""

from __future__ import annotations

import time
from multiprocessing.connection import wait as wait_for_objects

from ftengine.faults import FaultKind
from ftengine.testbed.cluster.config import ClusterConfig
from ftengine.testbed.cluster.handles import WorkerHandle
from ftengine.testbed.cluster.lifecycle import WorkerState
from ftengine.testbed.cluster.protocol import PeerFault
from ftengine.testbed.cluster.roster import Roster

TICK_S = 0.05


class ExitWatch:
    """Watches a roster's workers; :meth:`run` is the watch thread's body."""

    def __init__(self, roster: Roster, config: ClusterConfig) -> None:
        self._roster = roster
        self._config = config
        self._announce = config.fault_tolerance

    def run(self) -> None:
        """Until the cluster stops: handle exits, then (fault tolerance on) heartbeats."""
        roster = self._roster
        while not roster.stopping.is_set():
            with roster.lock:
                watched = {w.process.sentinel: w for w in roster.workers() if w.alive}
            if not watched:
                roster.stopping.wait(TICK_S)
                continue
            for ready in wait_for_objects(list(watched), timeout=TICK_S):
                if isinstance(ready, int):
                    self.on_exit(watched[ready])
            if self._announce:
                self._check_heartbeats()

    def _check_heartbeats(self) -> None:
        roster = self._roster
        now = time.monotonic()
        with roster.lock:
            silent = [
                w
                for w in roster.workers()
                if w.state is WorkerState.SERVING
                and now - w.last_heartbeat > self._config.heartbeat_timeout_s
            ]
        for worker in silent:
            silence = now - worker.last_heartbeat
            if self._config.worker_netns is None:
                roster.fence(worker.rank, f"hung: no heartbeat for {silence:.2f}s")
            else:  # each heartbeat crossed the network to the store first
                roster.fence(
                    worker.rank,
                    f"hung or cut off the network: no heartbeat over the network for "
                    f"{silence:.2f}s; the supervisor's side keeps serving",
                )

    def on_exit(self, worker: WorkerHandle) -> None:
        """Record that ``worker``'s process ended; tell the survivors unless it was expected."""
        gone = self._roster.file_exit(worker)
        if gone is None or gone.expected or not self._announce:
            return
        kind = FaultKind.HUNG_PEER if gone.fenced else FaultKind.DEAD_PEER
        for other in gone.survivors:
            # The victim is gone either way: survivors learn it as a dead peer with its rank.
            other.send(PeerFault(FaultKind.DEAD_PEER, worker.rank, f"{kind.value}: {gone.info}"))
        if gone.survivors:
            told = [w.rank for w in gone.survivors]
            self._roster.record("peer_fault", worker.rank, f"told ranks {told}")
