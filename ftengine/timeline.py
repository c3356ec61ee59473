"""The record of one fault episode: its faults, decisions, phase entries and recovery steps,
each with monotonic timestamps (engine clock seconds).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs

from ftengine import recovery
from ftengine.backends.base import RepairReport
from ftengine.faults import Fault, Phase

# Backend action -> timeline step name, from the step table. ``detect`` is the time from the
# fault to its report.
STEP_OF_ACTION: Mapping[str, str] = MappingProxyType(
    {step.action: step.timeline for step in recovery.STEPS}
)
STEPS = ("detect", *STEP_OF_ACTION.values())


def fault_dict(fault: Fault) -> dict[str, object]:
    """JSON-able ``{"kind", "rank", "step", "info", "at"}``."""
    return {
        "kind": fault.kind.value,
        "rank": fault.rank,
        "step": fault.step,
        "info": fault.info,
        "at": fault.at,
    }


@attrs.frozen
class StepRecord:
    """One step of one attempt (0 = before any attempt). ``end`` is None while it runs."""

    name: str
    attempt: int
    start: float
    end: float | None = None
    error: str | None = None

    @property
    def seconds(self) -> float | None:
        """The step's duration, or None while it runs."""
        return None if self.end is None else self.end - self.start

    def to_dict(self) -> dict[str, object]:
        """JSON-able ``{"name", "attempt", "start", "end", "seconds", "ok", "error"}``."""
        return {
            "name": self.name,
            "attempt": self.attempt,
            "start": self.start,
            "end": self.end,
            "seconds": self.seconds,
            "ok": None if self.end is None else self.error is None,
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> StepRecord:
        """Read ``to_dict()``'s form back (a missing ``attempt`` is 0, ``end`` / ``error``
        None; the derived ``seconds`` / ``ok`` are ignored). Raises ``KeyError``,
        ``TypeError`` or ``ValueError`` for another shape."""
        end, error = raw.get("end"), raw.get("error")
        return cls(
            name=str(raw["name"]),
            attempt=int(raw.get("attempt") or 0),
            start=float(raw["start"]),
            end=None if end is None else float(end),
            error=None if error is None else str(error),
        )


@attrs.frozen
class Timeline:
    """One episode: from the first fault while serving to ``healthy`` or ``dead``."""

    episode: int
    faults: tuple[Fault, ...]
    phases: tuple[tuple[Phase, float, str], ...] = ()
    decisions: tuple[tuple[float, str], ...] = ()
    steps: tuple[StepRecord, ...] = ()
    repair: RepairReport | None = None

    @property
    def started(self) -> float:
        """When the episode's first fault was detected."""
        return self.faults[0].at

    @property
    def ended(self) -> float | None:
        """When the episode reached ``healthy`` or ``dead``; None while it runs."""
        last = self.phases[-1] if self.phases else None
        return last[1] if last and last[0] in (Phase.HEALTHY, Phase.DEAD) else None

    def step_seconds(self, name: str) -> float:
        """Total seconds spent in finished steps called ``name`` (all attempts)."""
        return sum(s.seconds or 0.0 for s in self.steps if s.name == name)

    def to_dict(self) -> dict[str, object]:
        """JSON-able form, as ``EngineStatus.to_dict()["timeline"]``."""
        return {
            "episode": self.episode,
            "fault": fault_dict(self.faults[0]),
            "faults": [fault_dict(f) for f in self.faults],
            "started": self.started,
            "ended": self.ended,
            "phases": [{"phase": p.value, "at": at, "reason": why} for p, at, why in self.phases],
            "decisions": [{"at": at, "decision": text} for at, text in self.decisions],
            "steps": [s.to_dict() for s in self.steps],
            "repair": None if self.repair is None else attrs.asdict(self.repair),
        }


class TimelineBuilder:
    """The engine's mutable log of the current episode; ``snapshot()`` freezes it."""

    def __init__(self, episode: int, fault: Fault, now: float) -> None:
        self._timeline = Timeline(episode, (fault,))
        self.end_step(self.begin_step("detect", 0, fault.at), now)

    def snapshot(self) -> Timeline:
        return self._timeline

    def add_fault(self, fault: Fault) -> None:
        self._timeline = attrs.evolve(self._timeline, faults=(*self._timeline.faults, fault))

    def add_phase(self, phase: Phase, at: float, reason: str) -> None:
        self._timeline = attrs.evolve(
            self._timeline, phases=(*self._timeline.phases, (phase, at, reason))
        )

    def add_decision(self, at: float, text: str) -> None:
        self._timeline = attrs.evolve(
            self._timeline, decisions=(*self._timeline.decisions, (at, text))
        )

    def set_repair(self, report: RepairReport) -> None:
        self._timeline = attrs.evolve(self._timeline, repair=report)

    def begin_step(self, name: str, attempt: int, at: float) -> int:
        """Open a step; returns its index for ``end_step`` (steps of threads interleave)."""
        self._timeline = attrs.evolve(
            self._timeline, steps=(*self._timeline.steps, StepRecord(name, attempt, at))
        )
        return len(self._timeline.steps) - 1

    def end_step(self, index: int, at: float, error: str | None = None) -> None:
        """Close step ``index`` at ``at``, failed with ``error`` if given."""
        steps = list(self._timeline.steps)
        steps[index] = attrs.evolve(steps[index], end=at, error=error)
        self._timeline = attrs.evolve(self._timeline, steps=tuple(steps))
