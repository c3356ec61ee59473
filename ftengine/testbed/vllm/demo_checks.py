"""The vLLM demo's timeline and verdict: a thread that turns each change of an engine's
``/fault_tolerance/status`` into a reporter line (the CPU demo's reporters), the streamed
completions it records, and the checks the scenario must pass (pure, unit-tested)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import attrs
import httpx

from ftengine.testbed.bench.live import Reporter
from ftengine.testbed.bench.scenario import Check
from ftengine.testbed.bench.traffic import Sample

Statuses = Callable[[], dict[int, str]]
"""Every engine's vLLM status (``healthy`` / ``unhealthy`` / ``dead``) by DP rank."""


@attrs.frozen
class Change:
    """Engine ``engine`` went from ``source`` to ``dest`` at ``at`` (monotonic seconds)."""

    at: float
    engine: int
    source: str
    dest: str


class StatusWatcher:
    """Polls ``statuses`` every ``interval_s``; reports and records every change."""

    def __init__(self, statuses: Statuses, reporter: Reporter, *, interval_s: float = 0.05):
        self._statuses = statuses
        self._reporter = reporter
        self._interval_s = interval_s
        self._last: dict[int, str] = {}
        self.changes: list[Change] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="ftengine-vllm-watch", daemon=True)

    def start(self) -> StatusWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def poll(self) -> None:
        """Report what changed since the last poll (a server that does not answer is skipped:
        the victim's may be busy dying)."""
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            self.saw(self._statuses())

    def saw(self, now: Mapping[int, str]) -> None:
        """Record the statuses someone else read just now (the scenario's own waits): a
        poll that waits on a dying rank's server can miss a survivor's short ``unhealthy``
        (seen in CI: the survivor was healthy again before the next poll answered)."""
        at = time.monotonic()
        with self._lock:
            for engine, status in sorted(now.items()):
                before = self._last.get(engine, "")
                if status != before:
                    self.changes.append(Change(at, engine, before or "-", status))
                    self._reporter.phase(at, engine, before or "-", status, "")
            self._last.update(now)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self._interval_s)


def first_at(changes: Sequence[Change], engine: int, dest: str, after: float) -> float | None:
    """When ``engine`` first became ``dest`` after ``after``, if it did."""
    return next((c.at for c in changes if c.engine == engine and c.dest == dest and c.at >= after),
                None)  # fmt: skip


@attrs.frozen
class Outcome:
    """What the scenario saw: ``killed_at`` the SIGKILL, ``applied`` each survivor's HTTP
    code for ``scale_down``, ``before`` / ``after`` each survivor's greedy answer, the
    streamed completions' ``traffic``."""

    victim: int
    survivors: tuple[int, ...]
    killed_at: float
    changes: tuple[Change, ...]
    applied: Mapping[int, int]
    before: Mapping[int, str]
    after: Mapping[int, str]
    traffic: Mapping[str, Mapping[str, int]] = attrs.field(factory=dict)
    """:func:`tally` of the streamed completions (every rank's, the victim's included)."""


def checks(outcome: Outcome) -> tuple[Check, ...]:
    """Every check of the scenario, in its order; the verdict is that all hold."""
    o, at = outcome, outcome.killed_at
    unhealthy = {r: first_at(o.changes, r, "unhealthy", at) for r in o.survivors}
    dead = first_at(o.changes, o.victim, "dead", at)
    healthy = {r: first_at(o.changes, r, "healthy", unhealthy[r] or at) for r in o.survivors}
    # vLLM answers 202 Accepted and runs the command in the background; a refusal is 4xx
    codes_ok = all(200 <= code < 300 for code in o.applied.values())
    accepted = codes_ok and set(o.applied) == set(o.survivors)
    return (
        Check("survivors became unhealthy", all(unhealthy.values()), _since(at, unhealthy)),
        Check(f"victim rank {o.victim} reported dead", dead is not None,
              _since(at, {o.victim: dead})),
        Check("scale_down accepted by every survivor", accepted, f"HTTP {dict(o.applied)}"),
        Check("survivors healthy again", all(healthy.values()), _since(at, healthy)),
        Check("answers after the scale-down equal those before the fault",
              bool(o.survivors) and all(o.after.get(r) == o.before[r] for r in o.survivors),
              f"before {dict(o.before)} after {dict(o.after)}"),
        Check("no request lost through the kill: every completion streamed, the victim's too, "
              "answered correctly", lost(o.traffic) == 0, f"{dict(o.traffic)}"),
    )  # fmt: skip


def lost(traffic: Mapping[str, Mapping[str, int]]) -> int:
    """Completions of :func:`tally` that failed or answered wrong; -1 when the kill saw no
    traffic on either side (nothing shown is not "nothing lost")."""
    if not all(traffic.get(side, {}).get("correct") for side in ("before_kill", "after_kill")):
        return -1
    return sum(side.get("failed", 0) + side.get("wrong", 0) for side in traffic.values())


def _since(start: float, when: Mapping[int, float | None]) -> str:
    shown = {r: "never" if t is None else f"+{t - start:.2f} s" for r, t in when.items()}
    return ", ".join(f"rank {r}: {text}" for r, text in shown.items())


def tally(samples: Sequence[Sample], killed_at: float) -> dict[str, dict[str, int]]:
    """The streamed completions started before and after the kill: correct, wrong, failed."""
    tally: dict[str, dict[str, int]] = {}
    for sample in samples:
        side = tally.setdefault("before_kill" if sample.start < killed_at else "after_kill",
                                {"correct": 0, "wrong": 0, "failed": 0})  # fmt: skip
        kind = "correct" if sample.correct else "failed" if sample.error else "wrong"
        side[kind] += 1
    return tally
