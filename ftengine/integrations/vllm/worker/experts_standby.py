"""Failure-aware placement on vLLM's CPU platform: standby expert copies, activated in place.

``"placement": "failure-aware"`` in ftengine's additional-config. At start-up each rank also
loads, as extra rows of its layers' ``w13_weight`` / ``w2_weight``, a *standby* copy of
every expert it would adopt when any single other rank is lost (ftengine's planner decides
which, exactly as a scale-down would: :func:`~ftengine.integrations.vllm.worker.experts_rehost.
plan_rehost` of each one-rank loss). Every logical expert then has two physical copies
cluster-wide, but only the primary one is *active*: ``expert_map`` routes to it alone, so
the CPU all2all (which sums every rank's contribution) still counts each expert once, and
the kernel never reads a standby row (the patched ``CPUUnquantizedExperts.apply`` gives the
grouped GEMM only the routed local ids).

On ``scale_down`` a survivor holding a standby copy of an orphaned expert activates it by
writing ``expert_map`` in place (as on NPU): no checkpoint read. Only what no live standby
copy covers (a two-rank loss, or experts a dead rank had adopted) is reloaded, by growth as
without standby copies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ftengine.backends.base import RepairReport
from ftengine.errors import PlacementError
from ftengine.integrations.vllm.worker.experts_rehost import (
    CpuExpertRehoster,
    Hosting,
    Hosts,
    RehostPlan,
    append_rows,
    plan_rehost,
    reconcile,
    rehost,
    route,
    start_hosting,
)
from ftengine.weights.index import CheckpointIndex

logger = logging.getLogger(__name__)

PLACEMENT = "failure-aware"
"""The ``ftengine.placement`` value that turns standby copies on (vLLM CPU workers)."""


def _empty(num_layers: int, ep_size: int) -> list[list[list[int]]]:
    return [[[] for _ in range(ep_size)] for _ in range(num_layers)]


def _frozen(table: list[list[list[int]]]) -> Hosts:
    return tuple(tuple(tuple(rank) for rank in layer) for layer in table)


@attrs.frozen
class Standby:
    """Inactive expert copies: ``copies[layer][ep_rank]``, the logical experts that rank holds
    as standby rows, in row order (see :data:`~ftengine.integrations.vllm.worker.experts_rehost.
    Hosts`). An expert has at most one standby copy cluster-wide."""

    copies: Hosts

    @classmethod
    def failure_aware(cls, hosting: Hosting) -> Standby:
        """What each rank would adopt when any single other rank is lost (none with one rank)."""
        copies = _empty(len(hosting.hosts), hosting.ep_size)
        if hosting.ep_size > 1:
            for lost in range(hosting.ep_size):
                plan = plan_rehost(hosting, frozenset({lost}))
                for layer, ranks in enumerate(plan.adopted):
                    for rank, experts in enumerate(ranks):
                        copies[layer][rank] += experts
        return cls(_frozen(copies))

    def holders(self, layer: int, dead: frozenset[int]) -> dict[int, int]:
        """``{logical expert: the live rank holding its standby copy}`` in ``layer``."""
        ranks = self.copies[layer]
        return {e: r for r, experts in enumerate(ranks) if r not in dead for e in experts}


@attrs.frozen
class StandbyPlan:
    """A scale-down with standby copies: ``activated[layer][rank]`` (routed in place, no
    reload), ``rest`` (the planner's re-hosting of what no live standby copy covers: its
    ``adopted`` is reloaded, its ``after`` is the hosting that results) and the standby
    copies left afterwards."""

    activated: Hosts
    rest: RehostPlan
    standby: Standby


def plan_activation(hosting: Hosting, standby: Standby, dead: frozenset[int]) -> StandbyPlan:
    """Activate every live standby copy of an expert of ``dead`` (cumulative), then let
    ``plan_rehost`` place the remaining orphans (``PreconditionFailed`` as it raises)."""
    hosts = [[list(rank) for rank in layer] for layer in hosting.hosts]
    activated = _empty(len(hosts), hosting.ep_size)
    for layer, ranks in enumerate(hosts):
        holders = standby.holders(layer, dead)
        for lost in sorted(dead):
            for expert in tuple(ranks[lost]):
                holder = holders.get(expert)
                if holder is not None:
                    ranks[lost].remove(expert)
                    ranks[holder].append(expert)
                    activated[layer][holder].append(expert)
    rest = plan_rehost(Hosting(_frozen(hosts), hosting.num_logical), dead)
    remaining = tuple(
        tuple(
            () if r in dead else tuple(e for e in experts if e not in activated[layer][r])
            for r, experts in enumerate(ranks)
        )
        for layer, ranks in enumerate(standby.copies)
    )
    return StandbyPlan(_frozen(activated), rest, Standby(remaining))


class StandbyRehoster(CpuExpertRehoster):
    """One CPU worker's failure-aware re-hosting: :meth:`load` the standby copies at start-up
    (after ``load_model``), then each :meth:`repair` activates them in place and reloads the
    rest. Same arguments as ``CpuExpertRehoster``; every survivor tracks the cluster-wide
    hosting and standby copies alike (the plans are deterministic)."""

    def __init__(
        self,
        layers: Callable[[], Sequence[Any]],
        checkpoint: Callable[[], CheckpointIndex],
        *,
        ep_rank: int,
        ep_size: int,
    ) -> None:
        super().__init__(layers, checkpoint, ep_rank=ep_rank, ep_size=ep_size)
        self.standby: Standby | None = None
        self.rows: list[dict[int, int]] = []
        """Per MoE layer (model order): this rank's standby copies, logical expert -> row."""

    def load(self) -> int:
        """Append this rank's standby copies to its layers (not routed); the bytes read."""
        layers = self._layers()
        self.hosting = start_hosting(layers, self.ep_size)
        self.standby = Standby.failure_aware(self.hosting)
        index, read, self.rows = self._checkpoint(), 0, []
        for position, module in enumerate(layers):
            experts = self.standby.copies[position][self.ep_rank]
            first, count = append_rows(module, experts, index)
            self.rows.append({e: first + i for i, e in enumerate(experts)})
            read += count
        held = sum(len(rows) for rows in self.rows)
        logger.info(
            "[FT] EP rank %d holds %d standby expert copies (%d bytes, failure-aware placement)",
            self.ep_rank,
            held,
            read,
        )
        return read

    def repair(self, dead_ranks: frozenset[int]) -> RepairReport:
        """Activate this rank's standby copies of the experts of ``dead_ranks`` (cumulative)
        in place, then reload its share of what no live standby copy covers."""
        if self.hosting is None or self.standby is None:
            self.load()  # a scale-down before start-up finished: load them now
        hosting, standby = self.hosting, self.standby
        if hosting is None or standby is None:
            raise PlacementError(f"EP rank {self.ep_rank}: loading the standby copies set none")
        plan = plan_activation(hosting, standby, frozenset(dead_ranks))
        layers = self._layers()
        for position, module in enumerate(layers):
            mine = plan.activated[position][self.ep_rank]
            route(module, {e: self.rows[position].pop(e) for e in mine})
        activated = sum(len(layer[self.ep_rank]) for layer in plan.activated)
        logger.info(
            "[FT] EP rank %d activated %d standby expert copies in place (no reload)",
            self.ep_rank,
            activated,
        )
        report = rehost(layers, plan.rest, self.ep_rank, self._checkpoint(), self.spare)
        self.hosting, self.standby = plan.rest.after, plan.standby
        return report

    def admit(self, added: frozenset[int], removed: frozenset[int]) -> RepairReport:
        """Ranks ``added`` are back: route this rank's experts as the deployment with
        ``removed`` has them (``CpuExpertRehoster.admit``), and its standby copies are
        again those of that deployment (the start-up ones when nothing stays removed):
        unrouted rows serve as standby rows, so the next loss activates in place again."""
        if self.hosting is None or self.standby is None:
            self.load()
        layers = self._layers()
        initial = start_hosting(layers, self.ep_size)
        standby = Standby.failure_aware(initial)
        if removed:
            plan = plan_activation(initial, standby, frozenset(removed))
            target, standby = plan.rest.after, plan.standby
        else:
            target = initial
        for position, rows in enumerate(self.rows):  # every unrouted row is spare now
            self.spare.layer(position).update(rows)
        report = reconcile(layers, target, self.ep_rank, self._checkpoint(), self.spare)
        self.rows = []
        for position, module in enumerate(layers):
            spare = self.spare.layer(position)
            copies = standby.copies[position][self.ep_rank]
            missing = [e for e in copies if e not in spare]
            first, _read = append_rows(module, missing, self._checkpoint())
            spare.update({e: first + i for i, e in enumerate(missing)})
            self.rows.append({e: spare.pop(e) for e in copies})
        self.hosting, self.standby = target, standby
        logger.info(
            "[FT] EP rank %d: DP ranks %s admitted back; standby copies restored in place",
            self.ep_rank,
            sorted(added),
        )
        return report
