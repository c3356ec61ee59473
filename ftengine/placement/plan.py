"""A scale-down's redistribution plan as data: the slot moves, their lower bound and the
fingerprint of the slot map they were computed from (made by ``planner``, applied by ``apply``).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import attrs
import torch


class SlotMove(NamedTuple):
    """Load ``logical_expert`` into global slot ``slot`` of MoE layer ``layer``.

    A NamedTuple rather than an attrs class: a plan builds thousands of them on the
    recovery path, and tuple construction is several times cheaper.
    """

    layer: int
    slot: int
    logical_expert: int


@attrs.frozen
class RedistributionPlan:
    """What a scale-down changes in the expert maps.

    ``moves`` are sorted by (layer, slot); every one is a reload from disk. Slots of
    ``dead_ep_ranks`` become empty (-1). ``lower_bound`` counts the (layer, expert) pairs
    left without a live replica: no plan can reload fewer. ``source_digest`` fingerprints
    the slot map the plan was computed from, so a stale plan is never applied.
    ``table`` holds the moves as int64 ``[reloads, 3]`` (layer, slot, expert).
    """

    dead_ep_ranks: frozenset[int]
    moves: tuple[SlotMove, ...]
    lower_bound: int
    num_layers: int
    num_physical: int
    local_slots: int
    source_digest: str
    table: torch.Tensor = attrs.field(eq=False, repr=False)

    @property
    def reloads(self) -> int:
        """(layer, slot) weight loads the plan needs."""
        return len(self.moves)

    def digest(self) -> str:
        """A hex fingerprint of the plan; survivors may compare it to prove they agree."""
        hasher = hashlib.sha256(repr(sorted(self.dead_ep_ranks)).encode())
        hasher.update(self.source_digest.encode())
        hasher.update(self.table.numpy().tobytes())
        return hasher.hexdigest()

    def local_assignments(self, ep_rank: int) -> tuple[tuple[int, int, int], ...]:
        """``(layer, local_slot, logical_expert)`` loads for one EP rank's own slots."""
        first = ep_rank * self.local_slots
        return tuple(
            (move.layer, move.slot - first, move.logical_expert)
            for move in self.moves
            if first <= move.slot < first + self.local_slots
        )
