"""The slot map's derived rows: ``logical_to_physical_map`` and ``logical_replica_count``
written from ``physical_to_logical_map`` (packed, ascending slot order), and its fingerprint.

Below ``maps`` and ``validate`` so that both can use it without importing each other.
"""

from __future__ import annotations

import hashlib

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
