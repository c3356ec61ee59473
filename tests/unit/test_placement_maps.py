"""ExpertPlacement: vLLM's default layout, derived maps, validation errors."""

from __future__ import annotations

import pytest
import torch

from ftengine.errors import PlacementError
from ftengine.placement.maps import ExpertPlacement, derive_logical_maps


def test_default_layout_is_vllms() -> None:
    placement = ExpertPlacement.default(num_layers=2, num_logical=4, num_redundant=2, ep_size=3)
    assert placement.physical_to_logical_map.tolist() == [[0, 1, 2, 3, 0, 1]] * 2
    assert placement.local_slots == 2 and placement.num_redundant == 2
    assert placement.max_replicas == 3  # vLLM's width: num_redundant + 1
    assert placement.logical_to_physical_map[0].tolist() == [
        [0, 4, -1],
        [1, 5, -1],
        [2, -1, -1],
        [3, -1, -1],
    ]
    assert placement.logical_replica_count.tolist() == [[2, 2, 1, 1]] * 2
    placement.validate(require_every_expert=True)


def test_rank_slots_are_contiguous_blocks() -> None:
    placement = ExpertPlacement.default(1, 6, 2, 4)
    assert placement.rank_slots(frozenset({1, 3})).tolist() == [2, 3, 6, 7]
    assert placement.slot_ranks().tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_non_divisible_physical_count_is_refused_with_the_numbers() -> None:
    with pytest.raises(PlacementError, match="289 is not divisible by ep_size 32"):
        ExpertPlacement.default(61, 256, 33, 32)


def test_clone_has_its_own_storage() -> None:
    placement = ExpertPlacement.default(1, 4, 0, 2)
    copy = placement.clone()
    copy.physical_to_logical_map[0, 0] = 3
    assert placement.physical_to_logical_map[0, 0] == 0


def _tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    placement = ExpertPlacement.default(2, 4, 2, 3)
    return (
        placement.physical_to_logical_map.clone(),
        placement.logical_to_physical_map.clone(),
        placement.logical_replica_count.clone(),
    )


def test_from_tensors_keeps_the_callers_storage() -> None:
    p2l, l2p, counts = _tensors()
    placement = ExpertPlacement.from_tensors(p2l, l2p, counts, ep_size=3)
    assert placement.physical_to_logical_map.data_ptr() == p2l.data_ptr()
    assert placement.logical_to_physical_map.data_ptr() == l2p.data_ptr()


def test_from_tensors_accepts_rows_in_any_order() -> None:
    p2l, l2p, counts = _tensors()
    l2p[1, 0, :2] = torch.tensor([4, 0])
    ExpertPlacement.from_tensors(p2l, l2p, counts, ep_size=3)


def test_from_tensors_names_a_row_listing_the_wrong_slots() -> None:
    p2l, l2p, counts = _tensors()
    l2p[1, 2, 0] = 5
    with pytest.raises(PlacementError, match=r"layer 1, expert 2: .*slots \[5\].*slots \[2\]"):
        ExpertPlacement.from_tensors(p2l, l2p, counts, ep_size=3)


def test_from_tensors_names_an_unpacked_row() -> None:
    p2l, l2p, counts = _tensors()
    l2p[0, 1] = torch.tensor([-1, 1, 5])
    with pytest.raises(PlacementError, match=r"layer 0, expert 1: .*not packed"):
        ExpertPlacement.from_tensors(p2l, l2p, counts, ep_size=3)


def test_from_tensors_names_a_wrong_count() -> None:
    p2l, l2p, counts = _tensors()
    counts[1, 3] = 2
    with pytest.raises(PlacementError, match=r"layer 1, expert 3: .*lists 1 slots but .* says 2"):
        ExpertPlacement.from_tensors(p2l, l2p, counts, ep_size=3)


def test_from_tensors_names_a_slot_map_value_out_of_range() -> None:
    p2l, l2p, counts = _tensors()
    p2l[1, 5] = 9
    with pytest.raises(PlacementError, match=r"layer 1, slot 5: .* holds 9"):
        ExpertPlacement.from_tensors(p2l, l2p, counts, ep_size=3)


def test_validate_can_require_every_expert() -> None:
    p2l = torch.tensor([[0, -1, 2, 0]])
    placement = ExpertPlacement.from_physical_to_logical(p2l, num_logical=3, ep_size=2)
    placement.validate()
    with pytest.raises(PlacementError, match="layer 0, expert 1 has no replica"):
        placement.validate(require_every_expert=True)


def test_derive_refuses_rows_wider_than_the_map() -> None:
    with pytest.raises(PlacementError, match="layer 0, expert 0: 3 replicas do not fit"):
        derive_logical_maps(torch.tensor([[0, 0, 0, 1]]), num_logical=2, max_replicas=2)
