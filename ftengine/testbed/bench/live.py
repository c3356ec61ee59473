"""Showing a cluster's recovery as it happens: a watcher thread that turns new phase changes
and supervisor events into reporter calls, and reporters that print them (plain lines, or a
rich live table of every engine's phase on a terminal).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import IO, Protocol

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ftengine.testbed.bench.protocol import Watchable
from ftengine.testbed.control.snapshot import ClusterView

PHASE_STYLE = {
    "running": "green",
    "healthy": "bold green",
    "quarantined": "yellow",
    "retrying": "cyan",
    "scaling_down": "magenta",
    "dead": "bold red",
}


class Reporter(Protocol):
    """Receives what happens; ``at`` values are ``time.monotonic`` seconds."""

    def note(self, at: float, text: str) -> None: ...
    def phase(self, at: float, engine: int, source: str, dest: str, reason: str) -> None: ...
    def snapshot(self, view: ClusterView) -> None: ...
    def close(self) -> None: ...


class NullReporter:
    """Shows nothing (``--json``)."""

    def note(self, at: float, text: str) -> None:
        pass

    def phase(self, at: float, engine: int, source: str, dest: str, reason: str) -> None:
        pass

    def snapshot(self, view: ClusterView) -> None:
        pass

    def close(self) -> None:
        pass


def _line(t0: float, at: float, text: str) -> str:
    return f"[{at - t0:+9.3f}s] {text}"


def _phase_text(engine: int, source: str, dest: str, reason: str) -> str:
    why = f"  ({reason})" if reason else ""
    return f"engine {engine}: {source} -> {dest}{why}"


class PlainReporter:
    """One timestamped line per event (seconds since ``t0``), for logs and pipes."""

    def __init__(self, stream: IO[str], t0: float) -> None:
        self._stream = stream
        self._t0 = t0
        self._lock = threading.Lock()

    def note(self, at: float, text: str) -> None:
        self._write(_line(self._t0, at, text))

    def phase(self, at: float, engine: int, source: str, dest: str, reason: str) -> None:
        self._write(_line(self._t0, at, _phase_text(engine, source, dest, reason)))

    def snapshot(self, view: ClusterView) -> None:
        pass

    def close(self) -> None:
        self._stream.flush()

    def _write(self, text: str) -> None:
        with self._lock:
            print(text, file=self._stream, flush=True)


class RichReporter:
    """A live table of every engine's phase above the last ``keep`` events (a terminal)."""

    def __init__(self, console: Console, t0: float, *, keep: int = 14) -> None:
        self._console = console
        self._t0 = t0
        self._keep = keep
        self._lock = threading.Lock()
        self._lines: list[Text] = []
        self._view: ClusterView | None = None
        self._live = Live(self._render(), console=console, refresh_per_second=10, transient=False)
        self._live.start()

    def note(self, at: float, text: str) -> None:
        self._add(Text(_line(self._t0, at, text), style="bold"))

    def phase(self, at: float, engine: int, source: str, dest: str, reason: str) -> None:
        text = Text(_line(self._t0, at, _phase_text(engine, source, dest, reason)))
        text.stylize(PHASE_STYLE.get(dest, ""))
        self._add(text)

    def snapshot(self, view: ClusterView) -> None:
        with self._lock:
            self._view = view
            self._live.update(self._render())

    def close(self) -> None:
        with self._lock:
            if self._live.is_started:
                self._live.update(self._render())
                self._live.stop()

    def _add(self, text: Text) -> None:
        with self._lock:
            self._lines = [*self._lines, text][-self._keep :]
            self._live.update(self._render())

    def _render(self) -> Group:
        table = Table(title="engines", expand=False)
        for column in ("engine", "phase", "status", "epoch", "removed", "fault"):
            table.add_column(column)
        for engine in self._view.engines if self._view is not None else ():
            table.add_row(
                str(engine.id),
                Text(engine.phase, style=PHASE_STYLE.get(engine.phase, "")),
                engine.status.name,
                str(engine.epoch),
                str(sorted(engine.removed_ranks)),
                engine.fault_info or "",
            )
        return Group(table, *self._lines)


class Watcher:
    """Polls ``cluster`` every ``interval_s`` and forwards what is new to ``reporter``."""

    def __init__(self, cluster: Watchable, reporter: Reporter, *, interval_s: float = 0.05):
        self._cluster = cluster
        self._reporter = reporter
        self._interval_s = interval_s
        self._seen_phases: dict[int, int] = {}
        self._seen_events = 0
        self._lock = threading.Lock()  # poll() runs on the watcher thread and on demand
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ftengine-watcher", daemon=True)

    def start(self) -> Watcher:
        """Start polling (returns self)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Poll one last time, then stop."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.poll()

    def poll(self) -> None:
        """Forward everything new since the last poll, oldest first."""
        with self._lock:
            for _at, emit in sorted(self._news(), key=lambda item: item[0]):
                emit()
            self._reporter.snapshot(ClusterView.from_status(self._cluster.status()))

    def _news(self) -> list[tuple[float, Callable[[], None]]]:
        news: list[tuple[float, Callable[[], None]]] = []
        for engine, changes in self._cluster.phase_changes().items():
            for change in changes[self._seen_phases.get(engine, 0) :]:
                args = (change.at, engine, change.source, change.dest, change.reason)
                news.append((change.at, partial(self._reporter.phase, *args)))
            self._seen_phases[engine] = len(changes)
        events = self._cluster.events()
        for event in events[self._seen_events :]:
            if event.kind in ("exit", "fence"):
                text = f"supervisor: rank {event.rank} {event.kind}: {event.detail}"
                news.append((event.at, partial(self._reporter.note, event.at, text)))
        self._seen_events = len(events)
        return news

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.poll()
