"""Balance beyond the minimum: a peak-lowering local search with a reload budget.

Each round looks, in every layer, at the most loaded rank and scores two kinds of move:
swap one of its slots with a slot elsewhere (replica counts unchanged), or give its
heaviest expert one more replica in a slot whose expert keeps another replica (or an
empty slot). A move is kept only if the peak rank gets lighter and no rank it touches
reaches the old peak, so the sorted load vector falls at every step and the search ends.
Moves that re-use already-reloaded slots cost nothing; others spend the budget.
"""

from __future__ import annotations

import attrs
import torch

from ftengine.placement.minimal import PlanState
from ftengine.placement.scoring import rank_sums

_INF = float("inf")
_REL_TOL = 1e-9
_MAX_ROUNDS = 100_000  # a safety net only: every accepted move strictly lowers a load vector


@attrs.frozen
class _Round:
    """One round's view of the state, shared by the candidate builders.

    Moves pair a slot ``a`` of the peak rank with a slot ``b`` from ``columns`` (every
    slot, or only already-reloaded ones once the budget is spent: only those can give
    free moves). Tensors named ``b_*`` are ``[layers, K]``, one entry per column.
    """

    slot_load: torch.Tensor  # [layers, P]
    rank_load: torch.Tensor  # [layers, W]
    peak: torch.Tensor  # [layers]
    peak_load: torch.Tensor  # [layers, 1]
    runner_up: torch.Tensor  # [layers, 1]: the second highest rank load
    peak_slots: torch.Tensor  # [layers, L]
    changed: torch.Tensor  # [layers, P] bool
    multiplicity: torch.Tensor  # [layers, P]: copies of the slot's expert on its rank
    tolerance: torch.Tensor  # [layers, 1]
    columns: torch.Tensor  # [layers, K] slot ids
    b_ok: torch.Tensor  # [layers, K]: a live slot (not padding)
    b_expert: torch.Tensor
    b_load: torch.Tensor
    b_rank: torch.Tensor
    b_rank_load: torch.Tensor
    b_original: torch.Tensor
    b_changed: torch.Tensor
    b_multiplicity: torch.Tensor


def improve_balance(state: PlanState, budget: int, lower_bound: int) -> None:
    """Apply peak-lowering moves while reloads stay within ``lower_bound + budget``."""
    for _ in range(_MAX_ROUNDS):
        changed = state.changed()
        remaining = lower_bound + budget - int(changed.sum())
        view = _observe(state, changed, only_changed=remaining <= 0)
        swap_gain, swap_cost = _swap_candidates(state, view)
        rep_gain, rep_cost, hot = _replica_candidates(state, view)
        gain = torch.cat([swap_gain.flatten(1), rep_gain], dim=1)
        cost = torch.cat([swap_cost.flatten(1), rep_cost], dim=1)
        worth = torch.where(cost <= remaining, _worth(gain, cost, view), -_INF)
        best_worth, best = worth.max(dim=1)
        best_cost = cost.gather(1, best.unsqueeze(1)).squeeze(1)
        chosen = _within_budget(best_worth, best_cost, remaining)
        if not chosen:
            return
        _apply_moves(state, view, chosen, best, hot)


def _worth(gain: torch.Tensor, cost: torch.Tensor, view: _Round) -> torch.Tensor:
    """Value per reload of each move; the same scale across layers.

    Only the part of a gain that lowers the layer's maximum (down to the runner-up rank)
    counts fully, the rest breaks ties; dividing by the squared cost spends the budget on
    cheap fixes first, which measured better than gain per reload.
    """
    useful = torch.minimum(gain, view.peak_load - view.runner_up) + 1e-3 * gain
    return useful / cost.clamp(min=1).to(gain.dtype) ** 2


def _observe(state: PlanState, changed: torch.Tensor, *, only_changed: bool) -> _Round:
    local = state.local_slots
    layers, num_physical = state.slots.shape
    slot_load = state.slot_loads()
    rank_load = rank_sums(slot_load, local)
    live_rank = state.live.view(-1, local)[:, 0]
    ranked = torch.where(live_rank, rank_load, -_INF)
    peak = ranked.argmax(dim=1)
    peak_load = rank_load.gather(1, peak.unsqueeze(1))
    others = ranked.scatter(1, peak.unsqueeze(1), -_INF)
    grouped = state.slots.view(layers, -1, local)
    multiplicity = (grouped.unsqueeze(-1) == grouped.unsqueeze(-2)).sum(-1).flatten(1)
    if only_changed:
        width = max(int(changed.sum(dim=1).max()), 1)
        columns = torch.argsort((~changed).to(torch.int8), dim=1, stable=True)[:, :width]
        b_ok = changed.gather(1, columns)
    else:
        columns = torch.arange(num_physical).expand(layers, -1)
        b_ok = state.live.expand(layers, -1)
    b_rank = state.slot_rank[columns]
    return _Round(
        slot_load=slot_load,
        rank_load=rank_load,
        peak=peak,
        peak_load=peak_load,
        runner_up=others.max(dim=1, keepdim=True).values,
        peak_slots=peak.unsqueeze(1) * local + torch.arange(local),
        changed=changed,
        multiplicity=multiplicity,
        tolerance=peak_load * _REL_TOL,
        columns=columns,
        b_ok=b_ok & (b_rank != peak.unsqueeze(1)),
        b_expert=state.slots.gather(1, columns),
        b_load=slot_load.gather(1, columns),
        b_rank=b_rank,
        b_rank_load=rank_load.gather(1, b_rank),
        b_original=state.original.gather(1, columns),
        b_changed=changed.gather(1, columns),
        b_multiplicity=multiplicity.gather(1, columns),
    )


def _swap_candidates(state: PlanState, view: _Round) -> tuple[torch.Tensor, torch.Tensor]:
    """Gain and reload cost of swapping peak slot ``a`` with column ``b``: ``[layers, L, K]``."""
    a_expert = state.slots.gather(1, view.peak_slots).unsqueeze(2)
    a_load = view.slot_load.gather(1, view.peak_slots).unsqueeze(2)
    b_expert, b_load = view.b_expert.unsqueeze(1), view.b_load.unsqueeze(1)
    peak_load = view.peak_load.unsqueeze(2)
    new_b = view.b_rank_load.unsqueeze(1) - b_load + a_load
    gain = peak_load - torch.maximum(peak_load - a_load + b_load, new_b)
    valid = (
        (a_expert >= 0)
        & (b_expert >= 0)
        & view.b_ok.unsqueeze(1)
        & (a_expert != b_expert)
        & (gain > view.tolerance.unsqueeze(2))
    )
    a_original = state.original.gather(1, view.peak_slots).unsqueeze(2)
    a_changed = view.changed.gather(1, view.peak_slots).unsqueeze(2)
    cost = (
        (b_expert != a_original).long()
        + (a_expert != view.b_original.unsqueeze(1)).long()
        - a_changed.long()
        - view.b_changed.unsqueeze(1).long()
    )
    return torch.where(valid, gain, -_INF), cost


def _replica_candidates(
    state: PlanState, view: _Round
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gain and cost ``[layers, K]`` of one more replica of the peak's hottest expert in ``b``.

    Also returns that expert per layer. Ranks that hold ``b``'s expert are scored
    conservatively: each is assumed to take the full extra load.
    """
    rows = state.rows
    hot_index = view.slot_load.gather(1, view.peak_slots).argmax(dim=1, keepdim=True)
    hot_slot = view.peak_slots.gather(1, hot_index).squeeze(1)
    hot = state.slots[rows, hot_slot]
    hot_count = state.counts[rows, hot.clamp(min=0)].to(state.load.dtype)
    hot_load = state.load[rows, hot.clamp(min=0)]
    hot_share = (hot_load / (hot_count + 1)).unsqueeze(1)
    relief = view.multiplicity[rows, hot_slot] * (hot_load / hot_count - hot_share.squeeze(1))
    new_peak = view.peak_load - relief.unsqueeze(1)

    donor = view.b_expert.clamp(min=0)
    empty = view.b_expert < 0
    donor_count = state.counts.gather(1, donor).to(state.load.dtype)
    donor_load = state.load.gather(1, donor)
    donor_share = torch.where(empty, 0.0, donor_load / donor_count.clamp(min=1))
    rise = torch.where(empty, 0.0, donor_load / (donor_count - 1).clamp(min=1)) - donor_share
    m = view.b_multiplicity
    new_b = view.b_rank_load - donor_share + hot_share + (m - 1) * rise
    donor_peak = _donor_peaks(state, view).gather(1, donor)
    donor_peak = torch.where(empty, -_INF, donor_peak)
    gain = view.peak_load - torch.maximum(torch.maximum(new_peak, new_b), donor_peak)
    grouped = state.slots.view(state.slots.shape[0], -1, state.local_slots)
    holds_hot = (grouped == hot.view(-1, 1, 1)).any(dim=2).gather(1, view.b_rank)
    valid = (
        ((hot >= 0) & (hot_count < state.max_replicas)).unsqueeze(1)
        & view.b_ok
        & ~holds_hot
        & (empty | (donor_count >= 2))
        & (gain > view.tolerance)
    )
    cost = (hot.unsqueeze(1) != view.b_original).long() - view.b_changed.long()
    return torch.where(valid, gain, -_INF), cost, hot


def _donor_peaks(state: PlanState, view: _Round) -> torch.Tensor:
    """Per expert ``[layers, E]``: the highest load of a rank holding it, if it lost a replica.

    Each such rank is assumed to take the whole rise of every copy it holds.
    """
    held = state.slots >= 0
    expert = state.slots.clamp(min=0)
    count = state.counts.gather(1, expert).to(state.load.dtype)
    load = state.load.gather(1, expert)
    rise = load / (count - 1).clamp(min=1) - load / count.clamp(min=1)
    on_rank = view.rank_load[:, state.slot_rank]
    values = torch.where(held, on_rank + view.multiplicity * rise, -_INF)
    peaks = torch.full_like(state.load, -_INF)
    return peaks.scatter_reduce_(1, expert, values, reduce="amax")


def _within_budget(worth: torch.Tensor, cost: torch.Tensor, remaining: int) -> list[int]:
    """Layers whose best move is taken this round: most worth first while the budget lasts."""
    chosen = []
    for layer in torch.argsort(worth, descending=True, stable=True).tolist():
        move_cost = int(cost[layer])
        if worth[layer] == -_INF:
            break
        if move_cost <= remaining:
            chosen.append(layer)
            remaining -= move_cost
    return sorted(chosen)


def _apply_moves(
    state: PlanState, view: _Round, layers: list[int], best: torch.Tensor, hot: torch.Tensor
) -> None:
    width = view.columns.shape[1]
    swap_width = view.peak_slots.shape[1] * width
    for layer in layers:
        index = int(best[layer])
        if index < swap_width:
            a = int(view.peak_slots[layer, index // width])
            b = int(view.columns[layer, index % width])
            a_expert, b_expert = int(state.slots[layer, a]), int(state.slots[layer, b])
            state.slots[layer, a], state.slots[layer, b] = b_expert, a_expert
            continue
        b = int(view.columns[layer, index - swap_width])
        donor, expert = int(state.slots[layer, b]), int(hot[layer])
        state.slots[layer, b] = expert
        state.counts[layer, expert] += 1
        if donor >= 0:
            state.counts[layer, donor] -= 1
