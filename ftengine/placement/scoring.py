"""Scores of a placement: per-rank load balancedness and how many failures need no reload.

Sums that feed the planner's decisions are taken slot by slot in a fixed order (never a
vectorised reduction whose order depends on the CPU), so every survivor gets the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ftengine.errors import ConfigError
from ftengine.placement.maps import ExpertPlacement
from ftengine.placement.ranks import check_ep_ranks


def replica_counts(p2l: torch.Tensor, num_logical: int) -> torch.Tensor:
    """Replicas per expert, int64 ``[layers, num_logical]``; -1 slots are not counted."""
    layers = p2l.shape[0]
    base = torch.arange(layers, device=p2l.device).unsqueeze(1) * (num_logical + 1)
    key = torch.where(p2l < 0, torch.full_like(p2l, num_logical), p2l) + base
    counts = torch.bincount(key.flatten(), minlength=layers * (num_logical + 1))
    return counts.view(layers, num_logical + 1)[:, :num_logical]


def slot_loads(p2l: torch.Tensor, load: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Load each slot serves, float64 ``[layers, num_physical]``: its expert's load / replicas.

    The router spreads an expert's tokens evenly over its replicas; -1 slots serve 0.
    """
    per_replica = load / counts.clamp(min=1).to(load.dtype)
    values = per_replica.gather(1, p2l.clamp(min=0))
    return torch.where(p2l >= 0, values, torch.zeros_like(values))


def rank_sums(values: torch.Tensor, local_slots: int) -> torch.Tensor:
    """Sum ``[..., ranks * local_slots]`` per rank, adding slots in order: ``[..., ranks]``."""
    grouped = values.reshape(*values.shape[:-1], -1, local_slots)
    total = grouped[..., 0].clone()
    for index in range(1, local_slots):
        total += grouped[..., index]
    return total


def rank_loads(
    p2l: torch.Tensor, load: torch.Tensor, num_logical: int, local_slots: int
) -> torch.Tensor:
    """Load of every EP rank, float64 ``[layers, ep_size]`` (dead ranks hold -1 slots: 0)."""
    counts = replica_counts(p2l, num_logical)
    return rank_sums(slot_loads(p2l, load, counts), local_slots)


def balancedness(
    p2l: torch.Tensor,
    load: torch.Tensor,
    *,
    num_logical: int,
    local_slots: int,
    dead_ep_ranks: Iterable[int] = (),
) -> float:
    """vLLM's EPLB balancedness over live ranks: ``sum_layers mean / sum_layers max``.

    1.0 is perfect balance. Slots of ``dead_ep_ranks`` are ignored whatever they hold.
    Raises ``PreconditionFailed`` for a dead rank out of range or no live rank.
    """
    ep_size = p2l.shape[1] // local_slots
    live = torch.ones(ep_size, dtype=torch.bool)
    live[sorted(check_ep_ranks(dead_ep_ranks, ep_size))] = False
    masked = p2l.clone()
    masked[:, ~live.repeat_interleave(local_slots)] = -1
    loads = rank_loads(masked, load, num_logical, local_slots)[:, live]
    peak = float(loads.max(dim=1).values.sum())
    return float(loads.mean(dim=1).sum()) / peak if peak > 0 else 1.0


def orphans_after_failure(
    p2l: torch.Tensor, num_logical: int, local_slots: int, dead_ep_ranks: Iterable[int]
) -> int:
    """(layer, expert) pairs left with no live replica when ``dead_ep_ranks`` fail."""
    masked = p2l.clone()
    for rank in frozenset(dead_ep_ranks):
        masked[:, rank * local_slots : (rank + 1) * local_slots] = -1
    return int((replica_counts(masked, num_logical) == 0).sum())


def _presence(placement: ExpertPlacement) -> torch.Tensor:
    """bool ``[layers, ep_size, num_logical]``: does the rank hold the expert in that layer."""
    p2l = placement.physical_to_logical_map.cpu()
    layers, ep, experts = placement.num_layers, placement.ep_size, placement.num_logical
    ranks = placement.slot_ranks().unsqueeze(0).expand_as(p2l)
    held = p2l >= 0
    layer_ids = torch.arange(layers).unsqueeze(1).expand_as(p2l)
    presence = torch.zeros(layers, ep, experts, dtype=torch.bool)
    presence[layer_ids[held], ranks[held], p2l[held]] = True
    return presence


def _fragile_ranks(presence: torch.Tensor, rank_count: torch.Tensor) -> torch.Tensor:
    """bool ``[ep_size]``: ranks whose loss alone orphans some (layer, expert)."""
    only_here = presence & (rank_count == 1).unsqueeze(1)
    return only_here.any(dim=2).any(dim=0)


def zero_reload_fraction(placement: ExpertPlacement, k: int) -> float:
    """Fraction of k-rank failure sets (k = 1 or 2) that leave every expert a live replica.

    A failure set counts only if it needs zero reloads in every layer.
    """
    presence = _presence(placement)
    rank_count = presence.sum(dim=1)  # [layers, experts]: distinct ranks holding it
    fragile = _fragile_ranks(presence, rank_count)
    ep = placement.ep_size
    if k == 1:
        return 1.0 - float(fragile.float().mean()) if ep >= 2 else 0.0
    if k != 2:
        raise ConfigError(f"k must be 1 or 2, got {k}")
    if ep < 3:
        return 0.0
    broken = fragile.unsqueeze(0) | fragile.unsqueeze(1)
    # An expert on exactly two ranks is orphaned when exactly that pair fails.
    doubled = presence & (rank_count == 2).unsqueeze(1)
    layer_ids, _, expert_ids = doubled.nonzero(as_tuple=True)
    if layer_ids.numel():
        held = doubled[layer_ids, :, expert_ids].to(torch.int8)  # [n, ep]
        first = held.argmax(dim=1)
        last = ep - 1 - held.flip(1).argmax(dim=1)
        broken[first, last] = True
        broken[last, first] = True
    upper = torch.triu(torch.ones(ep, ep, dtype=torch.bool), diagonal=1)
    return 1.0 - float((broken & upper).sum()) / math.comb(ep, 2)


def zero_reload_bound(num_logical: int, num_physical: int, ep_size: int, k: int) -> float:
    """Upper bound on ``zero_reload_fraction`` for any placement of this shape.

    k = 1: a rank needs no reload iff each of its experts has a replica elsewhere. With
    ``R = P - E`` redundant slots and ``L`` slots per rank, z such ranks hold ``zL`` slots
    of experts that also live elsewhere: one rank needs ``R >= L``; z >= 2 ranks can share
    experts pairwise, needing ``ceil(zL / 2)`` doubled experts, so ``R >= zL / 2``. Hence
    ``z <= min(W, floor(2R / L))`` (0 if ``R < L``), reached by the failure-aware layout;
    it is ``W`` (100 %) once ``P >= 2E``.

    k = 2: a valid, not always tight bound. A pair that needs no reload has ``2L`` slots
    whose experts all live elsewhere too, which takes ``R >= 2L``; such pairs are among
    the single-failure-safe ranks, so at most ``C(z, 2)``. Of ``E`` experts, ``t`` may
    have >= 3 replicas, ``d`` exactly 2, ``s`` one (``d + 2t <= R``); each pair of ranks
    holds at most ``L`` doubled experts, so >= ``ceil(d / L)`` pairs break, and a rank
    holding a single breaks every pair it is in. Minimise the broken pairs over ``t``.
    """
    if k not in (1, 2):
        raise ConfigError(f"k must be 1 or 2, got {k}")
    local = num_physical // ep_size
    redundant = num_physical - num_logical
    if ep_size < k + 1:
        return 0.0
    zero_ranks = min(ep_size, (2 * redundant) // local) if redundant >= local else 0
    if k == 1:
        return zero_ranks / ep_size
    if redundant < 2 * local:
        return 0.0
    pairs = math.comb(ep_size, 2)
    least_broken = pairs
    for triples in range(min(num_logical, redundant // 2) + 1):
        doubles = min(redundant - 2 * triples, num_logical - triples)
        singles = num_logical - triples - doubles
        single_ranks = min(ep_size, -(-singles // local))
        broken_by_singles = pairs - math.comb(ep_size - single_ranks, 2)
        least_broken = min(least_broken, max(broken_by_singles, -(-doubles // local)))
    return min(math.comb(zero_ranks, 2), pairs - least_broken) / pairs
