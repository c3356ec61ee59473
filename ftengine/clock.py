"""Injected time: the engine and policies read time only through a Clock, so tests never sleep."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds and a sleep that the clock controls."""

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """The real clock (``time.monotonic``)."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class ManualClock:
    """A clock that only moves when told to; ``sleep`` advances it instantly."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back: advance({seconds!r}) needs seconds >= 0")
        with self._lock:
            self._now += seconds
