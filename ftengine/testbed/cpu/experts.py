"""One CPU worker's experts: EPLB placement, slot storage, elastic_info and in-place repair.

The worker holds the slots ``[rank * L, (rank + 1) * L)`` of the physical expert space
(``L`` local slots). Scale-down masks dead EP ranks in elastic_info, lets the placement
planner (deterministic, so every survivor computes the same plan alone) re-host the
experts left without a replica, and reloads only the re-hosted (layer, expert) tensors
from disk into this worker's slots, in place.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import attrs
import torch

from ftengine.backends.base import RepairReport
from ftengine.errors import PlacementError, WeightLoadError
from ftengine.placement.elastic import ElasticInfo, densify_routing_ids
from ftengine.placement.logical import write_logical_rows
from ftengine.placement.maps import ExpertPlacement
from ftengine.placement.planner import apply_plan, plan_redistribution
from ftengine.placement.ranks import dp_to_ep_ranks
from ftengine.placement.rejoin import GrownCopies, apply_rejoin, plan_rejoin
from ftengine.weights.index import CheckpointIndex
from ftengine.weights.reload import load_experts_into_slots
from ftengine.weights.slots import ExpertSlots

logger = logging.getLogger(__name__)

Tensor = torch.Tensor


@attrs.frozen(eq=False)
class ExpertLayer:
    """A view of one MoE layer's expert state on this worker (what ``expert_layers`` shows)."""

    layer: int
    physical_to_logical: Tensor  # [num_physical], a view into the placement (in place)
    local_logical: tuple[int, ...]  # logical expert in each local slot at creation time


class CpuExperts:
    """Placement + slots + elastic_info of one worker (``rank`` of ``world`` EP ranks)."""

    def __init__(
        self,
        index: CheckpointIndex,
        placement: ExpertPlacement,
        slots: ExpertSlots,
        rank: int,
    ) -> None:
        self.index = index
        self.placement = placement
        self.slots = slots
        self.rank = rank
        self.local_slots = placement.local_slots
        self.elastic = ElasticInfo(placement.ep_size, placement.local_slots)
        self._masked = False
        self._float: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        # The slot map at start-up (what a returning rank gets back) and what each of this
        # rank's (layer, local slot) holds now, so an admission reloads only what differs.
        self.original = placement.physical_to_logical_map.clone()
        self.holding: dict[tuple[int, int], int] = {}

    @classmethod
    def load(
        cls, index: CheckpointIndex, *, rank: int, world: int, num_redundant: int
    ) -> CpuExperts:
        """Build the default EPLB placement and load this rank's slots from ``index``."""
        num_layers, num_logical = index.num_layers, index.num_experts
        placement = ExpertPlacement.default(num_layers, num_logical, num_redundant, world)
        slots = ExpertSlots.allocate(index, num_layers, placement.local_slots)
        experts = cls(index, placement, slots, rank)
        experts._reload(experts.own_assignments())
        return experts

    def own_assignments(self) -> list[tuple[int, int, int]]:
        """``(layer, local slot, logical expert)`` for every live slot this rank holds."""
        start = self.rank * self.local_slots
        p2l = self.placement.physical_to_logical_map
        out = []
        for layer in range(self.placement.num_layers):
            for slot in range(self.local_slots):
                logical = int(p2l[layer, start + slot])
                if logical >= 0:
                    out.append((layer, slot, logical))
        return out

    def w13(self, layer: int, slot: int) -> Tensor:
        """Float32 ``[H, 2I]`` of local ``slot`` (cached until the slot is reloaded)."""
        return self._floats(layer, slot)[0]

    def w2(self, layer: int, slot: int) -> Tensor:
        """Float32 ``[I, H]`` of local ``slot``."""
        return self._floats(layer, slot)[1]

    def _floats(self, layer: int, slot: int) -> tuple[Tensor, Tensor]:
        key = (layer, slot)
        if key not in self._float:
            self._float[key] = (self.slots.w13_float(layer, slot), self.slots.w2_float(layer, slot))
        return self._float[key]

    def routing(self, layer: int) -> tuple[Tensor, Tensor]:
        """``(logical_to_physical [E, R], replica_count [E])`` of ``layer`` (live views)."""
        p = self.placement
        return p.logical_to_physical_map[layer], p.logical_replica_count[layer]

    def densify(self, physical: Tensor) -> Tensor:
        """Physical ids -> dense ids through elastic_info table1 (identity while unmasked)."""
        if not self._masked:
            return physical  # table1 is the identity: skip the lookup on every healthy step
        return densify_routing_ids(physical, self.elastic.table1(), self.local_slots)

    def mask(self, dead_dp_ranks: frozenset[int]) -> None:
        """Rewrite elastic_info in place for the cumulative dead set (TP = 1: EP = DP)."""
        dead_ep = dp_to_ep_ranks(dead_dp_ranks, 1)
        self.elastic.update(dead_ep)
        self._masked = bool(dead_ep)

    def repair(self, dead_dp_ranks: frozenset[int], *, fail: bool = False) -> RepairReport:
        """Re-host the experts of ``dead_dp_ranks`` and reload this rank's new slots.

        ``fail`` makes the reload raise WeightLoadError (fault injection).
        """
        dead_ep = dp_to_ep_ranks(dead_dp_ranks, 1)
        plan = plan_redistribution(self.placement, dead_ep)
        apply_plan(self.placement, plan)
        self._check_routable(dead_ep)
        start = self.rank * self.local_slots
        mine = [
            (move.layer, move.slot - start, move.logical_expert)
            for move in plan.moves
            if start <= move.slot < start + self.local_slots
        ]
        if fail:
            raise WeightLoadError(
                f"injected reload_error on rank {self.rank}: refusing to reload "
                f"{len(mine)} experts from {self.index.path}"
            )
        bytes_read = self._reload(mine)
        return RepairReport(
            reloads=len(mine),
            reload_lower_bound=int(plan.lower_bound),
            bytes_reloaded=bytes_read,
            reloaded=tuple((layer, expert) for layer, _, expert in mine),
        )

    def _check_routable(self, dead_ep: frozenset[int]) -> None:
        """Every replica the router can pick must be live: a stale map would send tokens
        to a dead rank, so refuse to finish the repair instead."""
        p = self.placement
        width = p.logical_to_physical_map.shape[2]
        valid = torch.arange(width)[None, None, :] < p.logical_replica_count[:, :, None]
        picked = p.logical_to_physical_map[valid]
        on_dead = [int(s) for s in picked.tolist() if s < 0 or s // self.local_slots in dead_ep]
        if on_dead or bool((p.logical_replica_count <= 0).any()):
            raise PlacementError(
                f"after re-hosting the experts of EP ranks {sorted(dead_ep)}, the routing maps "
                f"still name dead or empty slots {sorted(set(on_dead))[:8]} or experts with no "
                "replica; the placement update is inconsistent"
            )

    def admit(
        self,
        added_dp_ranks: frozenset[int],
        survivors_map: Tensor,
        *,
        grown: GrownCopies = "drop",
    ) -> RepairReport:
        """Admit ``added_dp_ranks`` back: adopt ``survivors_map`` (the slot map a survivor
        holds, the same on every survivor; a survivor checks its own agrees), give the
        returning ranks their original experts, drop or keep the copies grown for them,
        and reload only this rank's slots whose target it does not hold (none on a
        survivor; on a returning rank only what it did not load at start-up)."""
        p2l = self.placement.physical_to_logical_map
        joining = self.rank in added_dp_ranks
        if not joining and not torch.equal(p2l, survivors_map):
            raise PlacementError(
                f"rank {self.rank}'s slot map differs from the survivors' map it was sent; "
                "the survivors disagree on the placement"
            )
        target = self.placement.clone()
        target.physical_to_logical_map.copy_(survivors_map)
        everything = torch.ones(target.num_layers, target.num_logical, dtype=torch.bool)
        write_logical_rows(
            target.physical_to_logical_map,
            target.logical_to_physical_map,
            target.logical_replica_count,
            everything,
        )
        dead_ep = dp_to_ep_ranks(added_dp_ranks, 1)
        apply_rejoin(target, plan_rejoin(target, dead_ep, self.original, grown=grown))
        start = self.rank * self.local_slots
        wanted = target.physical_to_logical_map[:, start : start + self.local_slots]
        todo = [
            (layer, slot, int(wanted[layer, slot]))
            for layer in range(target.num_layers)
            for slot in range(self.local_slots)
            if int(wanted[layer, slot]) >= 0
            and self.holding.get((layer, slot)) != int(wanted[layer, slot])
        ]
        bytes_read = self._reload(todo)
        # Weights first, maps second (in place: the model holds views of them).
        p2l.copy_(target.physical_to_logical_map)
        self.placement.logical_to_physical_map.copy_(target.logical_to_physical_map)
        self.placement.logical_replica_count.copy_(target.logical_replica_count)
        return RepairReport(
            reloads=len(todo),
            bytes_reloaded=bytes_read,
            reloaded=tuple((layer, expert) for layer, _, expert in todo),
        )

    def _reload(self, assignments: Iterable[tuple[int, int, int]]) -> int:
        todo = list(assignments)
        if not todo:
            return 0
        stats = load_experts_into_slots(self.index, self.slots, todo)
        for layer, slot, logical in todo:
            self._float.pop((layer, slot), None)
            self.holding[(layer, slot)] = logical
        return int(stats.bytes_read)

    def layers(self) -> tuple[ExpertLayer, ...]:
        """One :class:`ExpertLayer` per MoE layer."""
        p2l = self.placement.physical_to_logical_map
        start = self.rank * self.local_slots
        return tuple(
            ExpertLayer(
                layer=layer,
                physical_to_logical=p2l[layer],
                local_logical=tuple(
                    int(x) for x in p2l[layer, start : start + self.local_slots].tolist()
                ),
            )
            for layer in range(self.placement.num_layers)
        )
