"""Apply a redistribution plan to the live expert maps, in place (same storage)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftengine.errors import PlacementError
from ftengine.placement.maps import EMPTY, ExpertPlacement, derive_logical_maps, slot_map_digest
from ftengine.placement.threads import one_intra_op_thread

if TYPE_CHECKING:
    from ftengine.placement.planner import RedistributionPlan


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
        p2l.index_fill_(1, dead_slots, EMPTY)
        table = plan.table.to(p2l.device)
        p2l[table[:, 0], table[:, 1]] = table[:, 2]
        l2p, counts = derive_logical_maps(p2l, placement.num_logical, placement.max_replicas)
        placement.logical_to_physical_map.copy_(l2p)
        placement.logical_replica_count.copy_(counts)
