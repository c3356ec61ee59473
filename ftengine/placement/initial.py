"""Initial expert placements: vLLM's default, load-balanced, and failure-aware.

``failure-aware`` lays replicas out so that as many single-rank failures as the
redundancy allows (see ``scoring.zero_reload_bound``) need no reload at all, and then
groups copies so that few rank pairs share an expert's only two replicas.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ftengine.errors import ConfigError
from ftengine.placement.loads import normalize_load
from ftengine.placement.maps import ExpertPlacement, check_layout
from ftengine.placement.rebalance import greedy_rebalance


def default_placement(
    num_layers: int, num_logical: int, num_redundant: int, ep_size: int, load: torch.Tensor | None
) -> ExpertPlacement:
    """vLLM's initial placement (``load`` is ignored): redundant copies appended at the tail."""
    return ExpertPlacement.default(num_layers, num_logical, num_redundant, ep_size)


def balanced_placement(
    num_layers: int, num_logical: int, num_redundant: int, ep_size: int, load: torch.Tensor | None
) -> ExpertPlacement:
    """EPLB-style load-aware placement of ``load [layers, E]`` (uniform when ``None``)."""
    check_layout(num_layers, num_logical, num_redundant, ep_size)
    loads = normalize_load(load, num_layers, num_logical)
    local = (num_logical + num_redundant) // ep_size
    p2l = greedy_rebalance(loads, ep_size, local)
    return ExpertPlacement.from_physical_to_logical(p2l, num_logical=num_logical, ep_size=ep_size)


def failure_aware_placement(
    num_layers: int, num_logical: int, num_redundant: int, ep_size: int, load: torch.Tensor | None
) -> ExpertPlacement:
    """Place replicas so the most single-rank (then two-rank) failures need zero reloads.

    With ``load`` the hottest experts of each layer get the extra replicas.
    """
    check_layout(num_layers, num_logical, num_redundant, ep_size)
    if load is None:
        row = failure_aware_row(list(range(num_logical)), num_redundant, ep_size)
        p2l = torch.tensor(row, dtype=torch.int64).repeat(num_layers, 1)
    else:
        loads = normalize_load(load, num_layers, num_logical)
        orders = torch.argsort(-loads, dim=1, stable=True).tolist()
        rows = [failure_aware_row(order, num_redundant, ep_size) for order in orders]
        p2l = torch.tensor(rows, dtype=torch.int64)
    return ExpertPlacement.from_physical_to_logical(p2l, num_logical=num_logical, ep_size=ep_size)


def failure_aware_row(order: list[int], num_redundant: int, ep_size: int) -> list[int]:
    """One layer's slot map; ``order`` lists the experts, first ones replicated first.

    ``P >= 2E``: whole copies of ``order`` back to back (copies of an expert sit ``E``
    slots apart, so on different ranks). Otherwise ``z = floor(2R / L)`` ranks are
    filled with a block ``B`` of ``ceil(zL / 2)`` experts laid out twice (``B + B``): each
    of those ranks only holds experts with a copy elsewhere. Spare redundancy then goes to
    third copies of whole twin-rank groups (helps two-rank failures) and to second copies.
    """
    experts = len(order)
    physical = experts + num_redundant
    local = physical // ep_size
    if num_redundant >= experts:
        whole, rest = divmod(physical, experts)
        return order * whole + order[:rest]
    zero_ranks = min(ep_size, (2 * num_redundant) // local) if num_redundant >= local else 0
    if zero_ranks == 0:
        return order + [order[i % experts] for i in range(num_redundant)]
    block_size = -(-zero_ranks * local // 2)
    block = order[:block_size]
    spare = num_redundant - block_size
    thirds: list[int] = []
    if block_size % local == 0:
        # Twin ranks j and j + block_size / L hold the same experts; a third copy of a
        # twin group saves the one pair failure that would orphan it.
        for start in range(0, block_size, local):
            if spare < local:
                break
            thirds += block[start : start + local]
            spare -= local
    doubles = order[block_size : block_size + spare]
    singles = order[block_size + spare :]
    return block + block + doubles + thirds + singles + doubles


Factory = Callable[[int, int, int, int, "torch.Tensor | None"], ExpertPlacement]

PLACEMENTS: dict[str, Factory] = {
    "default": default_placement,
    "balanced": balanced_placement,
    "failure-aware": failure_aware_placement,
}


def make_placement(
    kind: str,
    num_layers: int,
    num_logical: int,
    num_redundant: int,
    ep_size: int,
    load: torch.Tensor | None = None,
) -> ExpertPlacement:
    """Build the initial placement named ``kind`` (a key of ``PLACEMENTS``)."""
    factory = PLACEMENTS.get(kind)
    if factory is None:
        raise ConfigError(f"unknown placement {kind!r}; expected one of {sorted(PLACEMENTS)}")
    return factory(num_layers, num_logical, num_redundant, ep_size, load)
