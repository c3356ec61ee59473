"""The supervisor's view of one worker process: its pipe, its last reports, its liveness."""

from __future__ import annotations

import signal
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from ftengine.cluster.protocol import PhaseEvent
from ftengine.faults import HealthStatus, Phase


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
    """Supervisor-side state of DP rank ``rank`` (guarded by the cluster's lock)."""

    def __init__(self, rank: int, process: BaseProcess, conn: Connection) -> None:
        self.rank = rank
        self.process = process
        self.conn = conn
        self.pid: int | None = process.pid
        self.ready = False
        self.alive = True
        self.exit_info: str | None = None  # why the process is gone
        self.fenced_for: str | None = None  # set before the supervisor kills it on purpose
        self.removed = False  # scaled away by a successful scale_down
        self.retiring = False  # fenced for a scale_down: its exit is not news
        self.failure: str | None = None  # a WorkerFailed report (start-up or crash)
        self.last_heartbeat = time.monotonic()
        self.status: dict[str, Any] | None = None
        self.phases: list[PhaseEvent] = []
        self._send_lock = threading.Lock()

    def send(self, message: object) -> bool:
        """Send to the worker; False when its pipe is closed (the process is gone)."""
        with self._send_lock:
            try:
                self.conn.send(message)
            except (OSError, ValueError, BrokenPipeError):
                return False
        return True

    @property
    def live(self) -> bool:
        """Process alive and not scaled away: the rank takes part in steps and commands."""
        return self.alive and not self.removed

    def engine_phase(self) -> Phase | None:
        """The phase the worker last reported (None before its first report)."""
        if self.status is None:
            return None
        return Phase(str(self.status["phase"]))

    def status_dict(self) -> dict[str, Any]:
        """The engine's last status, overridden to DEAD once its process is gone."""
        status: dict[str, Any] = dict(self.status or _blank_status(self.rank))
        status["pid"] = self.pid
        status["alive"] = self.alive
        if not self.alive:
            status["status"] = int(HealthStatus.DEAD)
            status["phase"] = Phase.DEAD.value
            status["fault_info"] = status.get("fault_info") or self.exit_info
            status["ft_error"] = f"worker process {self.exit_info}"
        return status


def _blank_status(rank: int) -> dict[str, Any]:
    return {
        "id": rank,
        "status": int(HealthStatus.HEALTHY),
        "phase": Phase.RUNNING.value,
        "fault_info": None,
        "last_ft_request_id": None,
        "ft_error": None,
        "removed_ranks": [],
        "epoch": 0,
        "attempts": 0,
        "timeline": None,
    }
