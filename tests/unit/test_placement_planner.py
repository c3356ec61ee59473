"""The redistribution planner and apply_plan on small, hand-checkable placements."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import ftengine.placement.apply as apply_module
import ftengine.placement.planner as planner_module
from ftengine.errors import PlacementError, PreconditionFailed
from ftengine.placement.apply import apply_plan
from ftengine.placement.initial import balanced_placement
from ftengine.placement.loads import zipf_load
from ftengine.placement.maps import ExpertPlacement
from ftengine.placement.planner import SlotMove, plan_redistribution
from ftengine.placement.rebalance import fresh_rebalance
from ftengine.placement.scoring import balancedness


def test_orphans_of_a_dead_rank_land_on_survivors_balanced() -> None:
    # Ranks: 0 {0, 1}, 1 {2, 3}, 2 {4, 5}, 3 {0, 1}. Rank 1 dies: experts 2 and 3 are orphans.
    placement = ExpertPlacement.default(1, 6, 2, 4)
    plan = plan_redistribution(placement, {1})
    assert plan.lower_bound == plan.reloads == 2
    assert {move.logical_expert for move in plan.moves} == {2, 3}
    assert all(move.slot // 2 != 1 for move in plan.moves)
    apply_plan(placement, plan)
    assert placement.physical_to_logical_map[0, 2:4].tolist() == [-1, -1]
    placement.validate(require_every_expert=True)
    ones = torch.ones(1, 6)
    p2l = placement.physical_to_logical_map
    assert balancedness(p2l, ones, num_logical=6, local_slots=2, dead_ep_ranks={1}) == 1.0


def test_equally_good_donors_spread_the_reloads_over_the_survivors() -> None:
    # Ranks 0 and 2 hold experts 0-7, ranks 1 and 3 hold 8-15: with 1 and 3 dead, any slot
    # of 0 or 2 can take an orphan, and the repair lasts as long as the busiest reload.
    placement = ExpertPlacement.default(4, 16, 16, 4)
    plan = plan_redistribution(placement, {1, 3})
    assert plan.reloads == plan.lower_bound == 32
    assert [len(plan.local_assignments(rank)) for rank in (0, 2)] == [16, 16]
    apply_plan(placement, plan)
    p2l = placement.physical_to_logical_map
    ones = torch.ones(4, 16)
    assert balancedness(p2l, ones, num_logical=16, local_slots=8, dead_ep_ranks={1, 3}) == 1.0


def test_moves_are_sorted_and_mirrored_in_the_table() -> None:
    placement = ExpertPlacement.default(3, 6, 2, 4)
    plan = plan_redistribution(placement, {1})
    assert list(plan.moves) == sorted(plan.moves)
    assert [tuple(move) for move in plan.moves] == [tuple(row) for row in plan.table.tolist()]
    assert isinstance(plan.moves[0], SlotMove)


def test_local_assignments_use_local_slot_numbers() -> None:
    placement = ExpertPlacement.default(2, 6, 2, 4)
    plan = plan_redistribution(placement, {1})
    everyone = [
        (layer, rank * 2 + local, expert)
        for rank in range(4)
        for layer, local, expert in plan.local_assignments(rank)
    ]
    assert sorted(everyone) == [tuple(move) for move in plan.moves]
    assert plan.local_assignments(1) == ()


def test_nothing_dead_means_nothing_to_do() -> None:
    placement = ExpertPlacement.default(2, 6, 2, 4)
    plan = plan_redistribution(placement, set())
    assert plan.reloads == plan.lower_bound == 0
    apply_plan(placement, plan)
    assert placement.physical_to_logical_map.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1]] * 2


def test_insufficient_redundancy_is_refused_with_the_numbers() -> None:
    placement = ExpertPlacement.default(1, 6, 0, 3)
    with pytest.raises(PreconditionFailed, match=r"\(ep_size 3 - dead 1\) \* local_slots 2 = 4"):
        plan_redistribution(placement, {1})


def test_bad_dead_sets_and_budgets_are_refused() -> None:
    placement = ExpertPlacement.default(1, 6, 2, 4)
    with pytest.raises(PreconditionFailed, match="out of range"):
        plan_redistribution(placement, {4})
    with pytest.raises(PreconditionFailed, match="all 4 EP ranks are dead"):
        plan_redistribution(placement, {0, 1, 2, 3})
    with pytest.raises(PreconditionFailed, match="extra_reloads"):
        plan_redistribution(placement, {1}, extra_reloads=-1)


def test_the_dead_set_must_be_cumulative() -> None:
    placement = ExpertPlacement.default(1, 4, 4, 4)
    apply_plan(placement, plan_redistribution(placement, {1}))
    with pytest.raises(PreconditionFailed, match=r"EP ranks \[1\] hold no expert"):
        plan_redistribution(placement, {2})
    plan = plan_redistribution(placement, {1, 2})
    apply_plan(placement, plan)
    placement.validate(require_every_expert=True)


def test_a_stale_plan_is_not_applied() -> None:
    placement = ExpertPlacement.default(1, 6, 2, 4)
    plan = plan_redistribution(placement, {1})
    apply_plan(placement, plan)
    snapshot = placement.physical_to_logical_map.clone()
    with pytest.raises(PlacementError, match="different physical_to_logical_map"):
        apply_plan(placement, plan)
    assert torch.equal(placement.physical_to_logical_map, snapshot)


def test_a_plan_for_another_shape_is_not_applied() -> None:
    plan = plan_redistribution(ExpertPlacement.default(1, 6, 2, 4), {1})
    with pytest.raises(PlacementError, match="plan is for"):
        apply_plan(ExpertPlacement.default(2, 6, 2, 4), plan)


def test_load_shape_is_checked() -> None:
    placement = ExpertPlacement.default(2, 6, 2, 4)
    with pytest.raises(PlacementError, match=r"expected expert load \[2, 6\]"):
        plan_redistribution(placement, {1}, load=torch.ones(3, 6))
    with pytest.raises(PlacementError, match="non-negative"):
        plan_redistribution(placement, {1}, load=-torch.ones(6))


def test_extra_reloads_buy_balance_within_budget() -> None:
    load = zipf_load(2, 16, seed=0, top_k=2, tokens=512)
    placement = balanced_placement(2, 16, 8, 6, load)

    def after(extra: int) -> tuple[int, float]:
        copy = placement.clone()
        plan = plan_redistribution(copy, {1}, load=load, extra_reloads=extra)
        apply_plan(copy, plan)
        copy.validate(require_every_expert=True)
        p2l = copy.physical_to_logical_map
        value = balancedness(p2l, load, num_logical=16, local_slots=4, dead_ep_ranks={1})
        return plan.reloads, value

    minimal_reloads, minimal_balance = after(0)
    budget_reloads, budget_balance = after(4)
    assert minimal_reloads == 3
    assert minimal_reloads < budget_reloads <= minimal_reloads + 4
    assert budget_balance > minimal_balance + 0.05
    fresh_p2l, fresh_reloads = fresh_rebalance(placement, {1}, load)
    fresh = balancedness(fresh_p2l, load, num_logical=16, local_slots=4, dead_ep_ranks={1})
    assert fresh_reloads > budget_reloads
    assert budget_balance >= 0.95 * fresh


def test_plans_agree_bit_for_bit() -> None:
    load = zipf_load(3, 16, seed=1, top_k=2, tokens=512)
    placement = balanced_placement(3, 16, 8, 6, load)
    first = plan_redistribution(placement, {2, 4}, load=load, extra_reloads=5)
    second = plan_redistribution(placement.clone(), frozenset({4, 2}), load=load, extra_reloads=5)
    assert first == second and first.digest() == second.digest()


@pytest.fixture
def two_threads() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.mark.usefixtures("two_threads")
def test_a_failing_plan_restores_torch_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []

    def fail(*args: object) -> None:
        seen.append(torch.get_num_threads())
        raise PlacementError("planner bug")

    monkeypatch.setattr(planner_module, "_plan", fail)
    with pytest.raises(PlacementError, match="planner bug"):
        plan_redistribution(ExpertPlacement.default(1, 6, 2, 4), {1})
    assert seen == [1]  # one intra-op thread while planning ...
    assert torch.get_num_threads() == 2  # ... and the caller's setting back after the error


@pytest.mark.usefixtures("two_threads")
def test_a_failing_apply_restores_torch_threads_and_the_maps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    placement = ExpertPlacement.default(1, 6, 2, 4)
    plan = plan_redistribution(placement, {1})
    before = placement.clone()

    def fail(*args: object) -> None:
        raise PlacementError("row overflow")

    monkeypatch.setattr(apply_module, "write_logical_rows", fail)
    with pytest.raises(PlacementError, match="row overflow"):
        apply_plan(placement, plan)
    assert torch.get_num_threads() == 2
    assert torch.equal(placement.physical_to_logical_map, before.physical_to_logical_map)
