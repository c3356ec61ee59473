"""What the real-vLLM campaign sees of a deployment: every rank's
``/fault_tolerance/status`` polled by one thread, each change of an engine's status kept
with its monotonic time (detection is read off these)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs
import httpx

from ftengine.testbed.vllm.admit import own_status

POLL_S = 0.05


@attrs.frozen
class Change:
    """Engine ``rank`` reported ``status`` first at monotonic ``at``."""

    rank: int
    status: str
    at: float


class StatusWatch:
    """Polls every rank's status every ``POLL_S`` until :meth:`stop`."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)
        self.changes: list[Change] = []
        self._latest: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._http = httpx.Client(timeout=5.0)
        self.poll()
        self._thread = threading.Thread(target=self._loop, name="chaos-vllm-status", daemon=True)
        self._thread.start()

    def poll(self) -> dict[int, dict[str, Any]]:
        """Read every rank now; record what changed; returns the engines by rank."""
        seen = {r: own_status(self._http, url, r) for r, url in enumerate(self.urls)}
        now = time.monotonic()
        with self._lock:
            for rank, engine in seen.items():
                before = self._latest.get(rank, {}).get("status")
                if engine["status"] != before:
                    self.changes.append(Change(rank, str(engine["status"]), now))
            self._latest = seen
        return seen

    def latest(self) -> dict[int, dict[str, Any]]:
        """The engines as last polled."""
        with self._lock:
            return {r: dict(e) for r, e in self._latest.items()}

    def first(self, rank: int, statuses: Sequence[str], after: float) -> float | None:
        """When ``rank`` first reported one of ``statuses`` at or after ``after``."""
        with self._lock:
            times = [
                c.at
                for c in self.changes
                if c.rank == rank and c.status in statuses and c.at >= after
            ]
        return min(times, default=None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)
        self._http.close()

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            with contextlib.suppress(Exception):  # a poll error is recorded as unreachable
                self.poll()
