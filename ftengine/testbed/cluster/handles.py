"""The supervisor's view of one worker process: its pipe, its last reports (status, phase
changes, the history of its fault episodes), its lifecycle state (moved only through
``ftengine.testbed.cluster.lifecycle``'s table); and the events the supervisor logs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterable, Mapping
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import attrs

from ftengine.faults import HealthStatus, Phase
from ftengine.status import EngineStatus
from ftengine.testbed.cluster.lifecycle import INITIAL, WorkerEvent, WorkerState, next_state
from ftengine.testbed.cluster.protocol import PhaseEvent

EPISODE_HISTORY = 64
"""Fault episodes each engine's status keeps (the last ones); ``fault_episodes`` counts all."""


@attrs.frozen
class ClusterEvent:
    """Something the supervisor saw or did, at monotonic time ``at`` (seconds)."""

    at: float
    kind: str  # exit, fence, peer_fault, removed, command, command_done, step_failed
    rank: int | None
    detail: str


def signal_pid(pid: int, sig: int) -> None:
    """``os.kill(pid, sig)``; a process already gone is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def kill_all(workers: Iterable[WorkerHandle]) -> None:
    """SIGKILL the given workers that are still running (finalizer and shutdown)."""
    for worker in workers:
        if worker.process.is_alive() and worker.process.pid is not None:
            signal_pid(worker.process.pid, signal.SIGKILL)


def describe_exit(exitcode: int | None) -> str:
    """``killed by SIGKILL`` / ``exited with code 1`` for a process exit code."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class WorkerHandle:
    """Supervisor-side state of DP rank ``rank`` (guarded by the roster's lock)."""

    def __init__(
        self, rank: int, process: BaseProcess, conn: Connection, *, joining: bool = False
    ) -> None:
        self.rank = rank
        # A removed rank restarted to come back: no member (no steps, no retry or
        # scale_down) until its engine reports a member phase, i.e. it was admitted.
        self.joining = joining
        self.process = process
        self.conn = conn
        self.pid: int | None = process.pid
        self._state = INITIAL
        self.exit_info: str | None = None  # why the process is gone
        self.fenced_for: str | None = None  # why the supervisor killed it on purpose
        self.failure: str | None = None  # a WorkerFailed report (start-up or crash)
        self.last_heartbeat = time.monotonic()
        self.status: dict[str, Any] | None = None
        self.phases: list[PhaseEvent] = []
        # Every episode's last reported timeline, by episode number (oldest first), so that a
        # status poller sees each episode's end even when the next one already started.
        self.episodes: dict[int, dict[str, Any]] = {}
        self._send_lock = threading.Lock()

    # -- lifecycle (every move is a row of lifecycle.TABLE) ----------------------------------
    @property
    def state(self) -> WorkerState:
        """Where the worker is in its lifecycle."""
        return self._state

    @property
    def alive(self) -> bool:
        """Process alive (so not scaled away): the rank takes part in steps and commands."""
        return self._state.alive

    @property
    def member(self) -> bool:
        """Alive and a member of the deployment (not a returning rank still waiting)."""
        return self.alive and not self.joining

    @property
    def removed(self) -> bool:
        """Scaled away by a successful scale-down (its process is gone)."""
        return self._state is WorkerState.REMOVED

    def _move(self, event: WorkerEvent) -> WorkerState:
        """Fire ``event``; returns the state it left (raises TransitionError off the table)."""
        before = self._state
        self._state = next_state(before, event, rank=self.rank)
        return before

    def mark_ready(self, pid: int) -> None:
        """File the worker's Ready report (its pid, and a first heartbeat)."""
        self._move(WorkerEvent.READY)
        self.pid = pid
        self.last_heartbeat = time.monotonic()

    def fence(self, reason: str) -> bool:
        """Mark it fenced as hung; True when the caller must now SIGKILL it (it was serving)."""
        return self._mark_fenced(WorkerEvent.FENCE, reason)

    def retire(self, reason: str) -> bool:
        """Mark it fenced for a scale-down, so that its exit is not news; True when the
        caller must now SIGKILL it (False: already fenced or gone)."""
        return self._mark_fenced(WorkerEvent.RETIRE, reason)

    def _mark_fenced(self, event: WorkerEvent, reason: str) -> bool:
        before = self._move(event)
        # The kill goes out once: when the worker first becomes fenced.
        kill = not before.fenced and self._state.fenced
        if kill:
            self.fenced_for = reason
        return kill

    def exited(self, info: str | None) -> WorkerState:
        """File that the process ended (``info``: how); returns the state it left, so the
        caller can tell news (an alive state) from an exit already filed."""
        before = self._move(WorkerEvent.EXIT)
        if before.alive:
            self.exit_info = info
        return before

    def remove(self) -> bool:
        """Mark the gone worker scaled away; True when it was not already."""
        return self._move(WorkerEvent.REMOVE) is not WorkerState.REMOVED

    def send(self, message: object) -> bool:
        """Send to the worker; False when its pipe is closed (the process is gone)."""
        with self._send_lock:
            try:
                self.conn.send(message)
            except (OSError, ValueError, BrokenPipeError):
                return False
        return True

    def report(self, status: dict[str, Any]) -> None:
        """File the engine's latest status (and its current episode into the history)."""
        self.status = status
        if self.joining and Phase(str(status["phase"])).member:
            self.joining = False  # admitted: a member like any other from now on
        timeline = status.get("timeline")
        if isinstance(timeline, Mapping) and isinstance(timeline.get("episode"), int):
            self.episodes[timeline["episode"]] = dict(timeline)
            for number in sorted(self.episodes)[:-EPISODE_HISTORY]:
                del self.episodes[number]

    def engine_phase(self) -> Phase | None:
        """The phase the worker last reported (None before its first report)."""
        if self.status is None:
            return None
        return Phase(str(self.status["phase"]))

    def status_dict(self) -> dict[str, Any]:
        """The engine's last status, overridden to DEAD once its process is gone, plus
        ``fault_episodes`` (how many fault episodes the engine had, cumulative) and
        ``episodes`` (the last ``EPISODE_HISTORY`` of them, oldest first, each as last
        reported: ``timeline`` is only the current one)."""
        status: dict[str, Any] = dict(self.status or _blank_status(self.rank))
        status["pid"] = self.pid
        status["alive"] = self.alive
        status["fault_episodes"] = max(self.episodes, default=0)
        status["episodes"] = [self.episodes[number] for number in sorted(self.episodes)]
        if not self.alive:
            status["status"] = int(HealthStatus.DEAD)
            status["phase"] = Phase.DEAD.value
            status["fault_info"] = status.get("fault_info") or self.exit_info
            status["ft_error"] = f"worker process {self.exit_info}"
        return status


def _blank_status(rank: int) -> dict[str, Any]:
    """What a worker that has not reported yet shows: a fresh engine's status."""
    fresh = EngineStatus(
        id=rank,
        status=HealthStatus.HEALTHY,
        phase=Phase.RUNNING,
        fault_info=None,
        last_ft_request_id=None,
        ft_error=None,
        removed_ranks=frozenset(),
        epoch=0,
        attempts=0,
        timeline=None,
    )
    return fresh.to_dict()
