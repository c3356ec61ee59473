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
    """One round's view of the state, shared by the two candidate builders."""

    slot_load: torch.Tensor  # [layers, P]
    rank_load: torch.Tensor  # [layers, W]
    peak: torch.Tensor  # [layers]
    peak_load: torch.Tensor  # [layers, 1]
    peak_slots: torch.Tensor  # [layers, L]
    changed: torch.Tensor  # [layers, P] bool
    multiplicity: torch.Tensor  # [layers, P]: copies of the slot's expert on its rank
    tolerance: torch.Tensor  # [layers, 1]


def improve_balance(state: PlanState, budget: int, lower_bound: int) -> None:
    """Apply peak-lowering moves while reloads stay within ``lower_bound + budget``."""
    for _ in range(_MAX_ROUNDS):
        view = _observe(state)
        remaining = lower_bound + budget - int(view.changed.sum())
        swap_gain, swap_cost = _swap_candidates(state, view)
        rep_gain, rep_cost, hot = _replica_candidates(state, view)
        gain = torch.cat([swap_gain.flatten(1), rep_gain], dim=1)
        cost = torch.cat([swap_cost.flatten(1), rep_cost], dim=1)
        worth = torch.where(cost <= remaining, gain / cost.clamp(min=1), -_INF)
        best_worth, best = worth.max(dim=1)
        chosen = _within_budget(best_worth, cost.gather(1, best.unsqueeze(1)).squeeze(1), remaining)
        if not chosen:
            return
        _apply_moves(state, view, chosen, best, hot)


def _observe(state: PlanState) -> _Round:
    local = state.local_slots
    slot_load = state.slot_loads()
    rank_load = rank_sums(slot_load, local)
    live_rank = state.live.view(-1, local)[:, 0]
    peak = torch.where(live_rank, rank_load, -_INF).argmax(dim=1)
    peak_load = rank_load.gather(1, peak.unsqueeze(1))
    grouped = state.slots.view(state.slots.shape[0], -1, local)
    multiplicity = (grouped.unsqueeze(-1) == grouped.unsqueeze(-2)).sum(-1).flatten(1)
    return _Round(
        slot_load=slot_load,
        rank_load=rank_load,
        peak=peak,
        peak_load=peak_load,
        peak_slots=peak.unsqueeze(1) * local + torch.arange(local),
        changed=state.changed(),
        multiplicity=multiplicity,
        tolerance=peak_load * _REL_TOL,
    )


def _swap_candidates(state: PlanState, view: _Round) -> tuple[torch.Tensor, torch.Tensor]:
    """Gain and reload cost of swapping peak slot ``a`` with slot ``b``: ``[layers, L, P]``."""
    a_expert = state.slots.gather(1, view.peak_slots).unsqueeze(2)
    a_load = view.slot_load.gather(1, view.peak_slots).unsqueeze(2)
    b_expert, b_load = state.slots.unsqueeze(1), view.slot_load.unsqueeze(1)
    b_rank_load = view.rank_load[:, state.slot_rank].unsqueeze(1)
    peak_load = view.peak_load.unsqueeze(2)
    worst = torch.maximum(peak_load - a_load + b_load, b_rank_load - b_load + a_load)
    gain = peak_load - worst
    valid = (
        (a_expert >= 0)
        & (b_expert >= 0)
        & state.live
        & (state.slot_rank != view.peak.view(-1, 1, 1))
        & (a_expert != b_expert)
        & (gain > view.tolerance.unsqueeze(2))
    )
    a_original = state.original.gather(1, view.peak_slots).unsqueeze(2)
    a_changed = view.changed.gather(1, view.peak_slots).unsqueeze(2)
    cost = (
        (b_expert != a_original).long()
        + (a_expert != state.original.unsqueeze(1)).long()
        - a_changed.long()
        - view.changed.unsqueeze(1).long()
    )
    return torch.where(valid, gain, -_INF), cost


def _replica_candidates(
    state: PlanState, view: _Round
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gain and cost ``[layers, P]`` of one more replica of the peak's hottest expert in ``b``.

    Also returns that expert per layer. Ranks that hold ``b``'s expert are scored
    conservatively: each is assumed to take the full extra load.
    """
    rows = state.rows
    peak_slot_load = view.slot_load.gather(1, view.peak_slots)
    hot_index = peak_slot_load.argmax(dim=1, keepdim=True)
    hot_slot = view.peak_slots.gather(1, hot_index).squeeze(1)
    hot = state.slots[rows, hot_slot]
    hot_count = state.counts[rows, hot.clamp(min=0)].to(state.load.dtype)
    hot_load = state.load[rows, hot.clamp(min=0)]
    hot_share = (hot_load / (hot_count + 1)).unsqueeze(1)
    relief = view.multiplicity[rows, hot_slot] * (hot_load / hot_count - hot_share.squeeze(1))
    new_peak = view.peak_load - relief.unsqueeze(1)

    donor = state.slots.clamp(min=0)
    empty = state.slots < 0
    donor_count = state.counts.gather(1, donor).to(state.load.dtype)
    donor_load = state.load.gather(1, donor)
    donor_share = torch.where(empty, 0.0, donor_load / donor_count.clamp(min=1))
    after = torch.where(empty, 0.0, donor_load / (donor_count - 1).clamp(min=1))
    rise = after - donor_share
    b_rank_load = view.rank_load[:, state.slot_rank]
    new_b = b_rank_load - donor_share + hot_share + (view.multiplicity - 1) * rise
    donor_peak = _donor_peaks(state, b_rank_load + view.multiplicity * rise)
    worst = torch.maximum(torch.maximum(new_peak, new_b), donor_peak)
    gain = view.peak_load - worst
    grouped = state.slots.view(state.slots.shape[0], -1, state.local_slots)
    holds_hot = (grouped == hot.view(-1, 1, 1)).any(dim=2)[:, state.slot_rank]
    valid = (
        ((hot >= 0) & (hot_count < state.max_replicas)).unsqueeze(1)
        & state.live
        & (state.slot_rank != view.peak.unsqueeze(1))
        & ~holds_hot
        & (empty | (donor_count >= 2))
        & (gain > view.tolerance)
    )
    cost = (hot.unsqueeze(1) != state.original).long() - view.changed.long()
    return torch.where(valid, gain, -_INF), cost, hot


def _donor_peaks(state: PlanState, raised: torch.Tensor) -> torch.Tensor:
    """For each slot, the highest raised load over ranks holding its expert; -inf if empty."""
    num_logical = state.counts.shape[1]
    held = state.slots >= 0
    values = torch.where(held, raised, -_INF)
    peaks = torch.full((state.slots.shape[0], num_logical), -_INF, dtype=raised.dtype)
    peaks.scatter_reduce_(1, state.slots.clamp(min=0), values, reduce="amax")
    return torch.where(held, peaks.gather(1, state.slots.clamp(min=0)), -_INF)


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
    num_physical = state.slots.shape[1]
    swap_width = view.peak_slots.shape[1] * num_physical
    for layer in layers:
        index = int(best[layer])
        if index < swap_width:
            a = int(view.peak_slots[layer, index // num_physical])
            b = index % num_physical
            a_expert, b_expert = int(state.slots[layer, a]), int(state.slots[layer, b])
            state.slots[layer, a], state.slots[layer, b] = b_expert, a_expert
            continue
        b = index - swap_width
        donor, expert = int(state.slots[layer, b]), int(hot[layer])
        state.slots[layer, b] = expert
        state.counts[layer, expert] += 1
        if donor >= 0:
            state.counts[layer, donor] -= 1
