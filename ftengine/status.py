"""What the engine tells the outside world: ``EngineStatus`` snapshots, ``PhaseChange`` events."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import attrs

from ftengine.faults import HealthStatus, Phase
from ftengine.timeline import Timeline

logger = logging.getLogger(__name__)


@attrs.frozen
class PhaseChange:
    """One phase change: ``source`` -> ``dest`` at ``at`` (engine clock s) because ``reason``."""

    source: Phase
    dest: Phase
    at: float
    reason: str
    trigger: str
    epoch: int


@attrs.frozen
class EngineStatus:
    """A consistent snapshot of one engine, in vLLM's status vocabulary plus ftengine's extras.

    ``status`` is the vLLM health value; ``fault_info`` the current episode's last fault
    (None while serving); ``ft_error`` why the last recovery failed or why the engine died;
    ``removed_ranks`` the cumulative original DP ranks scaled away; ``ready_ranks`` those
    of them whose returning worker reported ready to be admitted; ``last_admission`` the
    last scale-up it took part in (ranks added, seconds, ok, reloads); ``attempts`` the
    recoveries started in the current (or last) episode; ``timeline`` that episode's record.
    """

    id: int
    status: HealthStatus
    phase: Phase
    fault_info: str | None
    last_ft_request_id: str | None
    ft_error: str | None
    removed_ranks: frozenset[int]
    epoch: int
    attempts: int
    timeline: Timeline | None
    ready_ranks: frozenset[int] = frozenset()
    last_admission: dict[str, object] | None = None

    def to_dict(self) -> dict[str, object]:
        """JSON-able form (``status`` as its int, ``phase`` as its name, ranks sorted)."""
        return {
            "id": self.id,
            "status": int(self.status),
            "phase": self.phase.value,
            "fault_info": self.fault_info,
            "last_ft_request_id": self.last_ft_request_id,
            "ft_error": self.ft_error,
            "removed_ranks": sorted(self.removed_ranks),
            "ready_ranks": sorted(self.ready_ranks),
            "last_admission": None if self.last_admission is None else dict(self.last_admission),
            "epoch": self.epoch,
            "attempts": self.attempts,
            "timeline": None if self.timeline is None else self.timeline.to_dict(),
        }


Listener = Callable[[PhaseChange], None]


class Listeners:
    """Phase-change subscribers, called in subscription order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Add ``listener``; returns a function that removes it again."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def notify(self, change: PhaseChange) -> None:
        """Call every listener with ``change``."""
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(change)
            except Exception:
                # A broken observer must not break recovery; its traceback is logged.
                logger.exception("phase listener %r failed on %r", listener, change)
