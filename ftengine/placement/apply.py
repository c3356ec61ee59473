"""Apply a redistribution plan to the live expert maps, in place (same storage)."""

from __future__ import annotations

import torch

from ftengine.errors import PlacementError
from ftengine.placement.maps import EMPTY, ExpertPlacement, slot_map_digest, write_logical_rows
from ftengine.placement.plan import RedistributionPlan
from ftengine.placement.threads import one_intra_op_thread


def apply_plan(placement: ExpertPlacement, plan: RedistributionPlan) -> None:
    """Empty the dead ranks' slots, write the moves, rebuild the logical maps in place.

    Every tensor keeps its storage (``data_ptr`` unchanged) because per-layer views of
    them are held by the model. Raises ``PlacementError`` before touching anything if the
    plan was computed for another shape or another slot map (a stale plan).
    """
    shape = (placement.num_layers, placement.num_physical, placement.local_slots)
    if shape != (plan.num_layers, plan.num_physical, plan.local_slots):
        raise PlacementError(
            f"plan is for (layers, num_physical, local_slots) = "
            f"{(plan.num_layers, plan.num_physical, plan.local_slots)}, placement has {shape}"
        )
    p2l = placement.physical_to_logical_map
    if slot_map_digest(p2l) != plan.source_digest:
        raise PlacementError(
            "plan was computed from a different physical_to_logical_map (already applied, or "
            "the maps changed since); plan again from the current placement"
        )
    with one_intra_op_thread():
        dead_slots = placement.rank_slots(plan.dead_ep_ranks).to(p2l.device)
        table = plan.table.to(p2l.device)
        touched = _touched_rows(placement, dead_slots, table)
        updated = p2l.clone()
        updated.index_fill_(1, dead_slots, EMPTY)
        updated[table[:, 0], table[:, 1]] = table[:, 2]
        # Checks every row fits before writing anything; only then the slot map changes.
        write_logical_rows(
            updated, placement.logical_to_physical_map, placement.logical_replica_count, touched
        )
        p2l.copy_(updated)


def _touched_rows(
    placement: ExpertPlacement, dead_slots: torch.Tensor, table: torch.Tensor
) -> torch.Tensor:
    """bool ``[layers, num_logical]``: experts that lose or gain a slot in this plan."""
    p2l = placement.physical_to_logical_map
    layers = placement.num_layers
    touched = torch.zeros(layers, placement.num_logical + 1, dtype=torch.bool, device=p2l.device)
    lost = p2l[:, dead_slots]
    touched.scatter_(1, torch.where(lost < 0, placement.num_logical, lost), True)
    replaced = p2l[table[:, 0], table[:, 1]]
    touched[table[:, 0], torch.where(replaced < 0, placement.num_logical, replaced)] = True
    touched[table[:, 0], table[:, 2]] = True
    return touched[:, : placement.num_logical]
