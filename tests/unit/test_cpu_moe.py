"""MC2-style dispatch/combine over gloo: placement-independent numbers, replica choice, masking."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ftengine.errors import PlacementError
from ftengine.placement.elastic import ElasticInfo, densify_routing_ids
from ftengine.placement.maps import ExpertPlacement
from ftengine.testbed.cpu.comm import GlooGroup
from ftengine.testbed.cpu.moe import (
    DistributedMoe,
    LocalMoe,
    choose_replicas,
    combine_topk,
    expert_ffn,
)
from tests.gloo_support import on_ranks

H, INTER, E = 8, 6, 4


class Experts:
    """Deterministic expert weights; ``slot_of`` maps a local slot to its logical expert."""

    def __init__(self, slot_of: dict[int, int]) -> None:
        self.slot_of = slot_of

    @staticmethod
    def logical(expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + expert)
        return torch.randn(H, 2 * INTER, generator=g), torch.randn(INTER, H, generator=g)

    def w13(self, layer: int, slot: int) -> torch.Tensor:
        return self.logical(self.slot_of[slot])[0]

    def w2(self, layer: int, slot: int) -> torch.Tensor:
        return self.logical(self.slot_of[slot])[1]


def test_expert_ffn_rows_do_not_depend_on_the_batch() -> None:
    w13, w2 = Experts.logical(0)
    x = torch.randn(5, H)
    together = expert_ffn(x, w13, w2)
    alone = torch.cat([expert_ffn(x[i : i + 1], w13, w2) for i in range(5)])
    assert torch.equal(together, alone)
    assert expert_ffn(x[:0], w13, w2).shape == (0, H)


def test_combine_topk_weights_outputs_in_k_order() -> None:
    outputs = torch.tensor([[[1.0, 2.0], [10.0, 20.0]]])
    weights = torch.tensor([[0.25, 0.75]])
    assert combine_topk(outputs, weights).tolist() == [[7.75, 15.5]]


def test_choose_replicas_spreads_over_replicas_and_refuses_missing_ones() -> None:
    l2p = torch.tensor([[0, 4], [1, -1]])
    counts = torch.tensor([2, 1])
    ids = torch.tensor([[0, 1], [0, 1], [1, 0]])
    keys = torch.tensor([0, 1, 0])
    assert choose_replicas(l2p, counts, ids, keys).tolist() == [[0, 1], [4, 1], [1, 4]]
    with pytest.raises(PlacementError, match=r"\[1\]"):
        choose_replicas(l2p, torch.tensor([2, 0]), ids, keys)


def routed(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, H, generator=g)
    picks = [torch.randperm(E, generator=g)[:2] for _ in range(tokens)]
    ids = torch.stack(picks) if picks else torch.zeros(0, 2, dtype=torch.long)
    weights = torch.softmax(torch.randn(tokens, 2, generator=g), dim=-1)
    return hidden, ids, weights, torch.arange(tokens)


def placed_moe(
    group: GlooGroup, placement: ExpertPlacement, densify: Callable[[torch.Tensor], torch.Tensor]
) -> DistributedMoe:
    """The MoE layer of ``group.rank``: its slots of ``placement``, routed by its EPLB maps."""
    start = group.rank * placement.local_slots
    p2l = placement.physical_to_logical_map[0]
    mine = {s: int(p2l[start + s]) for s in range(placement.local_slots)}
    return DistributedMoe(
        lambda: group,
        Experts(mine),
        lambda layer: (
            placement.logical_to_physical_map[layer],
            placement.logical_replica_count[layer],
        ),
        densify,
        placement.local_slots,
    )


def test_two_rank_dispatch_combine_matches_the_local_reference_bit_for_bit() -> None:
    # 4 logical experts + 4 redundant on 2 ranks: every expert has a replica on each rank.
    placement = ExpertPlacement.default(1, E, E, 2)
    elastic = ElasticInfo(2, placement.local_slots)
    reference = LocalMoe(Experts({e: e for e in range(E)}))

    def layer_on(group: GlooGroup) -> tuple[torch.Tensor, torch.Tensor]:
        moe = placed_moe(
            group,
            placement,
            lambda ids: densify_routing_ids(ids, elastic.table1(), placement.local_slots),
        )
        hidden, ids, weights, keys = routed(3 + 2 * group.rank, seed=group.rank)
        return moe(0, hidden, ids, weights, keys), reference(0, hidden, ids, weights, keys)

    for got, want in on_ranks(2, layer_on):
        assert torch.equal(got, want)


def test_a_rank_without_tokens_still_takes_part() -> None:
    placement = ExpertPlacement.default(1, E, E, 2)

    def layer_on(group: GlooGroup) -> torch.Size:
        moe = placed_moe(group, placement, lambda ids: ids)
        hidden, ids, weights, keys = routed(0 if group.rank == 0 else 4, seed=5)
        return moe(0, hidden, ids, weights, keys).shape

    assert on_ranks(2, layer_on) == [torch.Size([0, H]), torch.Size([4, H])]


def test_routing_to_a_rank_outside_the_group_is_refused() -> None:
    def layer_on(group: GlooGroup) -> bool:
        moe = DistributedMoe(
            lambda: group,
            Experts({0: 0}),
            lambda layer: (torch.tensor([[5], [0], [0], [0]]), torch.tensor([1, 1, 1, 1])),
            lambda ids: ids,
            1,
        )
        with pytest.raises(PlacementError, match="densify"):
            moe(
                0,
                torch.zeros(1, H),
                torch.tensor([[0, 1]]),
                torch.ones(1, 2),
                torch.zeros(1, dtype=torch.long),
            )
        return True

    assert on_ranks(1, layer_on) == [True]
