"""The Cluster supervisor: hosts the rendezvous store, spawns the workers, files their
messages, relays orchestrator commands and routes generation to live DP ranks.

It runs in the caller's process (never in a worker, so any rank may die). One reader
thread per worker files its messages; the exit watch (``ftengine.testbed.cluster.watch``) turns a
process exit or a heartbeat silence into a peer fault for the survivors and fences hung
workers; steps and commands run in ``generation`` and ``relay``. The workers, their lock
and the event log are the ``roster`` these parts share; ``Cluster`` composes them.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch._C._distributed_c10d import TCPStore

from ftengine.commands import CommandResult
from ftengine.faults import Phase
from ftengine.testbed.cluster.adapters import resolve_adapter_factory
from ftengine.testbed.cluster.checkpoint_check import validate_checkpoint
from ftengine.testbed.cluster.config import ClusterConfig
from ftengine.testbed.cluster.faults_inject import FaultSpec
from ftengine.testbed.cluster.generation import Generation, StepResult, StepRunner
from ftengine.testbed.cluster.handles import ClusterEvent, WorkerHandle, signal_pid
from ftengine.testbed.cluster.inflight import Resumption
from ftengine.testbed.cluster.lifecycle import WorkerState
from ftengine.testbed.cluster.prompts import Prompt, PromptTokenizer
from ftengine.testbed.cluster.protocol import (
    FtReply,
    Heartbeat,
    Inject,
    PhaseEvent,
    Ready,
    Shutdown,
    StatusUpdate,
    StepItem,
    StepReply,
    WorkerFailed,
)
from ftengine.testbed.cluster.relay import CommandRelay
from ftengine.testbed.cluster.roster import ClusterError, Roster
from ftengine.testbed.cluster.starts import worker_context, worker_target
from ftengine.testbed.cluster.watch import ExitWatch
from ftengine.testbed.cluster.worker import WorkerSpec
from ftengine.weights.index import CheckpointIndex

logger = logging.getLogger(__name__)

FT_OFF_REASON = (
    "fault tolerance is off for this cluster (ClusterConfig.fault_tolerance=False): "
    "it cannot recover; relaunch it"
)


class Cluster:
    """A running CPU cluster of ``config.dp_size`` workers. Build it with :meth:`launch`."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.started_at = time.monotonic()
        self._roster = Roster()
        self._closed = False
        self._serial = threading.Lock()  # one step or one command at a time
        self._store = TCPStore(config.host, 0, None, True, wait_for_workers=False)
        self._runner = StepRunner(self._roster, config)
        self._relay = CommandRelay(self._roster, config)
        self._watch = ExitWatch(self._roster, config)
        self._threads: list[threading.Thread] = []
        self._prompts = PromptTokenizer(config.checkpoint)

    # -- launch -------------------------------------------------------------------------
    @classmethod
    def launch(cls, config: ClusterConfig) -> Cluster:
        """Spawn the workers and wait until every one is loaded and joined (or raise)."""
        if config.command_adapter is not None:
            # A bad adapter name fails here, once, rather than in every worker.
            resolve_adapter_factory(config.command_adapter)
        validate_checkpoint(config.checkpoint)  # a bad checkpoint fails here, before any worker
        cluster = cls(config)
        # The roster, not the cluster, is what the finalizer holds on to.
        weakref.finalize(cluster, cluster._roster.kill_all)
        try:
            cluster._spawn()
            cluster._wait_ready()
        except BaseException:
            cluster.shutdown()
            raise
        return cluster

    def _spawn(self) -> None:
        for rank in range(self.config.dp_size):
            self._roster.add(self._start_worker(rank, rejoining=False))
        self._start_thread("ftengine-exit-watch", self._watch.run)

    def _start_worker(self, rank: int, *, rejoining: bool) -> WorkerHandle:
        """Start rank ``rank``'s worker process and its reader thread (not yet enrolled)."""
        cfg = self.config
        redundant = cfg.num_redundant_experts
        if redundant is None:
            redundant = CheckpointIndex.open(cfg.checkpoint).num_experts
        fault = cfg.inject_fault if cfg.inject_fault is not None else FaultSpec.from_env()
        if rejoining:
            fault = None  # a fault planned for the first life of a rank is not replayed
        ctx = worker_context(cfg.worker_start)
        spec = WorkerSpec.from_config(
            cfg,
            rank,
            store_port=self._store.port,
            num_redundant=redundant,
            inject_fault=fault,
            rejoining=rejoining,
        )
        parent, child = ctx.Pipe(duplex=True)
        target, args = worker_target(cfg.worker_start, spec, child)
        process = ctx.Process(  # type: ignore[attr-defined]
            target=target, args=args, name=f"ftengine-worker-{rank}", daemon=True
        )
        process.start()
        child.close()
        handle = WorkerHandle(rank, process, parent, joining=rejoining)
        self._start_thread(f"ftengine-reader-{rank}", self._read_loop, handle)
        return handle

    def _start_thread(self, name: str, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        serving = WorkerState.SERVING
        with self._roster.lock:
            workers = self._roster.workers()
            while not all(w.state is serving and w.status is not None for w in workers):
                failed = [w for w in workers if w.failure or not w.alive]
                if failed:
                    w = failed[0]
                    raise ClusterError(
                        f"worker {w.rank} failed to start: {w.failure or w.exit_info}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting = [w.rank for w in workers if w.state is WorkerState.STARTING]
                    raise ClusterError(
                        f"workers {waiting} not ready after {self.config.start_timeout_s}s; "
                        "raise ClusterConfig.start_timeout_s on a slow machine"
                    )
                self._roster.lock.wait(min(left, 0.2))

    # -- threads --------------------------------------------------------------------------
    def _read_loop(self, worker: WorkerHandle) -> None:
        while True:
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                return
            with self._roster.lock:
                self._file(worker, message)
                self._roster.lock.notify_all()

    def _file(self, worker: WorkerHandle, message: object) -> None:
        if isinstance(message, Heartbeat):
            worker.last_heartbeat = time.monotonic()
        elif isinstance(message, StatusUpdate):
            worker.report(message.status)
            self._roster.adopt_removals()
        elif isinstance(message, PhaseEvent):
            worker.phases.append(message)
        elif isinstance(message, StepReply):
            self._runner.file_reply(message)
        elif isinstance(message, FtReply):
            self._relay.file_reply(message)
        elif isinstance(message, Ready):
            worker.mark_ready(message.pid)
        elif isinstance(message, WorkerFailed):
            worker.failure = message.error
            logger.error("worker %d failed: %s", worker.rank, message.error)

    # -- public API -----------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        return self.config.dp_size

    def status(self) -> dict[str, Any]:
        """vLLM-shaped status of every engine (dead processes reported DEAD)."""
        with self._roster.lock:
            engines = [w.status_dict() for w in self._roster.workers()]
        return {"schema_version": 1, "total_engines": len(engines), "engines": engines}

    def phase_changes(self) -> dict[int, list[PhaseEvent]]:
        """Every phase change each engine reported, oldest first (monotonic ``at``)."""
        with self._roster.lock:
            return {w.rank: list(w.phases) for w in self._roster.workers()}

    def events(self) -> list[ClusterEvent]:
        """What the supervisor saw and did (exits, fences, commands), oldest first."""
        return self._roster.events()

    @property
    def steps_run(self) -> int:
        """Lockstep model steps started so far (fault injection counts these)."""
        return self._runner.steps_run

    @property
    def removed_ranks(self) -> frozenset[int]:
        """Ranks scaled away by successful scale_down commands (cumulative)."""
        with self._roster.lock:
            return frozenset(w.rank for w in self._roster.workers() if w.removed)

    def live_ranks(self) -> frozenset[int]:
        """Ranks whose process is alive and that were not scaled away."""
        with self._roster.lock:
            return frozenset(w.rank for w in self._roster.workers() if w.alive)

    def pids(self) -> dict[int, int | None]:
        """Worker pids by rank (the only processes this cluster ever signals)."""
        with self._roster.lock:
            return {w.rank: w.pid for w in self._roster.workers()}

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to worker ``rank``'s process (fault injection from outside)."""
        worker = self._roster.worker(rank)
        if worker.alive and worker.process.pid is not None:
            signal_pid(worker.process.pid, sig)

    def inject(self, spec: FaultSpec) -> bool:
        """Arm ``spec`` on worker ``spec.rank`` now (it fires at its next step, or reload for
        ``reload_error``); False when that worker is gone."""
        self._roster.record("inject", spec.rank, str(spec))
        return self._roster.worker(spec.rank).send(Inject(spec))

    def fence(self, rank: int, reason: str) -> None:
        """SIGKILL worker ``rank`` (a hung or removed rank) unless it is already fenced or gone."""
        self._roster.fence(rank, reason)

    def wait_for(
        self, predicate: Callable[[Mapping[str, Any]], bool], timeout: float
    ) -> float | None:
        """Wait until ``predicate(status())`` holds; seconds waited, or None on timeout."""
        start = time.monotonic()
        with self._roster.lock:
            while not predicate(self.status()):
                left = start + timeout - time.monotonic()
                if left <= 0:
                    return None
                self._roster.lock.wait(min(left, 0.05))
        return time.monotonic() - start

    def generate(self, prompt_token_ids: Prompt, max_tokens: int) -> list[int]:
        """Greedy generation on a live DP rank; returns the ``max_tokens`` new token ids.

        The prompt is token ids or text (tokenised with the checkpoint's tokenizer).
        Raises RequestAborted when the cluster is not serving or a fault hits the request.
        """
        return list(self.generate_batch([prompt_token_ids], max_tokens)[0].token_ids)

    def generate_batch(self, prompts: Sequence[Prompt], max_tokens: int) -> list[Generation]:
        """Serve ``prompts`` together (spread over the live ranks, lockstep steps)."""
        self._check_open()
        token_ids = self._prompts.encode_all(prompts)
        with self._serial:
            return self._runner.run(token_ids, max_tokens)

    # -- the serving loop's primitives (``ftengine.testbed.cluster.serving``) ---------------
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

    def resumption(self) -> Resumption | None:
        """What a serving loop holds requests through faults with (re-inference), or None
        when ``config`` turns re-inference (or fault tolerance) off."""
        bounds = self.config.reinference_bounds
        return None if bounds is None else Resumption(bounds, self.recovery_verdict)

    def recovery_verdict(self) -> str | None:
        """Why held requests can no longer resume (an engine ended DEAD, or the cluster
        was shut down), or None while recovery may still succeed."""
        if self._closed:
            return "the cluster was shut down"
        with self._roster.lock:
            for worker in self._roster.workers():
                if worker.alive and worker.engine_phase() is Phase.DEAD:
                    status = worker.status or {}
                    why = status.get("ft_error") or status.get("fault_info") or "no reason given"
                    return f"engine {worker.rank} is DEAD: {why}"
        return None

    def apply(
        self, instruction: str, params: Mapping[str, object], request_id: str
    ) -> CommandResult:
        """Run an orchestrator command on every live engine, to the end (blocking).

        Refused (``success=False``) when fault tolerance is off."""
        self._check_open()
        if not self.config.fault_tolerance:
            return CommandResult(request_id, False, FT_OFF_REASON)
        with self._serial:
            self._roster.record("command", None, f"{instruction} {dict(params)} ({request_id})")
            result = self._relay.apply(instruction, params, request_id)
            self._roster.record(
                "command_done", None, f"{request_id}: {result.success} {result.reason}"
            )
            return result

    # -- rejoin ---------------------------------------------------------------------------
    def restart(self, rank: int) -> float:
        """Start removed rank ``rank``'s worker again, with the start-up spec it had; it
        loads its own experts and waits, ready, while the members keep serving. Returns the
        seconds until it reported ready; raises ClusterError if it fails or is too slow."""
        self._check_open()
        start = time.monotonic()
        handle = self._start_worker(rank, rejoining=True)
        try:
            self._roster.replace(handle)
        except ClusterError:
            handle.process.kill()
            handle.process.join(timeout=5.0)
            handle.conn.close()
            raise
        self._roster.record("restart", rank, f"pid {handle.process.pid}, to rejoin")
        deadline = start + self.config.start_timeout_s
        with self._roster.lock:
            while handle.engine_phase() is not Phase.READY:
                if handle.failure or not handle.alive:
                    raise ClusterError(
                        f"returning rank {rank} failed: {handle.failure or handle.exit_info}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ClusterError(
                        f"returning rank {rank} not ready after {self.config.start_timeout_s}s"
                    )
                self._roster.lock.wait(min(left, 0.05))
        return time.monotonic() - start

    def announce_ready(self, request_id: str) -> CommandResult:
        """Tell every member, between two steps, which returning ranks are ready; under the
        ``auto`` policy they admit them at once (the result is then the admission's),
        otherwise they wait for a ``scale_up`` command (``apply``)."""
        self._check_open()
        with self._serial:
            self._roster.record("announce_ready", None, request_id)
            result = self._relay.announce_ready(request_id)
            self._roster.record(
                "announce_done", None, f"{request_id}: {result.success} {result.reason}"
            )
            return result

    def joining_ranks(self) -> frozenset[int]:
        """Returning ranks restarted and not admitted yet."""
        with self._roster.lock:
            return frozenset(w.rank for w in self._roster.workers() if w.joining and w.alive)

    def retire(self, rank: int, reason: str) -> None:
        """Fence ``rank`` for a scale-down and wait for its exit (not announced as a fault)."""
        self._roster.retire(rank, reason)

    def shutdown(self) -> None:
        """Stop every worker (Shutdown, then SIGKILL for stragglers), threads and the store."""
        roster = self._roster
        with roster.lock:
            if self._closed:
                return
            self._closed = True
            workers = roster.workers()
        roster.stopping.set()
        for worker in workers:
            if worker.alive:
                worker.send(Shutdown())
        deadline = time.monotonic() + 5.0
        for worker in workers:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
        roster.kill_all()
        for worker in workers:
            worker.process.join(timeout=5.0)
        roster.file_shutdown()
        for thread in self._threads:
            thread.join(timeout=2.0)
        del self._store

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise ClusterError("the cluster was shut down; launch a new one")
