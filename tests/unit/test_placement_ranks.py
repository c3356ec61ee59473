"""Dead-rank bookkeeping: DP -> EP, cumulative scale-downs, DP-sync neutralisation."""

from __future__ import annotations

import pytest
import torch

from ftengine.errors import PreconditionFailed
from ftengine.placement.ranks import (
    DeadRankSet,
    check_ep_ranks,
    dp_to_ep_ranks,
    neutralize_dead_columns,
)


def test_dp_ranks_own_tp_consecutive_ep_ranks() -> None:
    assert dp_to_ep_ranks({1, 3}, 2) == frozenset({2, 3, 6, 7})
    assert dp_to_ep_ranks({2}, 1) == frozenset({2})


def test_dead_set_is_cumulative_4_3_2() -> None:
    ranks = DeadRankSet(dp_world=4, tp_size=2)
    ranks = ranks.scale_down([3])
    ranks = ranks.scale_down([3, 2])
    assert ranks.dp == frozenset({2, 3})
    assert ranks.alive_dp == frozenset({0, 1})
    assert ranks.ep == frozenset({4, 5, 6, 7}) and ranks.ep_world == 8
    assert ranks.scale_down([1]).dp == frozenset({1, 2, 3})  # naming only the new one works


def test_scale_down_lists_every_failed_precondition() -> None:
    ranks = DeadRankSet(dp_world=4).scale_down([3])
    with pytest.raises(PreconditionFailed) as caught:
        ranks.scale_down([3, 7], receiving_rank=3)
    reasons = caught.value.reasons
    assert any("[7] are not original DP ranks" in reason for reason in reasons)
    assert any("receiving rank 3" in reason for reason in reasons)
    with pytest.raises(PreconditionFailed, match="already removed"):
        ranks.scale_down([3])
    with pytest.raises(PreconditionFailed, match="would leave no DP rank"):
        ranks.scale_down([0, 1, 2])
    with pytest.raises(PreconditionFailed, match="empty"):
        ranks.scale_down([])


def test_check_ep_ranks() -> None:
    assert check_ep_ranks([1, 2], 4) == frozenset({1, 2})
    with pytest.raises(PreconditionFailed, match=r"\[4\] are out of range"):
        check_ep_ranks([4], 4)
    with pytest.raises(PreconditionFailed, match="all 2 EP ranks are dead"):
        check_ep_ranks([0, 1], 2)


def test_neutralize_one_value_for_every_row() -> None:
    sync = torch.tensor([[5, 6, 7], [1, 1, 0]])
    neutralize_dead_columns(sync, {2}, 0)
    assert sync.tolist() == [[5, 6, 0], [1, 1, 0]]


def test_neutralize_one_value_per_row_in_place() -> None:
    sync = torch.tensor([[5.0, 6.0, 7.0], [0.0, 0.0, 0.0]])
    pointer = sync.data_ptr()
    neutralize_dead_columns(sync, {0, 2}, [0.0, 1.0])
    assert sync.tolist() == [[0.0, 6.0, 0.0], [1.0, 0.0, 1.0]]
    assert sync.data_ptr() == pointer


def test_neutralize_refuses_bad_ranks_and_shapes() -> None:
    with pytest.raises(PreconditionFailed, match=r"\[3\] are out of range"):
        neutralize_dead_columns(torch.zeros(2, 3), {3}, 0)
    with pytest.raises(PreconditionFailed, match="one value per row"):
        neutralize_dead_columns(torch.zeros(3), {1}, [0, 1])
