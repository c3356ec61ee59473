"""Consistency checks of an ExpertPlacement's three maps, with errors naming layer and expert."""

from __future__ import annotations

from typing import Protocol

import torch

from ftengine.errors import PlacementError
from ftengine.placement.logical import EMPTY, derive_logical_maps


class ExpertPlacement(Protocol):
    """What the checks read of ``maps.ExpertPlacement`` (a Protocol, so that ``maps`` can
    call these checks without the two modules importing each other)."""

    @property
    def physical_to_logical_map(self) -> torch.Tensor: ...
    @property
    def logical_to_physical_map(self) -> torch.Tensor: ...
    @property
    def logical_replica_count(self) -> torch.Tensor: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_physical(self) -> int: ...
    @property
    def num_logical(self) -> int: ...
    @property
    def max_replicas(self) -> int: ...


def check_consistent(placement: ExpertPlacement, *, require_every_expert: bool = False) -> None:
    """Raise ``PlacementError`` at the first disagreement between the maps.

    Checks shapes, value ranges, that ``logical_to_physical_map`` rows are packed, that
    ``logical_replica_count`` counts each row, and that each row lists exactly the slots
    ``physical_to_logical_map`` gives that expert.
    """
    _check_shapes(placement)
    _check_rows(placement)
    _check_against_slot_map(placement)
    counts = placement.logical_replica_count
    if require_every_expert and bool((counts == 0).any()):
        layer, expert = _first(counts == 0)
        raise PlacementError(
            f"layer {layer}, expert {expert} has no replica (of {placement.num_layers} "
            "layers); every logical expert needs at least one live slot"
        )


def _check_rows(placement: ExpertPlacement) -> None:
    """Slot ids in range, rows packed, counts matching the rows."""
    l2p = placement.logical_to_physical_map
    counts = placement.logical_replica_count
    out_of_range = ((l2p < EMPTY) | (l2p >= placement.num_physical)).any(dim=2)
    if bool(out_of_range.any()):
        layer, expert = _first(out_of_range)
        raise _row_error(layer, expert, f"holds a slot outside [0, {placement.num_physical})")
    valid = l2p >= 0
    unpacked = (valid[..., 1:] & ~valid[..., :-1]).any(dim=2)
    if bool(unpacked.any()):
        layer, expert = _first(unpacked)
        raise _row_error(layer, expert, "is not packed (a slot follows a -1)")
    listed = valid.sum(dim=2)
    if bool((listed != counts).any()):
        layer, expert = _first(listed != counts)
        raise _row_error(
            layer,
            expert,
            f"lists {int(listed[layer, expert])} slots but logical_replica_count says "
            f"{int(counts[layer, expert])}",
        )


def _check_against_slot_map(placement: ExpertPlacement) -> None:
    """Each row lists exactly the slots the slot map gives its expert (in any order)."""
    l2p = placement.logical_to_physical_map
    canonical, canonical_counts = derive_logical_maps(
        placement.physical_to_logical_map, placement.num_logical, l2p.shape[2]
    )
    pad = placement.num_physical
    given = torch.where(l2p >= 0, l2p, pad).sort(dim=2).values
    given = torch.where(given == pad, EMPTY, given)
    differs = (given != canonical).any(dim=2) | (
        canonical_counts != placement.logical_replica_count
    )
    if bool(differs.any()):
        layer, expert = _first(differs)
        raise _row_error(
            layer,
            expert,
            f"lists slots {_slots(given[layer, expert])} but physical_to_logical_map places "
            f"it in slots {_slots(canonical[layer, expert])}",
        )


def _check_shapes(placement: ExpertPlacement) -> None:
    expected = {
        "physical_to_logical_map": (placement.num_layers, placement.num_physical),
        "logical_to_physical_map": (
            placement.num_layers,
            placement.num_logical,
            placement.max_replicas,
        ),
        "logical_replica_count": (placement.num_layers, placement.num_logical),
    }
    for name, shape in expected.items():
        tensor: torch.Tensor = getattr(placement, name)
        if tuple(tensor.shape) != shape or tensor.dtype != torch.int64:
            raise PlacementError(
                f"{name}: expected int64 {shape}, got {tensor.dtype} {tuple(tensor.shape)}"
            )
    devices = {str(getattr(placement, name).device) for name in expected}
    if len(devices) != 1:
        raise PlacementError(f"the three maps must share one device; got {sorted(devices)}")


def _first(mask: torch.Tensor) -> tuple[int, int]:
    layer, expert = (int(v) for v in mask.nonzero()[0][:2])
    return layer, expert


def _slots(row: torch.Tensor) -> list[int]:
    return [int(v) for v in row.tolist() if v >= 0]


def _row_error(layer: int, expert: int, what: str) -> PlacementError:
    return PlacementError(
        f"layer {layer}, expert {expert}: logical_to_physical_map row {what}; "
        "rebuild the maps from physical_to_logical_map "
        "(ExpertPlacement.from_physical_to_logical)"
    )
