"""The EPLB expert maps in vLLM's shapes, their derivation from the slot map, and validation.

``physical_to_logical_map`` is the source of truth; ``logical_to_physical_map`` and
``logical_replica_count`` are derived from it (rows packed in ascending slot order).
"""

from __future__ import annotations

import attrs
import torch

from ftengine.errors import PlacementError
from ftengine.placement.logical import (
    EMPTY,
    derive_logical_maps,
    slot_map_digest,
    write_logical_rows,
)
from ftengine.placement.validate import check_consistent

__all__ = [
    "EMPTY",
    "ExpertPlacement",
    "check_layout",
    "derive_logical_maps",
    "slot_map_digest",
    "write_logical_rows",
]


@attrs.frozen(eq=False)
class ExpertPlacement:
    """Expert maps of every MoE layer, as vLLM's EPLB holds them.

    Tensors (int64, updated only in place because per-layer views of them live elsewhere):
    ``physical_to_logical_map [num_layers, num_physical]`` (-1: empty slot),
    ``logical_to_physical_map [num_layers, num_logical, max_replicas]`` (rows packed,
    -1 padded), ``logical_replica_count [num_layers, num_logical]``. EP rank ``r`` owns
    the contiguous slots ``[r * local_slots, (r + 1) * local_slots)``. The sizes are read
    off the tensors, whose shapes never change.
    """

    physical_to_logical_map: torch.Tensor
    logical_to_physical_map: torch.Tensor
    logical_replica_count: torch.Tensor
    ep_size: int

    @classmethod
    def default(
        cls, num_layers: int, num_logical: int, num_redundant: int, ep_size: int
    ) -> ExpertPlacement:
        """vLLM's initial placement: ``range(num_logical)`` then redundant copies ``i % E``."""
        check_layout(num_layers, num_logical, num_redundant, ep_size)
        row = list(range(num_logical)) + [i % num_logical for i in range(num_redundant)]
        p2l = torch.tensor(row, dtype=torch.int64).repeat(num_layers, 1)
        return cls.from_physical_to_logical(p2l, num_logical=num_logical, ep_size=ep_size)

    @classmethod
    def from_physical_to_logical(
        cls,
        physical_to_logical_map: torch.Tensor,
        *,
        num_logical: int,
        ep_size: int,
        max_replicas: int | None = None,
    ) -> ExpertPlacement:
        """Adopt a slot map ``[layers, num_physical]`` (kept, not copied) and derive the rest.

        ``max_replicas`` defaults to vLLM's width ``num_redundant + 1``.
        """
        p2l = physical_to_logical_map
        _check_slot_map(p2l, num_logical, ep_size)
        width = max_replicas if max_replicas is not None else p2l.shape[1] - num_logical + 1
        l2p, counts = derive_logical_maps(p2l, num_logical, max(width, 1))
        return cls(p2l, l2p, counts, ep_size)

    @classmethod
    def from_tensors(
        cls,
        physical_to_logical_map: torch.Tensor,
        logical_to_physical_map: torch.Tensor,
        logical_replica_count: torch.Tensor,
        *,
        ep_size: int,
    ) -> ExpertPlacement:
        """Adopt existing vLLM map tensors (kept, not copied) after checking they agree.

        Raises ``PlacementError`` naming the first inconsistent layer and expert.
        """
        p2l, l2p, counts = physical_to_logical_map, logical_to_physical_map, logical_replica_count
        if l2p.dim() != 3 or counts.dim() != 2:
            raise PlacementError(
                "expected logical_to_physical_map [layers, num_logical, max_replicas] and "
                f"logical_replica_count [layers, num_logical]; got {tuple(l2p.shape)} and "
                f"{tuple(counts.shape)}"
            )
        num_logical = int(l2p.shape[1])
        _check_slot_map(p2l, num_logical, ep_size)
        placement = cls(p2l, l2p, counts, ep_size)
        placement.validate()
        return placement

    @property
    def num_layers(self) -> int:
        """MoE layers: ``physical_to_logical_map``'s first dimension."""
        return int(self.physical_to_logical_map.shape[0])

    @property
    def num_physical(self) -> int:
        """Expert slots per layer over all EP ranks."""
        return int(self.physical_to_logical_map.shape[1])

    @property
    def num_logical(self) -> int:
        """Logical experts per layer: ``logical_to_physical_map``'s second dimension."""
        return int(self.logical_to_physical_map.shape[1])

    @property
    def local_slots(self) -> int:
        """Expert slots per EP rank."""
        return self.num_physical // self.ep_size

    @property
    def num_redundant(self) -> int:
        """Slots beyond one per logical expert."""
        return self.num_physical - self.num_logical

    @property
    def max_replicas(self) -> int:
        """Width of ``logical_to_physical_map``'s last dimension."""
        return int(self.logical_to_physical_map.shape[2])

    def slot_ranks(self) -> torch.Tensor:
        """EP rank of every slot, int64 ``[num_physical]`` (CPU)."""
        return torch.arange(self.num_physical) // self.local_slots

    def rank_slots(self, ep_ranks: frozenset[int]) -> torch.Tensor:
        """Slot ids owned by ``ep_ranks``, ascending int64 ``[len(ep_ranks) * local_slots]``."""
        ranks = torch.tensor(sorted(ep_ranks), dtype=torch.int64)
        local = torch.arange(self.local_slots, dtype=torch.int64)
        return (ranks.unsqueeze(1) * self.local_slots + local).flatten()

    def clone(self) -> ExpertPlacement:
        """A deep copy with fresh storage (for what-if planning)."""
        return attrs.evolve(
            self,
            physical_to_logical_map=self.physical_to_logical_map.clone(),
            logical_to_physical_map=self.logical_to_physical_map.clone(),
            logical_replica_count=self.logical_replica_count.clone(),
        )

    def validate(self, *, require_every_expert: bool = False) -> None:
        """Check the three maps agree; raise ``PlacementError`` naming layer and expert.

        With ``require_every_expert`` also require at least one replica per expert.
        """
        check_consistent(self, require_every_expert=require_every_expert)


def check_layout(num_layers: int, num_logical: int, num_redundant: int, ep_size: int) -> None:
    """Raise ``PlacementError`` listing every problem with a placement shape."""
    problems = []
    if num_layers < 1:
        problems.append(f"num_layers must be >= 1, got {num_layers}")
    if num_logical < 1:
        problems.append(f"num_logical must be >= 1, got {num_logical}")
    if num_redundant < 0:
        problems.append(f"num_redundant must be >= 0, got {num_redundant}")
    if ep_size < 1:
        problems.append(f"ep_size must be >= 1, got {ep_size}")
    elif (num_logical + num_redundant) % ep_size != 0:
        problems.append(
            f"num_physical = num_logical + num_redundant = {num_logical + num_redundant} "
            f"is not divisible by ep_size {ep_size}; pick num_redundant so every EP rank "
            "gets the same number of slots"
        )
    if problems:
        raise PlacementError("; ".join(problems))


def _check_slot_map(p2l: torch.Tensor, num_logical: int, ep_size: int) -> None:
    if p2l.dtype != torch.int64 or p2l.dim() != 2:
        raise PlacementError(
            "expected physical_to_logical_map as int64 [layers, num_physical]; got "
            f"{p2l.dtype} {tuple(p2l.shape)}"
        )
    layers, num_physical = (int(v) for v in p2l.shape)
    check_layout(max(layers, 1), num_logical, num_physical - num_logical, ep_size)
    if layers < 1:
        raise PlacementError("physical_to_logical_map has no layers")
    bad = (p2l < EMPTY) | (p2l >= num_logical)
    if bool(bad.any()):
        layer, slot = (int(v) for v in bad.nonzero()[0])
        raise PlacementError(
            f"layer {layer}, slot {slot}: physical_to_logical_map holds "
            f"{int(p2l[layer, slot])}, expected -1 or a logical expert in [0, {num_logical})"
        )
