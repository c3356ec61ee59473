"""The EPLB expert maps in vLLM's shapes, their derivation from the slot map, and validation.

``physical_to_logical_map`` is the source of truth; ``logical_to_physical_map`` and
``logical_replica_count`` are derived from it (rows packed in ascending slot order).
"""

from __future__ import annotations

import hashlib

import attrs
import torch

from ftengine.errors import PlacementError

EMPTY = -1
"""Map value of a slot that holds no expert (a dead rank's slot, or one left unused)."""


def slot_map_digest(p2l: torch.Tensor) -> str:
    """Fingerprint of a slot map's values, independent of its device."""
    data = p2l.detach().to("cpu").contiguous().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def derive_logical_maps(
    physical_to_logical_map: torch.Tensor, num_logical: int, max_replicas: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Build ``(logical_to_physical_map, logical_replica_count)`` from a slot map.

    ``physical_to_logical_map`` is int64 ``[layers, num_physical]`` with -1 for empty
    slots. Returns int64 ``[layers, num_logical, max_replicas]`` (each row lists the
    expert's slots in ascending order, then -1) and int64 ``[layers, num_logical]``.
    Raises ``PlacementError`` naming the layer and expert when a row would not fit.
    """
    p2l = physical_to_logical_map
    layers = p2l.shape[0]
    l2p = torch.full(
        (layers, num_logical, max_replicas), EMPTY, dtype=torch.int64, device=p2l.device
    )
    counts = torch.zeros(layers, num_logical, dtype=torch.int64, device=p2l.device)
    everything = torch.ones(layers, num_logical, dtype=torch.bool, device=p2l.device)
    write_logical_rows(p2l, l2p, counts, everything)
    return l2p, counts


def write_logical_rows(
    p2l: torch.Tensor, l2p: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor
) -> None:
    """Rewrite, in place, the ``l2p`` rows and ``counts`` of the (layer, expert) pairs in
    ``rows`` (bool ``[layers, num_logical]``) from the slot map ``p2l``.

    Untouched rows keep their storage and values, so a scale-down only rewrites the rows
    of experts it moved. Raises ``PlacementError`` (before writing) if a row overflows.
    """
    layers, num_physical = p2l.shape
    num_logical, max_replicas = l2p.shape[1], l2p.shape[2]
    # Empty slots get the key num_logical so they sort after every expert.
    key = torch.where(p2l < 0, num_logical, p2l)
    order = torch.argsort(key, dim=1, stable=True)
    sorted_key = key.gather(1, order)
    layer_base = torch.arange(layers, device=p2l.device).unsqueeze(1) * (num_logical + 1)
    counts_all = torch.bincount((key + layer_base).flatten(), minlength=layers * (num_logical + 1))
    counts_all = counts_all.view(layers, num_logical + 1)
    new_counts = counts_all[:, :num_logical]
    overflow = rows & (new_counts > max_replicas)
    if bool(overflow.any()):
        layer, expert = (int(v) for v in overflow.nonzero()[0])
        raise PlacementError(
            f"layer {layer}, expert {expert}: {int(new_counts[layer, expert])} replicas do not "
            f"fit the logical_to_physical_map width {max_replicas}; widen max_replicas"
        )
    starts = torch.cumsum(counts_all, dim=1) - counts_all
    position = torch.arange(num_physical, device=p2l.device) - starts.gather(1, sorted_key)
    selected = torch.cat([rows, torch.zeros_like(rows[:, :1])], dim=1).gather(1, sorted_key)
    layer_ids = torch.arange(layers, device=p2l.device).unsqueeze(1).expand_as(order)
    l2p[rows] = EMPTY
    l2p[layer_ids[selected], sorted_key[selected], position[selected]] = order[selected]
    counts[rows] = new_counts[rows]


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
        from ftengine.placement.validate import check_consistent

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
