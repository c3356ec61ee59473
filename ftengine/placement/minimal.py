"""The minimal redistribution: every orphaned expert gets exactly one spare slot.

Spares come from experts that keep at least one other live replica. Which replicas give
up their slot, and which orphan goes where, is chosen greedily for balance; all layers are
processed together, one greedy step per iteration.
"""

from __future__ import annotations

import attrs
import torch

from ftengine.placement.maps import EMPTY
from ftengine.placement.scoring import rank_sums, replica_counts, slot_loads

_INF = float("inf")


@attrs.define(eq=False)
class PlanState:
    """The working slot map of a plan, on CPU, mutated as the planner decides.

    ``slots [layers, P]`` (dead slots -1), ``original [layers, P]``, ``counts [layers, E]``
    (live replicas), ``load [layers, E]`` float64, ``live [P]`` bool, ``slot_rank [P]``.
    """

    slots: torch.Tensor
    original: torch.Tensor
    counts: torch.Tensor
    load: torch.Tensor
    live: torch.Tensor
    slot_rank: torch.Tensor
    local_slots: int
    max_replicas: int

    @classmethod
    def start(
        cls,
        p2l: torch.Tensor,
        live: torch.Tensor,
        load: torch.Tensor,
        *,
        local_slots: int,
        max_replicas: int,
    ) -> PlanState:
        """Mask dead slots of ``p2l`` and count the live replicas."""
        original = p2l.detach().to("cpu", copy=True)
        slots = original.clone()
        slots[:, ~live] = EMPTY
        num_logical = load.shape[1]
        slot_rank = torch.arange(p2l.shape[1]) // local_slots
        counts = replica_counts(slots, num_logical)
        return cls(slots, original, counts, load, live, slot_rank, local_slots, max_replicas)

    @property
    def rows(self) -> torch.Tensor:
        """Layer indices ``[layers]``."""
        return torch.arange(self.slots.shape[0])

    def slot_loads(self) -> torch.Tensor:
        """Load each slot serves now, float64 ``[layers, P]``."""
        return slot_loads(self.slots, self.load, self.counts)

    def rank_loads(self) -> torch.Tensor:
        """Load of each rank now, float64 ``[layers, ranks]`` (deterministic order)."""
        return rank_sums(self.slot_loads(), self.local_slots)

    def changed(self) -> torch.Tensor:
        """bool ``[layers, P]``: live slots that will hold a different expert (a reload)."""
        return self.live & (self.slots >= 0) & (self.slots != self.original)


def free_donor_slots(state: PlanState, needed: torch.Tensor, incoming: torch.Tensor) -> None:
    """Empty ``needed[layer]`` live slots per layer, taken from experts with >= 2 replicas.

    Freeing a replica raises the ranks holding the expert's other replicas, and the freed
    slot's rank will take an orphan (``incoming [layers, steps]``: orphan loads, heaviest
    first, reserved on that rank now). Each step frees the slot that keeps the highest of
    those ranks lowest (ties: the slot on the rank with the fewest slots freed so far in
    that layer, so that the reloads, and with them the repair time, are spread over the
    survivors; then the most loaded rank; then the lowest slot).
    """
    rows = state.rows
    loads = state.rank_loads()
    freed = torch.zeros_like(loads)
    cap = replica_load_cap(state.load, state.counts, needed)
    for step in range(int(needed.max()) if needed.numel() else 0):
        active = needed > step
        reserve = incoming[:, min(step, incoming.shape[1] - 1)]
        slot, expert, share, rise = _pick_donor(state, loads, reserve, cap, freed)
        rows_now, slot_now, expert_now = rows[active], slot[active], expert[active]
        state.slots[rows_now, slot_now] = EMPTY
        state.counts[rows_now, expert_now] -= 1
        holders = (state.slots == expert.unsqueeze(1)) & active.unsqueeze(1)
        raised = torch.where(holders, rise.unsqueeze(1), torch.zeros_like(share).unsqueeze(1))
        # Every addend to one rank is the same value, so the order of the adds is moot.
        loads.scatter_add_(1, state.slot_rank.expand_as(raised), raised)
        rank_now = state.slot_rank[slot_now]
        loads[rows_now, rank_now] -= share[active]
        loads[rows_now, rank_now] += reserve[active]
        freed[rows_now, rank_now] += 1


def replica_load_cap(
    load: torch.Tensor, counts: torch.Tensor, needed: torch.Tensor
) -> torch.Tensor:
    """Per layer, the least possible max load per replica after ``needed`` donations.

    Greedily donating from the expert whose load per replica stays lowest minimises the
    maximum (each expert's successive costs grow), so its result is the cap ``[layers, 1]``.
    Any donation order that keeps every expert at or under the cap can still finish.
    """
    counts = counts.clone()
    rows = torch.arange(counts.shape[0])
    after = load / (counts - 1).clamp(min=1).to(load.dtype)
    for step in range(int(needed.max()) if needed.numel() else 0):
        active = needed > step
        cost = torch.where(counts >= 2, after, _INF)
        donor = cost.argmin(dim=1)[active]
        counts[rows[active], donor] -= 1
        after[rows[active], donor] = load[rows[active], donor] / (
            (counts[rows[active], donor] - 1).clamp(min=1).to(load.dtype)
        )
    per_replica = torch.where(counts > 0, load / counts.clamp(min=1).to(load.dtype), 0.0)
    return per_replica.max(dim=1, keepdim=True).values


def _pick_donor(
    state: PlanState,
    loads: torch.Tensor,
    reserve: torch.Tensor,
    cap: torch.Tensor,
    freed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per layer: the slot to free, its expert, that replica's load and the others' rise.

    ``freed [layers, ranks]`` counts the slots already freed on each rank (tie-break).
    """
    held = state.slots.clamp(min=0)
    count = state.counts.gather(1, held).to(state.load.dtype)
    expert_load = state.load.gather(1, held)
    share = expert_load / count
    # The same division as replica_load_cap's, so the cap comparison is exact.
    after = expert_load / (count - 1).clamp(min=1)
    rise = after - share
    on_rank = loads[:, state.slot_rank]
    donor = (state.slots >= 0) & (count >= 2) & (after <= cap)
    raised = torch.where(donor, on_rank + rise, -_INF)
    others = _peak_of_other_replicas(state.slots, raised, state.counts.shape[1])
    own = on_rank - share + reserve.unsqueeze(1)
    score = torch.where(donor, torch.maximum(others, own), _INF)
    best = score.min(dim=1, keepdim=True).values
    tied = donor & (score == best)
    freed_on = freed[:, state.slot_rank]
    fewest = torch.where(tied, freed_on, _INF).min(dim=1, keepdim=True).values
    tied &= freed_on == fewest
    slot = torch.where(tied, on_rank, -_INF).argmax(dim=1)
    rows = state.rows
    return slot, state.slots[rows, slot], share[rows, slot], rise[rows, slot]


def _peak_of_other_replicas(
    slots: torch.Tensor, values: torch.Tensor, num_logical: int
) -> torch.Tensor:
    """For each slot, the max of ``values`` over the OTHER slots holding the same expert."""
    layers, num_physical = slots.shape
    held = slots.clamp(min=0)
    first = torch.full((layers, num_logical), -_INF, dtype=values.dtype)
    first.scatter_reduce_(1, held, values, reduce="amax")
    at_first = values == first.gather(1, held)
    slot_ids = torch.arange(num_physical).expand(layers, -1)
    first_slot = torch.full((layers, num_logical), num_physical, dtype=torch.int64)
    first_slot.scatter_reduce_(
        1, held, torch.where(at_first, slot_ids, num_physical), reduce="amin"
    )
    is_first = slot_ids == first_slot.gather(1, held)
    second = torch.full((layers, num_logical), -_INF, dtype=values.dtype)
    second.scatter_reduce_(1, held, torch.where(is_first, -_INF, values), reduce="amax")
    return torch.where(is_first, second.gather(1, held), first.gather(1, held))


def place_orphans(state: PlanState, orphans: torch.Tensor) -> None:
    """Put every orphan (``orphans [layers, E]`` bool) into a free live slot, heaviest first.

    Each goes to the free slot on the currently least loaded rank (ties: lowest slot).
    """
    rows = state.rows
    per_layer = orphans.sum(dim=1)
    key = torch.where(orphans, -state.load, torch.full_like(state.load, _INF))
    order = torch.argsort(key, dim=1, stable=True)
    loads = state.rank_loads()
    free = state.live & (state.slots < 0)
    for step in range(int(per_layer.max()) if per_layer.numel() else 0):
        active = per_layer > step
        expert = order[:, step]
        on_rank = loads[:, state.slot_rank]
        slot = torch.where(free, on_rank, _INF).argmin(dim=1)
        rows_now, slot_now, expert_now = rows[active], slot[active], expert[active]
        state.slots[rows_now, slot_now] = expert_now
        free[rows_now, slot_now] = False
        state.counts[rows_now, expert_now] = 1
        rank_now = state.slot_rank[slot_now]
        loads[rows_now, rank_now] += state.load[rows_now, expert_now]


def minimal_plan(state: PlanState) -> int:
    """Re-home every orphan of ``state`` with exactly one reload each; return that count."""
    orphans = state.counts == 0
    per_layer = orphans.sum(dim=1)
    empty_live = (state.live & (state.slots < 0)).sum(dim=1)
    heaviest = torch.where(orphans, state.load, torch.zeros_like(state.load))
    incoming = heaviest.sort(dim=1, descending=True, stable=True).values
    free_donor_slots(state, (per_layer - empty_live).clamp(min=0), incoming)
    place_orphans(state, orphans)
    return int(per_layer.sum())
