"""MC2 elastic_info and routing-id densification, against the REFERENCE §4 examples."""

from __future__ import annotations

import pytest
import torch

from ftengine.errors import PlacementError, PreconditionFailed
from ftengine.placement.elastic import ElasticInfo, densify_routing_ids, elastic_info_values


def test_reference_example_rank_1_dead_of_4() -> None:
    assert elastic_info_values(4, {1}, 8) == [1, 3, 0, 24, 0, -1, 1, 2, 0, 2, 3, -1]


def test_reference_doc_example_with_a_shared_expert_rank() -> None:
    values = elastic_info_values(8, {2, 3, 4, 5}, 1, shared_expert_rank_num=1)
    assert values == [1, 4, 1, 3, 0, 1, -1, -1, -1, -1, 2, 3, 0, 1, 6, 7, -1, -1, -1, -1]


def test_all_zeros_when_nothing_is_dead() -> None:
    assert elastic_info_values(4, set(), 8) == [0] * 12


def test_reference_densify_example() -> None:
    ids = torch.tensor([0, 8, 12], dtype=torch.int32)
    dense = densify_routing_ids(ids, [0, -1, 1, 2], 4)
    assert dense.tolist() == [0, 4, 8]
    assert dense.dtype == torch.int32


def test_densify_keeps_shape_and_accepts_a_tensor_table() -> None:
    ids = torch.tensor([[0, 3], [8, 15]])
    dense = densify_routing_ids(ids, torch.tensor([0, -1, 1, 2]), 4)
    assert dense.tolist() == [[0, 3], [4, 11]]


@pytest.mark.parametrize("bad", [-1, 4, 7, 16])
def test_densify_refuses_dead_negative_and_out_of_range_ids(bad: int) -> None:
    with pytest.raises(PlacementError, match=rf"\[{bad}\]"):
        densify_routing_ids(torch.tensor([0, bad, 8]), [0, -1, 1, 2], 4)


def test_update_rewrites_the_same_storage() -> None:
    info = ElasticInfo(4, 8)
    pointer = info.tensor.data_ptr()
    assert info.tensor.tolist() == [0] * 12
    assert info.tensor.dtype == torch.int32
    info.update({1})
    assert info.tensor.tolist() == [1, 3, 0, 24, 0, -1, 1, 2, 0, 2, 3, -1]
    info.update({1, 3})
    assert info.tensor.tolist() == [1, 2, 0, 16, 0, -1, 1, -1, 0, 2, -1, -1]
    assert info.tensor.data_ptr() == pointer
    assert info.dead_ep_ranks == frozenset({1, 3})
    assert not info.pinned  # host memory is never pinned for a CPU device


def test_tables_are_identity_until_a_rank_dies() -> None:
    info = ElasticInfo(4, 2)
    assert info.table1().tolist() == [0, 1, 2, 3]
    assert info.table2().tolist() == [0, 1, 2, 3]
    info.update({0})
    assert info.table1().tolist() == [-1, 0, 1, 2]
    assert info.table2().tolist() == [1, 2, 3, -1]


def test_refuses_tensor_parallel_and_a_changing_expert_count() -> None:
    with pytest.raises(PreconditionFailed, match="tp_world_size == 1"):
        ElasticInfo(4, 8, tp_size=2)
    with pytest.raises(PreconditionFailed, match="experts per rank would change"):
        ElasticInfo(4, 8, moe_expert_num=30)
    ElasticInfo(4, 8, moe_expert_num=32)


def test_refuses_dead_sets_it_cannot_express() -> None:
    info = ElasticInfo(4, 2, shared_expert_rank_num=1)
    with pytest.raises(PreconditionFailed, match="shared-expert ranks"):
        info.update({0})
    with pytest.raises(PreconditionFailed, match="no MoE rank"):
        info.update({1, 2, 3})
    with pytest.raises(PreconditionFailed, match="out of range"):
        info.update({4})
    assert info.tensor.tolist() == [0] * 12  # a refused update leaves the tensor alone
