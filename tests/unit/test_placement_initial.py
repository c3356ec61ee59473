"""Initial placements (default, balanced, failure-aware) and the greedy rebalance baseline."""

from __future__ import annotations

import pytest
import torch

from ftengine.errors import ConfigError, PreconditionFailed
from ftengine.placement.initial import failure_aware_row, make_placement
from ftengine.placement.loads import zipf_load
from ftengine.placement.rebalance import fresh_rebalance, greedy_rebalance, replicate
from ftengine.placement.scoring import balancedness, zero_reload_bound, zero_reload_fraction


def test_failure_aware_reaches_the_bound_and_beats_the_default_at_ep32_r32() -> None:
    aware = make_placement("failure-aware", 2, 256, 32, 32)
    default = make_placement("default", 2, 256, 32, 32)
    bound = zero_reload_bound(256, 288, 32, 1)
    assert zero_reload_fraction(aware, 1) == pytest.approx(bound) == pytest.approx(7 / 32)
    assert zero_reload_fraction(default, 1) == pytest.approx(6 / 32)
    assert zero_reload_fraction(aware, 2) > zero_reload_fraction(default, 2)


def test_failure_aware_makes_every_single_failure_free_once_p_is_2e() -> None:
    aware = make_placement("failure-aware", 1, 256, 256, 32)
    aware.validate(require_every_expert=True)
    assert zero_reload_fraction(aware, 1) == 1.0
    assert zero_reload_fraction(aware, 2) == pytest.approx(zero_reload_bound(256, 512, 32, 2))


def test_failure_aware_row_doubles_the_first_experts_of_the_order() -> None:
    # E = 8, R = 4, W = 4, L = 3: floor(2R / L) = 2 ranks hold only doubled experts.
    row = failure_aware_row([7, 6, 5, 4, 3, 2, 1, 0], 4, 4)
    assert row[:6] == [7, 6, 5, 7, 6, 5]
    assert sorted(row) == sorted([*range(8), 7, 6, 5, 4])


def test_failure_aware_follows_the_load() -> None:
    load = torch.tensor([[1.0, 9.0, 5.0, 2.0]])
    placement = make_placement("failure-aware", 1, 4, 2, 3, load)
    counts = placement.logical_replica_count[0].tolist()
    assert counts == [1, 2, 2, 1]


def test_balanced_beats_default_under_zipf_load() -> None:
    load = zipf_load(4, 64, seed=3, top_k=4, tokens=1024)
    scores = {
        kind: balancedness(
            make_placement(kind, 4, 64, 16, 16, load).physical_to_logical_map,
            load,
            num_logical=64,
            local_slots=5,
        )
        for kind in ("default", "balanced")
    }
    assert scores["balanced"] > 0.95 > scores["default"]


def test_unknown_placement_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown placement 'random'"):
        make_placement("random", 1, 4, 0, 2)


def test_replicate_gives_extra_slots_to_the_highest_load_per_replica() -> None:
    slot_expert, counts = replicate(torch.tensor([[8.0, 1.0, 3.0]]), 6)
    # 8 -> 4 (two copies) -> 8/3 (three); then 3 > 8/3 wins the last slot.
    assert counts.tolist() == [[3, 1, 2]]
    assert slot_expert[0, :3].tolist() == [0, 1, 2]


def test_greedy_rebalance_packs_every_rank_full() -> None:
    load = torch.tensor([[8.0, 1.0, 3.0, 4.0]])
    p2l = greedy_rebalance(load, num_ranks=3, local_slots=2)
    ranks = [sorted(p2l[0, r * 2 : r * 2 + 2].tolist()) for r in range(3)]
    assert sorted(e for rank in ranks for e in rank) == [0, 0, 0, 1, 2, 3]
    # Expert 0 gets both extra slots (8 -> 4, then a tie with 4 goes to the lower id).
    # Heaviest first into the lightest rank: {4, 1}, {3, 8/3}, {8/3, 8/3}.
    assert balancedness(p2l, load, num_logical=4, local_slots=2) == pytest.approx(
        (16 / 3) / (3 + 8 / 3)
    )


def test_fresh_rebalance_leaves_dead_ranks_empty_and_counts_new_experts() -> None:
    placement = make_placement("default", 1, 4, 2, 3)
    p2l, reloads = fresh_rebalance(placement, {1}, torch.ones(1, 4))
    assert p2l[0, 2:4].tolist() == [-1, -1]
    assert sorted(p2l[0, [0, 1, 4, 5]].tolist()) == [0, 1, 2, 3]
    old = {0: {0, 1}, 2: {0, 1}}
    expected = sum(
        1 for rank in (0, 2) for e in p2l[0, rank * 2 : rank * 2 + 2].tolist() if e not in old[rank]
    )
    assert reloads == expected


def test_fresh_rebalance_refuses_what_the_survivors_cannot_hold() -> None:
    placement = make_placement("default", 1, 4, 0, 2)
    with pytest.raises(PreconditionFailed, match="1 surviving ranks x 2 slots cannot hold 4"):
        fresh_rebalance(placement, {0}, torch.ones(1, 4))
