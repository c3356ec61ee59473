"""The redistribution planner: which (layer, logical expert) goes into which surviving slot.

Deterministic (same inputs give a byte-identical plan, so every survivor computes it alone),
minimal (one reload per expert left without a live replica, the lower bound) and balanced
(spare slots and orphan homes chosen for per-rank load balance). An optional budget of
extra reloads buys more balance.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ftengine.errors import PlacementError, PreconditionFailed
from ftengine.placement.apply import apply_plan
from ftengine.placement.improve import improve_balance
from ftengine.placement.loads import normalize_load
from ftengine.placement.maps import ExpertPlacement, slot_map_digest
from ftengine.placement.minimal import PlanState, minimal_plan
from ftengine.placement.plan import RedistributionPlan, SlotMove
from ftengine.placement.ranks import check_ep_ranks
from ftengine.placement.scoring import replica_counts
from ftengine.placement.threads import one_intra_op_thread


def plan_redistribution(
    placement: ExpertPlacement,
    dead_ep_ranks: Iterable[int],
    *,
    load: torch.Tensor | None = None,
    extra_reloads: int = 0,
) -> RedistributionPlan:
    """Plan the scale-down to the cumulative ``dead_ep_ranks`` (original EP ranks).

    ``load`` is per-expert load ``[layers, num_logical]`` (or ``[num_logical]``; default
    uniform). ``extra_reloads`` lets the plan reload up to that many more (layer, expert)
    replicas than the lower bound when that improves balance. Raises ``PreconditionFailed``
    when the survivors cannot hold every expert or the dead set is invalid.
    """
    dead = check_ep_ranks(dead_ep_ranks, placement.ep_size)
    _check_redundancy(placement, dead)
    if extra_reloads < 0:
        raise PreconditionFailed(f"extra_reloads must be >= 0, got {extra_reloads}")
    loads = normalize_load(load, placement.num_layers, placement.num_logical)
    with one_intra_op_thread():
        return _plan(placement, dead, loads, extra_reloads)


def _plan(
    placement: ExpertPlacement, dead: frozenset[int], loads: torch.Tensor, extra_reloads: int
) -> RedistributionPlan:
    live = torch.ones(placement.num_physical, dtype=torch.bool)
    live[placement.rank_slots(dead)] = False
    p2l = placement.physical_to_logical_map
    state = PlanState.start(
        p2l,
        live,
        loads,
        local_slots=placement.local_slots,
        max_replicas=placement.max_replicas,
    )
    _check_not_removed_before(state, dead)
    lower_bound = minimal_plan(state)
    improve_balance(state, extra_reloads, lower_bound)
    _check_complete(state)
    layer, slot = state.changed().nonzero(as_tuple=True)
    table = torch.stack([layer, slot, state.slots[layer, slot]], dim=1)
    moves = tuple(SlotMove(*row) for row in table.tolist())
    return RedistributionPlan(
        dead_ep_ranks=dead,
        moves=moves,
        lower_bound=lower_bound,
        num_layers=placement.num_layers,
        num_physical=placement.num_physical,
        local_slots=placement.local_slots,
        source_digest=slot_map_digest(p2l),
        table=table,
    )


def _check_redundancy(placement: ExpertPlacement, dead: frozenset[int]) -> None:
    survivors = placement.ep_size - len(dead)
    capacity = survivors * placement.local_slots
    if capacity < placement.num_logical:
        raise PreconditionFailed(
            f"insufficient redundancy: (ep_size {placement.ep_size} - dead {len(dead)}) * "
            f"local_slots {placement.local_slots} = {capacity} < num_logical "
            f"{placement.num_logical}; the survivors cannot hold one replica of every expert"
        )


def _check_not_removed_before(state: PlanState, dead: frozenset[int]) -> None:
    """A live rank with no expert at all was removed before: the dead set must be cumulative."""
    per_rank = (state.slots >= 0).view(state.slots.shape[0], -1, state.local_slots)
    bare = ~per_rank.any(dim=2).any(dim=0)
    missing = sorted(r for r in bare.nonzero().flatten().tolist() if r not in dead)
    if missing:
        raise PreconditionFailed(
            f"EP ranks {missing} hold no expert in any layer, as if removed by an earlier "
            f"scale-down, but are not in the dead set {sorted(dead)}; pass the cumulative "
            "dead set (every rank removed so far)"
        )


def _check_complete(state: PlanState) -> None:
    """Guard against a planner bug: the counts must match the slots and cover every expert."""
    recount = replica_counts(state.slots, state.counts.shape[1])
    if not torch.equal(recount, state.counts) or bool((recount == 0).any()):
        raise PlacementError(
            "internal planner error: the planned slot map leaves an expert without a replica "
            "or disagrees with its replica counts; please report this with the inputs"
        )


__all__ = [
    "RedistributionPlan",
    "SlotMove",
    "apply_plan",
    "plan_redistribution",
]
