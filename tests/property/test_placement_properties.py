"""Properties of the redistribution planner over random placements, dead sets and loads."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ftengine.errors import PreconditionFailed
from ftengine.placement.apply import apply_plan
from ftengine.placement.elastic import densify_routing_ids, elastic_info_values
from ftengine.placement.maps import ExpertPlacement
from ftengine.placement.planner import plan_redistribution
from tests.placement_strategies import Shape, dead_sets, loads, placements, shapes, slot_maps


def orphans(placement: ExpertPlacement, dead: frozenset[int]) -> int:
    """Reference count: (layer, expert) pairs with no replica outside the dead ranks."""
    local = placement.local_slots
    missing = 0
    for row in placement.physical_to_logical_map.tolist():
        alive = {e for slot, e in enumerate(row) if slot // local not in dead and e >= 0}
        missing += sum(1 for expert in range(placement.num_logical) if expert not in alive)
    return missing


def bare_live_ranks(placement: ExpertPlacement, dead: frozenset[int]) -> set[int]:
    """Live ranks with no expert in any layer (they look removed by an earlier scale-down)."""
    local = placement.local_slots
    held = (placement.physical_to_logical_map >= 0).view(placement.num_layers, -1, local)
    return {r for r in range(placement.ep_size) if r not in dead and not bool(held[:, r].any())}


def assert_serves_from_survivors(placement: ExpertPlacement, dead: frozenset[int]) -> None:
    """Maps agree, every expert has a replica, nothing points at a dead slot."""
    placement.validate(require_every_expert=True)
    local = placement.local_slots
    p2l = placement.physical_to_logical_map
    for rank in dead:
        assert bool((p2l[:, rank * local : (rank + 1) * local] == -1).all())
    l2p = placement.logical_to_physical_map
    listed = l2p[l2p >= 0]
    assert not any(int(slot) // local in dead for slot in listed.tolist())


def pointers(placement: ExpertPlacement) -> tuple[int, int, int]:
    return (
        placement.physical_to_logical_map.data_ptr(),
        placement.logical_to_physical_map.data_ptr(),
        placement.logical_replica_count.data_ptr(),
    )


@st.composite
def scenarios(
    draw: st.DrawFn,
) -> tuple[ExpertPlacement, frozenset[int], torch.Tensor | None, int]:
    shape = draw(shapes())
    placement = draw(placements(shape, holes=draw(st.booleans())))
    return (
        placement,
        draw(dead_sets(shape.ep)),
        draw(loads(shape.layers, shape.experts)),
        draw(st.integers(0, 6)),
    )


@given(scenarios())
def test_plan_is_minimal_complete_and_in_place_or_refused(
    scenario: tuple[ExpertPlacement, frozenset[int], torch.Tensor | None, int],
) -> None:
    placement, dead, load, extra = scenario
    survivors_capacity = (placement.ep_size - len(dead)) * placement.local_slots
    short = survivors_capacity < placement.num_logical
    if bare_live_ranks(placement, dead):
        try:
            plan_redistribution(placement, dead, load=load)
        except PreconditionFailed as exc:
            # Both refusals may apply at once; the planner names the capacity one first.
            wanted = str(survivors_capacity) if short else "cumulative"
            assert wanted in str(exc)
            return
        raise AssertionError("planner accepted a live rank that holds nothing")
    if short:
        try:
            plan_redistribution(placement, dead, load=load)
        except PreconditionFailed as exc:
            assert str(survivors_capacity) in str(exc)
            return
        raise AssertionError("planner accepted a dead set the survivors cannot cover")
    expected = orphans(placement, dead)
    minimal = plan_redistribution(placement, dead, load=load)
    assert minimal.reloads == minimal.lower_bound == expected
    budgeted = plan_redistribution(placement, dead, load=load, extra_reloads=extra)
    assert budgeted.lower_bound == expected
    assert expected <= budgeted.reloads <= expected + extra
    before = pointers(placement)
    apply_plan(placement, budgeted)
    assert pointers(placement) == before
    assert_serves_from_survivors(placement, dead)


@given(scenarios())
def test_plan_is_deterministic(
    scenario: tuple[ExpertPlacement, frozenset[int], torch.Tensor | None, int],
) -> None:
    placement, dead, load, extra = scenario
    capacity = (placement.ep_size - len(dead)) * placement.local_slots
    if capacity < placement.num_logical or bare_live_ranks(placement, dead):
        return
    first = plan_redistribution(placement, dead, load=load, extra_reloads=extra)
    again = plan_redistribution(placement.clone(), set(dead), load=load, extra_reloads=extra)
    assert first == again
    assert first.digest() == again.digest()
    assert torch.equal(first.table, again.table)


@given(st.data())
def test_scale_downs_compose(data: st.DataObject) -> None:
    shape = data.draw(shapes(max_ep=6, max_local=4))
    placement = data.draw(placements(shape))
    first = data.draw(dead_sets(shape.ep))
    second = first | data.draw(dead_sets(shape.ep))
    if (shape.ep - len(second)) * shape.local_slots < shape.experts:
        return
    apply_plan(placement, plan_redistribution(placement, first))
    assert_serves_from_survivors(placement, first)
    plan = plan_redistribution(placement, second)
    assert plan.reloads == plan.lower_bound == orphans(placement, second)
    apply_plan(placement, plan)
    assert_serves_from_survivors(placement, second)


@given(
    st.integers(1, 12).flatmap(
        lambda world: st.tuples(
            st.just(world), dead_sets(world, min_size=0), st.integers(1, 5), st.data()
        )
    )
)
def test_densify_is_a_dense_order_preserving_map_of_live_ids(
    case: tuple[int, frozenset[int], int, st.DataObject],
) -> None:
    world, dead, local, _ = case
    values = elastic_info_values(world, dead, local)
    assert len(values) == 4 + 2 * world
    alive = [rank for rank in range(world) if rank not in dead]
    table1 = values[4 : 4 + world] if dead else list(range(world))
    live_ids = torch.tensor([r * local + s for r in alive for s in range(local)])
    dense = densify_routing_ids(live_ids, table1, local)
    assert dense.tolist() == list(range(len(alive) * local))
    if dead:
        assert values[:4] == [1, len(alive), 0, len(alive) * local]
        assert values[4 + world : 4 + world + len(alive)] == alive


class ScaleDownMachine(RuleBasedStateMachine):
    """Kill ranks one by one; a tiny reference model (the dead set) shadows the maps."""

    def __init__(self) -> None:
        super().__init__()
        self.placement: ExpertPlacement | None = None
        self.dead: frozenset[int] = frozenset()
        self.shape = Shape(1, 1, 2, 1)

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        self.shape = data.draw(shapes(max_ep=8, max_local=3))
        self.placement = ExpertPlacement.from_physical_to_logical(
            data.draw(slot_maps(self.shape)),
            num_logical=self.shape.experts,
            ep_size=self.shape.ep,
        )

    def _alive(self) -> list[int]:
        return [rank for rank in range(self.shape.ep) if rank not in self.dead]

    @precondition(lambda self: len(self._alive()) > 1)
    @rule(data=st.data())
    def kill(self, data: st.DataObject) -> None:
        assert self.placement is not None
        victim = data.draw(st.sampled_from(self._alive()))
        dead = self.dead | {victim}
        capacity = (self.shape.ep - len(dead)) * self.shape.local_slots
        if capacity < self.shape.experts:
            try:
                plan_redistribution(self.placement, dead)
            except PreconditionFailed:
                return
            raise AssertionError("planner accepted a dead set the survivors cannot cover")
        plan = plan_redistribution(self.placement, dead)
        assert plan.reloads == plan.lower_bound == orphans(self.placement, dead)
        before = pointers(self.placement)
        apply_plan(self.placement, plan)
        assert pointers(self.placement) == before
        self.dead = dead

    @rule()
    def replan_same_dead_set(self) -> None:
        assert self.placement is not None
        snapshot = self.placement.physical_to_logical_map.clone()
        plan = plan_redistribution(self.placement, self.dead)
        assert plan.reloads == plan.lower_bound == 0
        apply_plan(self.placement, plan)
        assert torch.equal(self.placement.physical_to_logical_map, snapshot)

    @invariant()
    def serves_from_survivors(self) -> None:
        if self.placement is not None:
            assert_serves_from_survivors(self.placement, self.dead)


TestScaleDowns = ScaleDownMachine.TestCase
TestScaleDowns.settings = settings(max_examples=30, stateful_step_count=8, deadline=None)
