"""plan_rejoin / apply_rejoin: a returning rank gets its original experts back; survivors drop
the copies they grew for it (default) or keep them as standby (failure-aware); no survivor
slot is ever given an expert it does not hold (no reload)."""

from __future__ import annotations

import pytest
import torch

from ftengine.errors import PlacementError
from ftengine.placement.apply import apply_plan
from ftengine.placement.initial import failure_aware_placement
from ftengine.placement.maps import ExpertPlacement
from ftengine.placement.planner import plan_redistribution
from ftengine.placement.rejoin import apply_rejoin, grown_copies_for, plan_rejoin

pytestmark = pytest.mark.timeout(30)


def scaled_down(placement: ExpertPlacement, dead: set[int]) -> torch.Tensor:
    """Remove ``dead`` (cumulative); return the slot maps before (the originals)."""
    original = placement.physical_to_logical_map.clone()
    apply_plan(placement, plan_redistribution(placement, dead))
    return original


def survivors_slots(placement: ExpertPlacement, returning: set[int]) -> torch.Tensor:
    ranks = placement.slot_ranks()
    return torch.tensor([int(r) not in returning for r in ranks])


@pytest.mark.parametrize("grown", ["drop", "keep"])
def test_the_returning_rank_gets_its_original_experts_back(grown: str) -> None:
    # Ranks: 0 {0, 1}, 1 {2, 3}, 2 {4, 5}, 3 {0, 1}. Rank 1 dies: 2 and 3 are re-hosted.
    placement = ExpertPlacement.default(1, 6, 2, 4)
    original = scaled_down(placement, {1})
    during = placement.physical_to_logical_map.clone()
    plan = plan_rejoin(placement, {1}, original, grown=grown)  # type: ignore[arg-type]
    apply_rejoin(placement, plan)
    p2l = placement.physical_to_logical_map
    assert p2l[0, 2:4].tolist() == [2, 3]  # rank 1's original experts
    assert {m.logical_expert for m in plan.restored} == {2, 3}
    grown_slots = {(m.layer, m.slot) for m in plan.dropped + plan.kept}
    assert {m.logical_expert for m in plan.dropped + plan.kept} == {2, 3}
    assert len(grown_slots) == 2
    placement.validate(require_every_expert=True)
    survivors = survivors_slots(placement, {1})
    if grown == "drop":
        # The grown copies' slots are empty now (unrouted; free for the next repair).
        assert plan.kept == () and all(int(p2l[ly, s]) == -1 for ly, s in grown_slots)
        assert int(placement.logical_replica_count[0, 2]) == 1
    else:
        # Kept as standby: still routed, so experts 2 and 3 have two replicas each.
        assert plan.dropped == () and torch.equal(p2l[0, survivors], during[0, survivors])
        assert placement.logical_replica_count[0, 2:4].tolist() == [2, 2]
    # Survivors never get an expert they do not already hold: no reload.
    changed = (p2l != during) & survivors.unsqueeze(0)
    assert bool((p2l[changed] == -1).all())
    assert plan.survivor_reloads == 0


def test_storage_is_kept_and_a_stale_plan_is_refused() -> None:
    placement = ExpertPlacement.default(2, 8, 8, 4)
    original = scaled_down(placement, {2})
    pointers = [
        t.data_ptr()
        for t in (
            placement.physical_to_logical_map,
            placement.logical_to_physical_map,
            placement.logical_replica_count,
        )
    ]
    plan = plan_rejoin(placement, {2}, original)
    apply_rejoin(placement, plan)
    assert pointers == [
        t.data_ptr()
        for t in (
            placement.physical_to_logical_map,
            placement.logical_to_physical_map,
            placement.logical_replica_count,
        )
    ]
    with pytest.raises(PlacementError, match="different physical_to_logical_map"):
        apply_rejoin(placement, plan)


def test_only_a_removed_rank_can_return() -> None:
    placement = ExpertPlacement.default(1, 6, 2, 4)
    original = scaled_down(placement, {1})
    with pytest.raises(PlacementError, match="only removed ranks"):
        plan_rejoin(placement, {2}, original)
    with pytest.raises(PlacementError, match="does not match"):
        plan_rejoin(placement, {1}, original[:, :4])


def test_one_of_two_removed_ranks_returns_and_the_other_stays_covered() -> None:
    placement = ExpertPlacement.default(3, 16, 16, 8)
    original = placement.physical_to_logical_map.clone()
    apply_plan(placement, plan_redistribution(placement, {1}))
    apply_plan(placement, plan_redistribution(placement, {1, 5}))
    plan = plan_rejoin(placement, {1}, original)
    apply_rejoin(placement, plan)
    placement.validate(require_every_expert=True)
    p2l = placement.physical_to_logical_map
    assert torch.equal(p2l[:, 4:8], original[:, 4:8])  # rank 1 back as it was
    assert bool((p2l[:, 20:24] == -1).all())  # rank 5 still removed
    # Copies grown for rank 5 are not copies grown for rank 1: they stay.
    assert all(m.logical_expert in original[m.layer, 4:8].tolist() for m in plan.dropped)
    # A second cycle plans from the new maps: rank 1 dies again and comes back again.
    apply_plan(placement, plan_redistribution(placement, {1, 5}))
    apply_rejoin(placement, plan_rejoin(placement, {1}, original))
    placement.validate(require_every_expert=True)
    assert torch.equal(p2l[:, 4:8], original[:, 4:8])


def test_kept_standby_copies_make_the_same_failure_again_reload_nothing() -> None:
    assert grown_copies_for("failure-aware") == "keep"
    assert grown_copies_for("default") == "drop"
    reloads = {}
    for grown in ("drop", "keep"):
        placement = ExpertPlacement.default(1, 6, 2, 4)  # rank 1's experts 2, 3: no spare
        original = scaled_down(placement, {1})
        apply_rejoin(placement, plan_rejoin(placement, {1}, original, grown=grown))
        placement.validate(require_every_expert=True)
        reloads[grown] = plan_redistribution(placement, {1}).reloads
    assert reloads == {"drop": 2, "keep": 0}


def test_a_failure_aware_layout_grows_no_copy_for_one_dead_rank() -> None:
    placement = failure_aware_placement(2, 8, 8, 4, None)
    original = scaled_down(placement, {3})
    plan = plan_rejoin(placement, {3}, original, grown="keep")
    assert plan.kept == () and plan.dropped == ()
    apply_rejoin(placement, plan)
    assert torch.equal(placement.physical_to_logical_map, original)
