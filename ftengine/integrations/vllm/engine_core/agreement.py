"""When the engine cores' agents may recover on their own: a recovery the survivors run
together (a ``retry`` rebuilds the DP group with every member, a ``scale_down`` among the
survivors) starts only when every member's policy proposes the same one. Each agent
publishes its :class:`Proposal` on the DP board (``dp_board``); while the members disagree
(one has not seen the dead peer yet, their policies differ) nobody acts, and what never
agrees waits for an orchestrator, as vLLM PR #46370's ``auto_recovery`` proceeds only when
the survivors agree on a common mask.

Agreement among the survivors a proposal names is not enough for a ``scale_down``: a member
cut off from the others, or starved of CPU until their beats look stale, names itself the
only survivor and agrees with itself (with DP=2 both would, each removing the other). So a
``scale_down`` also needs its survivors to hold the majority of the ranks live before it
(:func:`holds_majority`, the partition rule's one definition, ``quorum.keeps_serving``):
a rank counts as gone only when proven dead (it published ``dead``, or its host answered
that its port is closed), never for a silence.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import attrs

from ftengine.integrations.vllm.engine_core.quorum import Sight, keeps_serving
from ftengine.policies import Retry, ScaleDown
from ftengine.validators import int_at_least, rank_set, to_ranks

Instruction = Literal["retry", "scale_down"]
INSTRUCTIONS: tuple[Instruction, ...] = ("retry", "scale_down")


@attrs.frozen
class Proposal:
    """A recovery for the survivors to run together: ``instruction`` with ``removed``, the
    original DP ranks removed once it ran (cumulative; for a retry, those removed already),
    proposed at DP-group ``epoch`` (the round: a member that has begun the recovery shows
    the next epoch already, and still proposes this). Its members are every other rank."""

    instruction: Instruction
    removed: frozenset[int] = attrs.field(
        default=frozenset(), converter=to_ranks, validator=rank_set()
    )
    epoch: int = attrs.field(default=0, validator=int_at_least(0))

    @classmethod
    def of(cls, decision: Retry | ScaleDown, removed: frozenset[int], epoch: int) -> Proposal:
        """What a policy's ``Retry`` / ``ScaleDown`` proposes at ``epoch``, ``removed``
        already removed."""
        if isinstance(decision, ScaleDown):
            return cls("scale_down", removed | decision.ranks, epoch)
        return cls("retry", removed, epoch)

    def members(self, world_size: int) -> frozenset[int]:
        """The ranks that run it: every original rank it does not remove."""
        return frozenset(range(world_size)) - self.removed

    def to_json(self) -> list[object]:
        return [self.instruction, sorted(self.removed), self.epoch]

    @classmethod
    def from_json(cls, raw: object) -> Proposal | None:
        """A peer's published proposal; None for none (or one this version cannot read)."""
        if not isinstance(raw, list) or len(raw) != 3 or raw[0] not in INSTRUCTIONS:
            return None
        ranks, epoch = raw[1], raw[2]
        if not isinstance(ranks, list) or not all(type(r) is int and r >= 0 for r in ranks):
            return None
        if type(epoch) is not int or epoch < 0:
            return None
        instruction: Instruction = "retry" if raw[0] == "retry" else "scale_down"
        return cls(instruction, frozenset(ranks), epoch)


@attrs.frozen
class PeerView:
    """What an agent knows of one peer: its status (``dead`` once its beat stopped) and its
    published proposal."""

    status: str
    proposal: Proposal | None = None


def agreed(proposal: Proposal, rank: int, world_size: int, peers: Mapping[int, PeerView]) -> bool:
    """Whether every other member of ``proposal`` (engine ``rank``'s) is ``unhealthy`` and
    proposes the same, in the same round (its epoch)."""
    others = proposal.members(world_size) - {rank}
    return all(
        (view := peers.get(member)) is not None
        and view.status == "unhealthy"
        and view.proposal == proposal
        for member in others
    )


def holds_majority(
    proposal: Proposal, rank: int, world_size: int, removed: frozenset[int], dead: frozenset[int]
) -> bool:
    """Whether engine ``rank`` may run ``proposal`` as far as the majority rule goes: a
    ``retry`` (every member rebuilds together) always; a ``scale_down`` when its survivors
    keep serving by ``quorum.keeps_serving`` among the ranks live before it (the original
    ranks not ``removed`` yet, less the ``dead`` proven)."""
    if proposal.instruction != "scale_down":
        return True
    members = frozenset(range(world_size)) - removed
    survivors = proposal.members(world_size)
    return keeps_serving(Sight(rank, members, survivors & members, dead & members))
