"""The campaign's history: every injection, detection, command, recovery, rebuild and
request outcome with its monotonic time, so a violated invariant can be shown with what
happened around it (``excerpt``)."""

from __future__ import annotations

import threading
import time
from typing import Any

import attrs


@attrs.frozen
class Entry:
    """One thing that happened at monotonic time ``at`` (seconds)."""

    at: float
    what: str  # inject, detected, command, command_done, recovered, rebuild, request, ...
    fault: int | None
    detail: dict[str, Any]

    def line(self, origin: float) -> str:
        """``+12.345 s  #3 inject {...}`` relative to ``origin``."""
        fault = "" if self.fault is None else f"#{self.fault} "
        return f"+{self.at - origin:.3f} s  {fault}{self.what} {self.detail}"


class History:
    """Append-only, thread-safe log of :class:`Entry` (traffic threads write to it too)."""

    def __init__(self) -> None:
        self.origin = time.monotonic()
        self._entries: list[Entry] = []
        self._lock = threading.Lock()

    def add(self, what: str, fault: int | None = None, **detail: Any) -> Entry:
        """Record ``what`` now."""
        entry = Entry(time.monotonic(), what, fault, detail)
        with self._lock:
            self._entries.append(entry)
        return entry

    def entries(self) -> list[Entry]:
        """Every entry so far, oldest first."""
        with self._lock:
            return list(self._entries)

    def excerpt(self, start: float, end: float, *, limit: int = 40) -> list[str]:
        """The entries between monotonic ``start`` and ``end`` as lines (the last ``limit``)."""
        lines = [e.line(self.origin) for e in self.entries() if start <= e.at <= end]
        return lines[-limit:]
