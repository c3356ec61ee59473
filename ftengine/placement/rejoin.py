"""The expert maps when removed EP ranks come back (``scale_up``): the returning ranks get
their original experts back, and the survivors drop the copies they grew for them, or keep
them as standby replicas (failure-aware placement).

Nothing here reloads on a survivor: a dropped copy's slot becomes empty (unrouted, free for
the next failure's repair), a kept one stays a live replica. The returning ranks' slots
hold exactly their original experts, which they loaded from disk at start-up. Like the
scale-down planner, the plan depends only on its inputs, so every rank computes the same one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import attrs
import torch

from ftengine.errors import PlacementError
from ftengine.placement.logical import EMPTY, slot_map_digest, write_logical_rows
from ftengine.placement.maps import ExpertPlacement
from ftengine.placement.plan import SlotMove
from ftengine.placement.ranks import check_ep_ranks
from ftengine.placement.threads import one_intra_op_thread

GrownCopies = Literal["drop", "keep"]
"""What survivors do with the copies they grew for a returning rank."""


def grown_copies_for(placement_name: str) -> GrownCopies:
    """``keep`` under failure-aware placement (the copies are the next failure's standby
    replicas), ``drop`` otherwise (the original layout and balance come back)."""
    return "keep" if placement_name == "failure-aware" else "drop"


@attrs.frozen
class RejoinPlan:
    """What an admission changes in the maps.

    ``restored``: the returning ranks' slots, set back to their original experts (no reload
    on a survivor; the returning rank loaded them at start-up). ``dropped``: survivors'
    slots whose copy grown for a returning rank becomes empty. ``kept``: such copies left
    as live (standby) replicas. ``source_digest`` fingerprints the slot map it was planned
    from, so a stale plan is never applied.
    """

    returning_ep_ranks: frozenset[int]
    restored: tuple[SlotMove, ...]
    dropped: tuple[SlotMove, ...]
    kept: tuple[SlotMove, ...]
    source_digest: str

    @property
    def survivor_reloads(self) -> int:
        """Weight loads on the survivors: always 0 (listed so a report can show it)."""
        return 0

    def local_assignments(self, ep_rank: int, local_slots: int) -> tuple[tuple[int, int, int], ...]:
        """``(layer, local slot, logical expert)`` a returning ``ep_rank`` must hold."""
        first = ep_rank * local_slots
        return tuple(
            (m.layer, m.slot - first, m.logical_expert)
            for m in self.restored
            if first <= m.slot < first + local_slots
        )


def plan_rejoin(
    placement: ExpertPlacement,
    returning_ep_ranks: Iterable[int],
    original: torch.Tensor,
    *,
    grown: GrownCopies = "drop",
) -> RejoinPlan:
    """Plan giving ``returning_ep_ranks`` (removed, so their slots are empty now) their slots
    of ``original`` (the slot map at start-up, ``[layers, num_physical]``) back.

    Raises ``PlacementError`` if a returning rank still holds an expert (it was not
    removed) or ``original`` has another shape.
    """
    p2l = placement.physical_to_logical_map
    if tuple(original.shape) != tuple(p2l.shape):
        raise PlacementError(
            f"original slot map {tuple(original.shape)} does not match the placement "
            f"{tuple(p2l.shape)}"
        )
    returning = check_ep_ranks(returning_ep_ranks, placement.ep_size)
    if not returning:
        raise PlacementError("plan_rejoin needs at least one returning EP rank")
    slots = placement.rank_slots(returning)
    original = original.to(p2l.device)
    held = p2l[:, slots] != EMPTY
    if bool(held.any()):
        where, index = (int(v) for v in held.nonzero()[0])
        raise PlacementError(
            f"EP rank {int(slots[index]) // placement.local_slots} holds expert "
            f"{int(p2l[where, slots[index]])} in layer {where}: only removed ranks (empty "
            "slots) can return"
        )
    with one_intra_op_thread():
        restored = _moves(slots, original[:, slots], placement.num_layers)
        grown_mask = _grown_for(placement, original, slots)
        layer, slot = grown_mask.nonzero(as_tuple=True)
        copies = tuple(
            SlotMove(*row) for row in torch.stack([layer, slot, p2l[layer, slot]], dim=1).tolist()
        )
    return RejoinPlan(
        returning_ep_ranks=returning,
        restored=restored,
        dropped=copies if grown == "drop" else (),
        kept=copies if grown == "keep" else (),
        source_digest=slot_map_digest(p2l),
    )


def _moves(slots: torch.Tensor, values: torch.Tensor, layers: int) -> tuple[SlotMove, ...]:
    grid_layer = torch.arange(layers).unsqueeze(1).expand_as(values)
    grid_slot = slots.unsqueeze(0).expand_as(values).to(values.device)
    keep = values != EMPTY
    table = torch.stack([grid_layer[keep], grid_slot[keep], values[keep]], dim=1)
    return tuple(SlotMove(*row) for row in table.tolist())


def _grown_for(
    placement: ExpertPlacement, original: torch.Tensor, returning_slots: torch.Tensor
) -> torch.Tensor:
    """bool ``[layers, num_physical]``: survivors' slots now holding, instead of their
    original expert, an expert that a returning rank originally hosts in that layer."""
    p2l = placement.physical_to_logical_map
    layers, num_logical = placement.num_layers, placement.num_logical
    hosted = torch.zeros(layers, num_logical + 1, dtype=torch.bool, device=p2l.device)
    back = original[:, returning_slots]
    hosted.scatter_(1, torch.where(back < 0, num_logical, back), True)
    hosted[:, num_logical] = False
    changed = (p2l != original) & (p2l != EMPTY)
    changed[:, returning_slots] = False
    current = torch.where(p2l < 0, num_logical, p2l)
    return changed & hosted.gather(1, current)


def apply_rejoin(placement: ExpertPlacement, plan: RejoinPlan) -> None:
    """Write ``plan`` into the maps in place (same storage): restored slots, dropped copies
    emptied, the touched logical rows rebuilt. Raises ``PlacementError`` before touching
    anything if the plan is stale or leaves an expert without a replica."""
    p2l = placement.physical_to_logical_map
    if slot_map_digest(p2l) != plan.source_digest:
        raise PlacementError(
            "rejoin plan was computed from a different physical_to_logical_map (already "
            "applied, or the maps changed since); plan again from the current placement"
        )
    with one_intra_op_thread():
        updated = p2l.clone()
        touched = torch.zeros(
            placement.num_layers, placement.num_logical, dtype=torch.bool, device=p2l.device
        )
        for move in plan.restored:
            updated[move.layer, move.slot] = move.logical_expert
            touched[move.layer, move.logical_expert] = True
        for move in plan.dropped:
            updated[move.layer, move.slot] = EMPTY
            touched[move.layer, move.logical_expert] = True
        empty = [
            (layer, expert)
            for layer, expert in touched.nonzero().tolist()
            if not bool((updated[layer] == expert).any())
        ]
        if empty:
            raise PlacementError(
                f"the rejoin plan leaves (layer, expert) {empty[:4]} without a replica"
            )
        write_logical_rows(
            updated, placement.logical_to_physical_map, placement.logical_replica_count, touched
        )
        p2l.copy_(updated)
