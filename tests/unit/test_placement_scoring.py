"""Balancedness, zero-reload fractions and their bounds on hand-checkable placements."""

from __future__ import annotations

import math

import pytest
import torch

from ftengine.errors import ConfigError, PreconditionFailed
from ftengine.placement.maps import ExpertPlacement
from ftengine.placement.scoring import (
    balancedness,
    orphans_after_failure,
    rank_loads,
    zero_reload_bound,
    zero_reload_fraction,
)


def test_balancedness_is_mean_over_max_of_rank_load() -> None:
    p2l = torch.tensor([[0, 1, 2, 2]])
    even = torch.tensor([[1.0, 1.0, 2.0]])
    assert balancedness(p2l, even, num_logical=3, local_slots=2) == 1.0
    skewed = torch.tensor([[3.0, 1.0, 2.0]])
    assert rank_loads(p2l, skewed, 3, 2).tolist() == [[4.0, 2.0]]
    assert balancedness(p2l, skewed, num_logical=3, local_slots=2) == pytest.approx(0.75)


def test_balancedness_ignores_dead_ranks_whatever_they_hold() -> None:
    p2l = torch.tensor([[0, 1, 2, 2, 0, 1]])
    load = torch.tensor([[1.0, 1.0, 1.0]])
    assert balancedness(p2l, load, num_logical=3, local_slots=2) == pytest.approx(1.0)
    # Rank 2 is dead: experts 0 and 1 keep one replica each on rank 0 (load 2 vs 1).
    value = balancedness(p2l, load, num_logical=3, local_slots=2, dead_ep_ranks={2})
    assert value == pytest.approx(0.75)


def test_balancedness_refuses_an_impossible_dead_set() -> None:
    p2l, load = torch.tensor([[0, 1, 2, 2]]), torch.ones(1, 3)
    with pytest.raises(PreconditionFailed, match=r"dead EP ranks \[2\] are out of range \[0, 2\)"):
        balancedness(p2l, load, num_logical=3, local_slots=2, dead_ep_ranks={2})
    with pytest.raises(PreconditionFailed, match="all 2 EP ranks are dead"):
        balancedness(p2l, load, num_logical=3, local_slots=2, dead_ep_ranks={0, 1})


def test_orphans_after_failure() -> None:
    p2l = torch.tensor([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]])
    assert orphans_after_failure(p2l, 4, 2, {1}) == 4
    assert orphans_after_failure(p2l, 4, 2, {0}) == 0


def test_zero_reload_fractions_of_vllms_default_layout() -> None:
    # Ranks {0, 1}, {2, 3}, {0, 1}: losing rank 0 or 2 costs nothing, rank 1 orphans 2 and 3.
    placement = ExpertPlacement.default(1, 4, 2, 3)
    assert zero_reload_fraction(placement, 1) == pytest.approx(2 / 3)
    assert zero_reload_fraction(placement, 2) == 0.0


def test_pairs_sharing_an_experts_only_copies_break() -> None:
    ring = torch.tensor([[0, 1, 0, 2, 1, 2]])  # every expert on exactly two ranks
    placement = ExpertPlacement.from_physical_to_logical(ring, num_logical=3, ep_size=3)
    assert zero_reload_fraction(placement, 1) == 1.0
    assert zero_reload_fraction(placement, 2) == 0.0
    triple = torch.tensor([[0, 1, 0, 1, 0, 1]])  # both experts on all three ranks
    placement = ExpertPlacement.from_physical_to_logical(triple, num_logical=2, ep_size=3)
    assert zero_reload_fraction(placement, 2) == 1.0


@pytest.mark.parametrize(
    ("experts", "physical", "ep", "k", "expected"),
    [
        (256, 288, 32, 1, 7 / 32),  # floor(2 * 32 / 9) = 7 ranks can hold only doubles
        (256, 512, 32, 1, 1.0),  # P >= 2E: every single failure can be free
        (256, 256, 32, 1, 0.0),  # no redundancy: every rank holds singles
        (256, 288, 32, 2, math.comb(7, 2) / math.comb(32, 2)),
        (256, 512, 32, 2, 1 - 16 / math.comb(32, 2)),  # all doubled: >= 256 / 16 pairs break
        (4, 12, 4, 2, 1.0),  # P >= 3E
        (8, 12, 4, 2, 0.0),  # R = 4 < 2L = 6: no pair can be free
        (4, 6, 1, 1, 0.0),  # one rank: its failure loses everything
    ],
)
def test_zero_reload_bounds(experts: int, physical: int, ep: int, k: int, expected: float) -> None:
    assert zero_reload_bound(experts, physical, ep, k) == pytest.approx(expected)


def test_unknown_k_is_refused() -> None:
    # ConfigError is an ftengine error and still a ValueError.
    with pytest.raises(ConfigError, match="k must be 1 or 2, got 3"):
        zero_reload_bound(4, 8, 2, 3)
    with pytest.raises(ConfigError, match="k must be 1 or 2, got 0"):
        zero_reload_fraction(ExpertPlacement.default(1, 4, 4, 2), 0)
