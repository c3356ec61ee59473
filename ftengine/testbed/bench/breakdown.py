"""The phase breakdown of one recovery: how long detection, quarantine, the orchestrator's
decision, each recovery step and the first correct token took, from the survivors' episodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from ftengine.faults import Phase
from ftengine.testbed.control.snapshot import Episode

# Recovery steps in the order the engine runs them (ftengine.timeline.STEP_OF_ACTION).
_STEPS = (
    ("quarantine", "quarantine"),
    ("device_reset", "device reset"),
    ("mask", "mask dead ranks"),
    ("comm_rebuild", "comm rebuild"),
    ("expert_repair", "expert repair"),
    ("validate", "validate"),
)


@attrs.frozen
class BreakdownRow:
    """One row: ``start_s`` is seconds after the fault, ``seconds`` the row's duration (the
    span from the earliest survivor starting it to the last one finishing it)."""

    name: str
    start_s: float
    seconds: float

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "start_s": self.start_s, "seconds": self.seconds}


def breakdown(
    episodes: Sequence[Episode], *, fault_at: float, first_correct_at: float | None
) -> list[BreakdownRow]:
    """Rows for the survivors' ``episodes`` of one fault injected at ``fault_at`` (monotonic s).

    ``first_correct_at`` is when the first correct answer arrived after recovery (None if
    none did). Steps no survivor ran are left out.
    """
    if not episodes:
        return []
    detected = min(episode.started for episode in episodes)
    rows = [BreakdownRow("detect", 0.0, detected - fault_at)]
    for key, label in _STEPS:
        span = _span(episodes, key)
        if span is not None:
            rows.append(BreakdownRow(label, span[0] - fault_at, span[1] - span[0]))
        if key == "quarantine":
            decided = _decision_at(episodes)
            if decided is not None and span is not None:
                rows.append(BreakdownRow("decide / command", span[1] - fault_at, decided - span[1]))
    ended = [episode.ended for episode in episodes if episode.ended is not None]
    if first_correct_at is not None and len(ended) == len(episodes):
        recovered = max(ended)
        rows.append(
            BreakdownRow("first correct token", recovered - fault_at, first_correct_at - recovered)
        )
    return rows


def interruption_s(fault_at: float, first_correct_at: float | None) -> float | None:
    """Seconds from the fault to the first correct answer after it."""
    return None if first_correct_at is None else first_correct_at - fault_at


def _span(episodes: Sequence[Episode], name: str) -> tuple[float, float] | None:
    steps = [s for e in episodes for s in e.steps if s.name == name and s.end is not None]
    if not steps:
        return None
    return min(s.start for s in steps), max(s.end for s in steps if s.end is not None)


def _decision_at(episodes: Sequence[Episode]) -> float | None:
    """When the last survivor entered its final recovery phase (retrying / scaling_down)."""
    starts = []
    for episode in episodes:
        actions = [m.at for m in episode.phases if Phase(m.dest).recovering]
        if actions:
            starts.append(actions[-1])
    return max(starts) if starts else None
