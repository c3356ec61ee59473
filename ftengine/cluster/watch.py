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
from typing import TYPE_CHECKING

from ftengine.cluster.handles import WorkerHandle, describe_exit
from ftengine.cluster.protocol import PeerFault
from ftengine.faults import FaultKind

if TYPE_CHECKING:
    from ftengine.cluster.supervisor import Cluster

TICK_S = 0.05


class ExitWatch:
    """Watches a Cluster's workers; :meth:`run` is the watch thread's body."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._announce = cluster.config.fault_tolerance

    def run(self) -> None:
        """Until the cluster stops: handle exits, then (fault tolerance on) heartbeats."""
        cluster = self._cluster
        while not cluster.stopping.is_set():
            with cluster.lock:
                watched = {w.process.sentinel: w for w in cluster.workers() if w.alive}
            if not watched:
                cluster.stopping.wait(TICK_S)
                continue
            for ready in wait_for_objects(list(watched), timeout=TICK_S):
                if isinstance(ready, int):
                    self.on_exit(watched[ready])
            if self._announce:
                self._check_heartbeats()

    def _check_heartbeats(self) -> None:
        cluster = self._cluster
        now = time.monotonic()
        with cluster.lock:
            silent = [
                w
                for w in cluster.workers()
                if w.alive
                and w.ready
                and w.fenced_for is None
                and now - w.last_heartbeat > cluster.config.heartbeat_timeout_s
            ]
        for worker in silent:
            cluster.fence(worker.rank, f"hung: no heartbeat for {now - worker.last_heartbeat:.2f}s")

    def on_exit(self, worker: WorkerHandle) -> None:
        """Record that ``worker``'s process ended; tell the survivors unless it was expected."""
        cluster = self._cluster
        worker.process.join(timeout=1.0)
        with cluster.lock:
            if not worker.alive:
                return
            worker.alive = False
            info = describe_exit(worker.process.exitcode)
            if worker.fenced_for is not None:
                info = f"{info} (fenced: {worker.fenced_for})"
            worker.exit_info = info
            cluster.record("exit", worker.rank, info)
            expected = cluster.stopping.is_set() or worker.removed or worker.retiring
            notify = self._announce and not expected
            survivors = [w for w in cluster.workers() if w.live] if notify else []
            cluster.lock.notify_all()
        kind = FaultKind.HUNG_PEER if worker.fenced_for else FaultKind.DEAD_PEER
        for other in survivors:
            # The victim is gone either way: survivors learn it as a dead peer with its rank.
            other.send(PeerFault(FaultKind.DEAD_PEER, worker.rank, f"{kind.value}: {info}"))
        if survivors:
            cluster.record("peer_fault", worker.rank, f"told ranks {[w.rank for w in survivors]}")
