"""The Cluster supervisor: hosts the rendezvous store, spawns the workers, files their
messages, relays orchestrator commands and routes generation to live DP ranks.

It runs in the caller's process (never in a worker, so any rank may die). One reader
thread per worker files its messages; the exit watch (``ftengine.cluster.watch``) turns a
process exit or a heartbeat silence into a peer fault for the survivors and fences hung
workers; steps and commands run in ``generation`` and ``relay``.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch._C._distributed_c10d import TCPStore

from ftengine.cluster.adapters import resolve_adapter_factory
from ftengine.cluster.config import ClusterConfig
from ftengine.cluster.faults_inject import FaultSpec
from ftengine.cluster.generation import Generation, StepResult, StepRunner
from ftengine.cluster.handles import ClusterEvent, WorkerHandle, kill_all, signal_pid
from ftengine.cluster.protocol import (
    FtReply,
    Heartbeat,
    PhaseEvent,
    Ready,
    Shutdown,
    StatusUpdate,
    StepItem,
    StepReply,
    WorkerFailed,
)
from ftengine.cluster.relay import CommandRelay
from ftengine.cluster.watch import ExitWatch
from ftengine.cluster.worker import WorkerSpec, worker_main
from ftengine.commands import CommandResult
from ftengine.errors import FTEngineError
from ftengine.weights.index import CheckpointIndex

logger = logging.getLogger(__name__)

FT_OFF_REASON = (
    "fault tolerance is off for this cluster (ClusterConfig.fault_tolerance=False): "
    "it cannot recover; relaunch it"
)


class ClusterError(FTEngineError, RuntimeError):
    """The cluster could not start, or was used after shutdown."""


class Cluster:
    """A running CPU cluster of ``config.dp_size`` workers. Build it with :meth:`launch`."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.started_at = time.monotonic()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._workers: list[WorkerHandle] = []
        self._events: list[ClusterEvent] = []
        self._stopping = threading.Event()
        self._closed = False
        self._serial = threading.Lock()  # one step or one command at a time
        self._store = TCPStore(config.host, 0, None, True, wait_for_workers=False)
        self._runner = StepRunner(self)
        self._relay = CommandRelay(self)
        self._watch = ExitWatch(self)
        self._threads: list[threading.Thread] = []

    # -- launch -------------------------------------------------------------------------
    @classmethod
    def launch(cls, config: ClusterConfig) -> Cluster:
        """Spawn the workers and wait until every one is loaded and joined (or raise)."""
        if config.command_adapter is not None:
            # A bad adapter name fails here, once, rather than in every worker.
            resolve_adapter_factory(config.command_adapter)
        cluster = cls(config)
        weakref.finalize(cluster, kill_all, cluster._workers)
        try:
            cluster._spawn()
            cluster._wait_ready()
        except BaseException:
            cluster.shutdown()
            raise
        return cluster

    def _spawn(self) -> None:
        cfg = self.config
        index = CheckpointIndex.open(cfg.checkpoint)
        redundant = cfg.num_redundant_experts
        if redundant is None:
            redundant = index.num_experts
        fault = cfg.inject_fault if cfg.inject_fault is not None else FaultSpec.from_env()
        ctx = multiprocessing.get_context("spawn")
        for rank in range(cfg.dp_size):
            spec = WorkerSpec.for_rank(
                cfg, rank, store_port=self._store.port, num_redundant=redundant, inject_fault=fault
            )
            parent, child = ctx.Pipe(duplex=True)
            process = ctx.Process(
                target=worker_main, args=(spec, child), name=f"ftengine-worker-{rank}", daemon=True
            )
            process.start()
            child.close()
            handle = WorkerHandle(rank, process, parent)
            self._workers.append(handle)
            self._start_thread(f"ftengine-reader-{rank}", self._read_loop, handle)
        self._start_thread("ftengine-exit-watch", self._watch.run)

    def _start_thread(self, name: str, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        with self._changed:
            while not all(w.ready and w.status is not None for w in self._workers):
                failed = [w for w in self._workers if w.failure or not w.alive]
                if failed:
                    w = failed[0]
                    raise ClusterError(
                        f"worker {w.rank} failed to start: {w.failure or w.exit_info}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting = [w.rank for w in self._workers if not w.ready]
                    raise ClusterError(
                        f"workers {waiting} not ready after {self.config.start_timeout_s}s; "
                        "raise ClusterConfig.start_timeout_s on a slow machine"
                    )
                self._changed.wait(min(left, 0.2))

    # -- threads --------------------------------------------------------------------------
    def _read_loop(self, worker: WorkerHandle) -> None:
        while True:
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                return
            with self._changed:
                self._file(worker, message)
                self._changed.notify_all()

    def _file(self, worker: WorkerHandle, message: object) -> None:
        if isinstance(message, Heartbeat):
            worker.last_heartbeat = time.monotonic()
        elif isinstance(message, StatusUpdate):
            worker.report(message.status)
            self._adopt_removals()
        elif isinstance(message, PhaseEvent):
            worker.phases.append(message)
        elif isinstance(message, StepReply):
            self._runner.file_reply(message)
        elif isinstance(message, FtReply):
            self._relay.file_reply(message)
        elif isinstance(message, Ready):
            worker.ready = True
            worker.pid = message.pid
            worker.last_heartbeat = time.monotonic()
        elif isinstance(message, WorkerFailed):
            worker.failure = message.error
            logger.error("worker %d failed: %s", worker.rank, message.error)

    def _adopt_removals(self) -> None:
        """Mark dead ranks removed once every live engine removed them (auto scale-down)."""
        live = [w for w in self._workers if w.live]
        if not live or any(w.status is None for w in live):
            return
        agreed = set.intersection(*(set(w.status["removed_ranks"]) for w in live if w.status))
        for worker in self._workers:
            if worker.rank in agreed and not worker.alive and not worker.removed:
                worker.removed = True
                self._event("removed", worker.rank, "every live engine scaled it away")

    def _event(self, kind: str, rank: int | None, detail: str) -> None:
        with self._lock:
            self._events.append(ClusterEvent(time.monotonic(), kind, rank, detail))
        logger.info("%s rank=%s %s", kind, rank, detail)

    # -- public API -----------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        return self.config.dp_size

    def status(self) -> dict[str, Any]:
        """vLLM-shaped status of every engine (dead processes reported DEAD)."""
        with self._lock:
            engines = [w.status_dict() for w in self._workers]
        return {"schema_version": 1, "total_engines": len(engines), "engines": engines}

    def phase_changes(self) -> dict[int, list[PhaseEvent]]:
        """Every phase change each engine reported, oldest first (monotonic ``at``)."""
        with self._lock:
            return {w.rank: list(w.phases) for w in self._workers}

    def events(self) -> list[ClusterEvent]:
        """What the supervisor saw and did (exits, fences, commands), oldest first."""
        with self._lock:
            return list(self._events)

    @property
    def steps_run(self) -> int:
        """Lockstep model steps started so far (fault injection counts these)."""
        return self._runner.steps_run

    @property
    def removed_ranks(self) -> frozenset[int]:
        """Ranks scaled away by successful scale_down commands (cumulative)."""
        with self._lock:
            return frozenset(w.rank for w in self._workers if w.removed)

    def live_ranks(self) -> frozenset[int]:
        """Ranks whose process is alive and that were not scaled away."""
        with self._lock:
            return frozenset(w.rank for w in self._workers if w.live)

    def pids(self) -> dict[int, int | None]:
        """Worker pids by rank (the only processes this cluster ever signals)."""
        with self._lock:
            return {w.rank: w.pid for w in self._workers}

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to worker ``rank``'s process (fault injection from outside)."""
        worker = self._worker(rank)
        if worker.alive and worker.process.pid is not None:
            signal_pid(worker.process.pid, sig)

    def fence(self, rank: int, reason: str) -> None:
        """SIGKILL worker ``rank`` (a hung or removed rank) unless it is already gone."""
        worker = self._worker(rank)
        with self._lock:
            if not worker.alive or worker.fenced_for is not None:
                return
            worker.fenced_for = reason
        self._event("fence", rank, reason)
        if worker.process.pid is not None:
            signal_pid(worker.process.pid, signal.SIGKILL)

    def wait_for(
        self, predicate: Callable[[Mapping[str, Any]], bool], timeout: float
    ) -> float | None:
        """Wait until ``predicate(status())`` holds; seconds waited, or None on timeout."""
        start = time.monotonic()
        with self._changed:
            while not predicate(self.status()):
                left = start + timeout - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(min(left, 0.05))
        return time.monotonic() - start

    def generate(self, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
        """Greedy generation on a live DP rank; returns the ``max_tokens`` new token ids.

        Raises RequestAborted when the cluster is not serving or a fault hits the request.
        """
        return list(self.generate_batch([prompt_token_ids], max_tokens)[0].token_ids)

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Generation]:
        """Serve ``prompts`` together (spread over the live ranks, lockstep steps)."""
        self._check_open()
        with self._serial:
            return self._runner.run(prompts, max_tokens)

    # -- the serving loop's primitives (``ftengine.cluster.serving``) -----------------------
    def serving_ranks(self) -> tuple[int, ...]:
        """The live ranks when all of them serve; raises RequestAborted otherwise."""
        self._check_open()
        return self._runner.serving_ranks()

    def run_step(self, items: Mapping[int, Sequence[StepItem]]) -> StepResult:
        """One lockstep step, rank ``r`` computing ``items[r]`` (see ``StepRunner.step``);
        serialised with batches and commands, so a command can run between two steps."""
        self._check_open()
        with self._serial:
            return self._runner.step(items)

    def release(self, rank: int, request_ids: Sequence[str]) -> None:
        """Drop finished or aborted requests' caches on ``rank`` with its next step."""
        self._runner.release(rank, request_ids)

    def apply(
        self, instruction: str, params: Mapping[str, object], request_id: str
    ) -> CommandResult:
        """Run an orchestrator command on every live engine, to the end (blocking).

        Refused (``success=False``) when fault tolerance is off."""
        self._check_open()
        if not self.config.fault_tolerance:
            return CommandResult(request_id, False, FT_OFF_REASON)
        with self._serial:
            self._event("command", None, f"{instruction} {dict(params)} ({request_id})")
            result = self._relay.apply(instruction, params, request_id)
            self._event("command_done", None, f"{request_id}: {result.success} {result.reason}")
            return result

    def retire(self, rank: int, reason: str) -> None:
        """Fence ``rank`` for a scale-down and wait for its exit (not announced as a fault)."""
        worker = self._worker(rank)
        with self._lock:
            # Marked first so that its exit is not announced as a new fault after recovery.
            worker.retiring = True
        self.fence(rank, reason)
        worker.process.join(timeout=10.0)
        self._watch.on_exit(worker)

    def shutdown(self) -> None:
        """Stop every worker (Shutdown, then SIGKILL for stragglers), threads and the store."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stopping.set()
        for worker in self._workers:
            if worker.alive:
                worker.send(Shutdown())
        deadline = time.monotonic() + 5.0
        for worker in self._workers:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
        kill_all(self._workers)
        for worker in self._workers:
            worker.process.join(timeout=5.0)
            worker.alive = False
            worker.conn.close()
        for thread in self._threads:
            thread.join(timeout=2.0)
        del self._store

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- helpers used by the step runner ----------------------------------------------------
    @property
    def lock(self) -> threading.Condition:
        return self._changed

    @property
    def stopping(self) -> threading.Event:
        """Set once shutdown began (exits after it are expected, not faults)."""
        return self._stopping

    def workers(self) -> list[WorkerHandle]:
        return list(self._workers)

    def record(self, kind: str, rank: int | None, detail: str) -> None:
        self._event(kind, rank, detail)

    def _worker(self, rank: int) -> WorkerHandle:
        if not 0 <= rank < len(self._workers):
            raise ClusterError(f"rank must be in [0, {len(self._workers)}), found {rank}")
        return self._workers[rank]

    def _check_open(self) -> None:
        if self._closed:
            raise ClusterError("the cluster was shut down; launch a new one")
