"""A fresh greedy rebalance in the style of vLLM's default EPLB policy (the baseline).

Replicate: give each extra slot to the expert with the highest load per replica. Pack:
hand the replicas, heaviest first, to the lightest rank that still has a free slot.
Every expert is moved wherever the packing puts it, so it reloads many experts.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ftengine.errors import PreconditionFailed
from ftengine.placement.maps import ExpertPlacement
from ftengine.placement.ranks import check_ep_ranks


def replicate(load: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Spread ``num_slots`` replicas over the experts of ``load [layers, E]``.

    Returns ``(slot_expert [layers, num_slots], counts [layers, E])``; the first ``E`` slots
    hold one replica of each expert in id order.
    """
    layers, experts = load.shape
    rows = torch.arange(layers)
    counts = torch.ones(layers, experts, dtype=torch.int64)
    slot_expert = torch.empty(layers, num_slots, dtype=torch.int64)
    slot_expert[:, :experts] = torch.arange(experts)
    for slot in range(experts, num_slots):
        hottest = (load / counts).argmax(dim=1)
        slot_expert[:, slot] = hottest
        counts[rows, hottest] += 1
    return slot_expert, counts


def balanced_packing(weight: torch.Tensor, num_packs: int) -> torch.Tensor:
    """Pack items ``weight [layers, n]`` into ``num_packs`` packs of ``n / num_packs`` items.

    Heaviest item first, each into the lightest pack with room. Returns the flat position
    ``pack * capacity + index_in_pack`` of every item, int64 ``[layers, n]``.
    """
    layers, items = weight.shape
    capacity = items // num_packs
    rows = torch.arange(layers)
    order = torch.argsort(weight, dim=1, descending=True, stable=True)
    pack_load = torch.zeros(layers, num_packs, dtype=weight.dtype)
    pack_fill = torch.zeros(layers, num_packs, dtype=torch.int64)
    position = torch.empty(layers, items, dtype=torch.int64)
    full = torch.tensor(float("inf"), dtype=weight.dtype)
    for step in range(items):
        item = order[:, step]
        pack = torch.where(pack_fill < capacity, pack_load, full).argmin(dim=1)
        position[rows, item] = pack * capacity + pack_fill[rows, pack]
        pack_fill[rows, pack] += 1
        pack_load[rows, pack] += weight[rows, item]
    return position


def greedy_rebalance(load: torch.Tensor, num_ranks: int, local_slots: int) -> torch.Tensor:
    """A fresh placement of ``load [layers, E]`` on ``num_ranks`` ranks: ``[layers, ranks*L]``."""
    slot_expert, counts = replicate(load, num_ranks * local_slots)
    weight = (load / counts).gather(1, slot_expert)
    position = balanced_packing(weight, num_ranks)
    p2l = torch.empty_like(slot_expert)
    p2l.scatter_(1, position, slot_expert)
    return p2l


def fresh_rebalance(
    placement: ExpertPlacement, dead_ep_ranks: Iterable[int], load: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Rebalance every expert from scratch on the survivors (the vLLM-style baseline).

    Returns the new slot map ``[layers, num_physical]`` (dead ranks' slots -1; survivor
    ``i`` gets pack ``i``) and the reloads it needs: for each live rank, the new experts
    that rank did not already hold (slots within a rank are matched up for free).
    """
    dead = check_ep_ranks(dead_ep_ranks, placement.ep_size)
    alive = [r for r in range(placement.ep_size) if r not in dead]
    local = placement.local_slots
    if len(alive) * local < placement.num_logical:
        raise PreconditionFailed(
            f"{len(alive)} surviving ranks x {local} slots cannot hold "
            f"{placement.num_logical} experts"
        )
    packed = greedy_rebalance(load, len(alive), local)
    live_slots = placement.rank_slots(frozenset(alive))
    p2l = torch.full_like(placement.physical_to_logical_map.cpu(), -1)
    p2l[:, live_slots] = packed
    before = placement.physical_to_logical_map.cpu()[:, live_slots]
    kept = torch.minimum(
        _per_rank_counts(before, placement.num_logical, local),
        _per_rank_counts(packed, placement.num_logical, local),
    )
    return p2l, int(packed.numel() - int(kept.sum()))


def _per_rank_counts(p2l: torch.Tensor, num_logical: int, local_slots: int) -> torch.Tensor:
    """Copies of each expert per rank: int64 ``[layers, ranks, num_logical]`` (-1 ignored)."""
    layers, slots = p2l.shape
    ranks = slots // local_slots
    rank_ids = (torch.arange(slots) // local_slots).unsqueeze(0)
    base = (torch.arange(layers).unsqueeze(1) * ranks + rank_ids) * (num_logical + 1)
    key = torch.where(p2l < 0, torch.full_like(p2l, num_logical), p2l) + base
    counts = torch.bincount(key.flatten(), minlength=layers * ranks * (num_logical + 1))
    return counts.view(layers, ranks, num_logical + 1)[..., :num_logical]
