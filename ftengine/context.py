"""What a policy sees: one immutable ``RecoveryContext`` per decision about a fault, one
``AdmissionContext`` per question about ready removed ranks, and ``RedundancyFacts``.

Policies read only this object; the engine builds a fresh one for every decision
(derive variants with ``attrs.evolve``).
"""

from __future__ import annotations

import attrs

from ftengine.errors import ConfigError
from ftengine.faults import Fault, Phase
from ftengine.validators import finite_float, int_at_least, rank_set, to_ranks


@attrs.frozen
class RedundancyFacts:
    """How many experts the EP group can lose and still host every logical expert.

    ``ep_size``: EP ranks at start (DP size x ``tp_size``); ``local_slots``: expert slots
    per EP rank (physical experts / ``ep_size``); ``num_logical``: the model's experts.
    """

    ep_size: int = attrs.field(validator=int_at_least(1))
    local_slots: int = attrs.field(validator=int_at_least(1))
    num_logical: int = attrs.field(validator=int_at_least(1))
    tp_size: int = attrs.field(default=1, validator=int_at_least(1))

    def __attrs_post_init__(self) -> None:
        if self.ep_size % self.tp_size:
            raise ConfigError(
                f"ep_size ({self.ep_size}) must be a multiple of tp_size ({self.tp_size}): "
                "EP rank = DP rank x TP + t"
            )
        if self.ep_size * self.local_slots < self.num_logical:
            raise ConfigError(
                f"{self.ep_size} EP ranks x {self.local_slots} slots cannot host "
                f"{self.num_logical} logical experts even with no rank dead"
            )

    def surviving_slots(self, dead_dp_ranks: frozenset[int]) -> int:
        """Expert slots left on the EP ranks of the survivors of ``dead_dp_ranks``."""
        return max(0, self.ep_size - len(dead_dp_ranks) * self.tp_size) * self.local_slots

    def survives(self, dead_dp_ranks: frozenset[int]) -> bool:
        """``(ep - dead_ep) * local_slots >= num_logical`` with ``dead_dp_ranks`` cumulative."""
        return self.surviving_slots(dead_dp_ranks) >= self.num_logical


@attrs.frozen
class RecoveryContext:
    """Everything a policy may read about one fault, at one instant.

    ``phase`` is the phase the fault arrived in (``retrying`` / ``scaling_down`` mean a
    fault during recovery). Times are monotonic seconds of the engine's clock.
    ``attempts`` counts recoveries started in this episode (an episode runs from the
    first fault while serving to healthy or dead). ``faults`` is the recent fault
    history, oldest first, including ``fault``. ``dead_ranks`` are DP ranks confirmed
    dead in this episode and not yet removed; ``removed_ranks`` are cumulative.
    """

    fault: Fault
    phase: Phase
    now: float = attrs.field(validator=finite_float())
    episode_start: float = attrs.field(validator=finite_float())
    attempts: int = attrs.field(default=0, validator=int_at_least(0))
    faults: tuple[Fault, ...] = ()
    dead_ranks: frozenset[int] = attrs.field(
        default=frozenset(), converter=to_ranks, validator=rank_set()
    )
    removed_ranks: frozenset[int] = attrs.field(
        default=frozenset(), converter=to_ranks, validator=rank_set()
    )
    rank: int = attrs.field(default=0, validator=int_at_least(0))
    world_size: int = attrs.field(default=1, validator=int_at_least(1))
    epoch: int = attrs.field(default=0, validator=int_at_least(0))
    redundancy: RedundancyFacts | None = None

    @property
    def elapsed(self) -> float:
        """Seconds since the episode began."""
        return self.now - self.episode_start

    @property
    def in_recovery(self) -> bool:
        """The fault arrived while a retry or a scale-down was running."""
        return self.phase.recovering

    def redundancy_allows(self, dead_dp_ranks: frozenset[int]) -> bool:
        """Whether the EP group can lose ``dead_dp_ranks`` (cumulative); True when unknown."""
        return self.redundancy is None or self.redundancy.survives(dead_dp_ranks)

    def faults_of(self, rank: int | None, *, since: float) -> tuple[Fault, ...]:
        """Faults in the history that point at ``rank`` and happened at or after ``since``."""
        return tuple(f for f in self.faults if f.rank == rank and f.at >= since)


@attrs.frozen
class AdmissionContext:
    """What a policy's ``admit`` may read: removed ranks that reported ready to come back.

    ``ready_ranks`` are removed ranks whose returning worker loaded its weights and waits
    (as the host reported them); ``removed_ranks`` the cumulative removed set; ``now``
    the engine clock (monotonic s).
    """

    ready_ranks: frozenset[int] = attrs.field(converter=to_ranks, validator=rank_set())
    removed_ranks: frozenset[int] = attrs.field(converter=to_ranks, validator=rank_set())
    now: float = attrs.field(validator=finite_float())
    rank: int = attrs.field(default=0, validator=int_at_least(0))
    world_size: int = attrs.field(default=1, validator=int_at_least(1))
    epoch: int = attrs.field(default=0, validator=int_at_least(0))
    redundancy: RedundancyFacts | None = None
