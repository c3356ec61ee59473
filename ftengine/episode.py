"""One fault episode's bookkeeping inside the engine: attempts, its latest fault, confirmed
dead ranks, and the timeline being written. An episode runs from a fault while serving to
healthy or dead."""

from __future__ import annotations

from collections.abc import Iterable

from ftengine.context import RecoveryContext, RedundancyFacts
from ftengine.faults import Fault, FaultKind, Phase
from ftengine.timeline import TimelineBuilder


class Episode:
    """Mutable; the engine's lock guards it."""

    __slots__ = ("_dead", "attempts", "last", "log", "number", "start")

    def __init__(self, number: int, fault: Fault, now: float) -> None:
        self.number = number
        self.start = fault.at
        self.attempts = 0
        self.last = fault
        self.log = TimelineBuilder(number, fault, now)
        self._dead: set[int] = set()
        self._note_dead(fault)

    def add_fault(self, fault: Fault) -> None:
        """Record a later fault of the same episode."""
        self.last = fault
        self.log.add_fault(fault)
        self._note_dead(fault)

    def start_attempt(self) -> int:
        """Count one more recovery run; returns its number (1 for the first)."""
        self.attempts += 1
        return self.attempts

    def dead_ranks(self, removed: frozenset[int]) -> frozenset[int]:
        """Ranks confirmed dead in this episode that are not yet removed."""
        return frozenset(self._dead) - removed

    def context(
        self,
        fault: Fault,
        phase: Phase,
        now: float,
        history: Iterable[Fault],
        removed: frozenset[int],
        *,
        rank: int,
        world_size: int,
        epoch: int = 0,
        redundancy: RedundancyFacts | None = None,
    ) -> RecoveryContext:
        """What a policy sees of ``fault`` (arrived in ``phase``) at ``now``: this episode's
        start, attempts and dead ranks (less ``removed``), and the fault ``history``. The
        one definition both deciders use: a worker's ``RecoveryEngine`` and vLLM's
        engine-core agent."""
        return RecoveryContext(
            fault=fault,
            phase=phase,
            now=now,
            episode_start=self.start,
            attempts=self.attempts,
            faults=tuple(history),
            dead_ranks=self.dead_ranks(removed),
            removed_ranks=removed,
            rank=rank,
            world_size=world_size,
            epoch=epoch,
            redundancy=redundancy,
        )

    def _note_dead(self, fault: Fault) -> None:
        if fault.kind is FaultKind.DEAD_PEER and fault.rank is not None:
            self._dead.add(fault.rank)
