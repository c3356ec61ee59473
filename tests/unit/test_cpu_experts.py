"""A CPU worker's experts: initial slots, elastic_info masking and in-place repair from disk."""

from __future__ import annotations

import pytest
import torch

from ftengine.errors import PlacementError, WeightLoadError
from ftengine.placement.elastic import densify_routing_ids
from ftengine.testbed.cpu.experts import CpuExperts
from ftengine.weights.index import CheckpointIndex
from ftengine.weights.reload import load_experts_into_slots
from ftengine.weights.slots import ExpertSlots
from tests.gloo_support import tiny_checkpoint


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> CheckpointIndex:
    return CheckpointIndex.open(tiny_checkpoint(tmp_path_factory.mktemp("experts") / "ckpt"))


def logical_w13(index: CheckpointIndex, layer: int, expert: int) -> torch.Tensor:
    slots = ExpertSlots.allocate(index, index.num_layers, 1)
    load_experts_into_slots(index, slots, [(layer, 0, expert)])
    return slots.w13_float(layer, 0)


def test_initial_slots_follow_the_default_placement(index: CheckpointIndex) -> None:
    # 4 logical + 4 redundant on 4 ranks: rank 1 holds experts 2 and 3.
    experts = CpuExperts.load(index, rank=1, world=4, num_redundant=4)
    assert experts.local_slots == 2
    assert experts.own_assignments() == [(0, 0, 2), (0, 1, 3), (1, 0, 2), (1, 1, 3)]
    assert torch.equal(experts.w13(1, 1), logical_w13(index, 1, 3))
    assert [layer.local_logical for layer in experts.layers()] == [(2, 3), (2, 3)]


def test_masking_densifies_routing_ids(index: CheckpointIndex) -> None:
    experts = CpuExperts.load(index, rank=0, world=4, num_redundant=4)
    ids = torch.tensor([[0, 4], [5, 1]])
    assert torch.equal(experts.densify(ids), ids)  # nothing masked: identity
    experts.mask(frozenset({1}))
    assert experts.elastic.tensor.tolist()[:4] == [1, 3, 0, 6]
    assert experts.densify(ids).tolist() == [[0, 2], [3, 1]]


def test_the_unmasked_shortcut_agrees_with_elastic_info(index: CheckpointIndex) -> None:
    experts = CpuExperts.load(index, rank=0, world=4, num_redundant=4)
    ids = torch.tensor([[0, 1], [2, 3], [6, 7]])  # none on rank 2's slots 4 and 5
    by_table = densify_routing_ids(ids, experts.elastic.table1(), experts.local_slots)
    assert torch.equal(experts.densify(ids), by_table)
    experts.mask(frozenset({2}))
    assert experts.densify(ids).tolist() == [[0, 1], [2, 3], [4, 5]]
    experts.mask(frozenset())  # nothing masked again: the lookup is the identity again
    assert torch.equal(experts.densify(ids), by_table)


def test_repair_rehosts_lost_experts_in_place(index: CheckpointIndex) -> None:
    survivors = {
        rank: CpuExperts.load(index, rank=rank, world=4, num_redundant=4) for rank in (0, 2)
    }
    ptrs = {rank: e.slots.data_ptrs() for rank, e in survivors.items()}
    reports = {rank: e.repair(frozenset({1, 3})) for rank, e in survivors.items()}
    # Experts 2 and 3 lost every replica in both layers: four reloads in all, no more.
    assert sum(r.reloads for r in reports.values()) == 4
    assert all(r.reload_lower_bound == 4 for r in reports.values())
    for rank, experts in survivors.items():
        assert experts.slots.data_ptrs() == ptrs[rank]
        for layer, slot, logical in experts.own_assignments():
            assert torch.equal(experts.w13(layer, slot), logical_w13(index, layer, logical))
    hosted = {
        (layer, logical) for e in survivors.values() for layer, _, logical in e.own_assignments()
    }
    assert hosted == {(layer, e) for layer in (0, 1) for e in range(4)}


def test_injected_reload_failure_raises_weight_load_error(index: CheckpointIndex) -> None:
    experts = CpuExperts.load(index, rank=0, world=4, num_redundant=4)
    with pytest.raises(WeightLoadError, match="injected reload_error on rank 0"):
        experts.repair(frozenset({1, 3}), fail=True)


def test_repair_refuses_to_finish_with_maps_that_still_route_to_dead_slots(
    index: CheckpointIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    experts = CpuExperts.load(index, rank=0, world=4, num_redundant=4)
    # A placement update that forgot the logical maps: slots emptied, routing untouched.
    monkeypatch.setattr("ftengine.testbed.cpu.experts.apply_plan", lambda placement, plan: None)
    with pytest.raises(PlacementError, match="still name dead or empty slots"):
        experts.repair(frozenset({3}))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("grown", ["drop", "keep"])
def test_admit_gives_the_returning_rank_its_experts_and_reloads_nothing(
    index: CheckpointIndex, grown: str
) -> None:
    # 4 logical + 2 redundant on 3 ranks: 0 {0, 1}, 1 {2, 3}, 2 {0, 1}; rank 1 dies, so
    # experts 2 and 3 are re-hosted on the survivors, then rank 1 comes back.
    survivors = {r: CpuExperts.load(index, rank=r, world=3, num_redundant=2) for r in (0, 2)}
    for experts in survivors.values():
        experts.mask(frozenset({1}))
        experts.repair(frozenset({1}))
    during = survivors[0].placement.physical_to_logical_map.clone()
    returning = CpuExperts.load(index, rank=1, world=3, num_redundant=2)
    reports = {
        r: e.admit(frozenset({1}), during.clone(), grown=grown)  # type: ignore[arg-type]
        for r, e in {**survivors, 1: returning}.items()
    }
    assert {r: rep.reloads for r, rep in reports.items()} == {0: 0, 2: 0, 1: 0}
    maps = [e.placement.physical_to_logical_map for e in (*survivors.values(), returning)]
    assert all(torch.equal(maps[0], m) for m in maps)  # every rank holds the same maps
    assert maps[0][:, 2:4].tolist() == [[2, 3], [2, 3]]  # rank 1's original experts
    for experts in (*survivors.values(), returning):
        experts.placement.validate(require_every_expert=True)
        experts.mask(frozenset())
    assert torch.equal(returning.w13(0, 1), logical_w13(index, 0, 3))
    grown_slots = (maps[0] != returning.original) & (maps[0] >= 0)
    if grown == "drop":
        assert not bool(grown_slots.any())  # copies grown for rank 1 are dropped (empty)
        assert bool((maps[0] == -1).any())
    else:
        assert bool(grown_slots.any())  # kept as standby replicas


def test_a_survivor_whose_map_disagrees_refuses_the_admission(index: CheckpointIndex) -> None:
    survivor = CpuExperts.load(index, rank=0, world=3, num_redundant=2)
    survivor.mask(frozenset({1}))
    survivor.repair(frozenset({1}))
    other = CpuExperts.load(index, rank=2, world=3, num_redundant=2).placement
    with pytest.raises(PlacementError, match="survivors disagree"):
        survivor.admit(frozenset({1}), other.physical_to_logical_map.clone())
