"""Scale-down's expert re-hosting on vLLM's CPU platform: survivors grow their expert tensors.

vLLM refuses ``--enable-eplb`` on CPU, so there are no spare slots, and the CPU all2all
(allgather_reducescatter) gives every rank every token: each rank computes its *local*
experts' share and the reduce-scatter sums the shares. Every logical expert must therefore
have exactly one owner among the survivors (a second one would be counted twice). So a
survivor takes the dead ranks' experts the way vLLM's elastic-EP reconfiguration changes a
layer's expert count: its ``w13_weight`` / ``w2_weight`` grow by the adopted experts (read
from the checkpoint, exactly those (layer, expert) tensors, then put through the layer's own
``process_weights_after_loading`` transform: intermediate padding and the CPU kernel's
prepacking, which is per expert, so packed rows can be appended), and the layer's
``expert_map`` (in place) and ``local_num_experts`` take the new local ids. vLLM's modular
kernel reads the local expert count off ``w1.shape[0]`` at every call.

Which survivor takes which expert is ftengine's planner's decision (minimal and balanced),
run on a virtual placement where each survivor has empty slots after its own experts; every
survivor computes the same plan alone (it is deterministic).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from ftengine.backends.base import RepairReport
from ftengine.errors import PlacementError, WeightLoadError
from ftengine.integrations.vllm.messages import import_vllm
from ftengine.placement.maps import EMPTY, ExpertPlacement
from ftengine.placement.planner import plan_redistribution
from ftengine.weights.index import CheckpointIndex

logger = logging.getLogger(__name__)

MAP_MODULE = "vllm.model_executor.layers.fused_moe.expert_map_manager"
UTILS_MODULE = "vllm.model_executor.utils"
_LAYER = re.compile(r"layers\.(\d+)\.")

Hosts = tuple[tuple[tuple[int, ...], ...], ...]
"""``hosts[layer][ep_rank]``: the logical experts that rank holds, in local-id order."""


@attrs.frozen
class Hosting:
    """Which logical experts each EP rank hosts in each MoE layer (``hosts``, see :data:`Hosts`)."""

    hosts: Hosts
    num_logical: int

    @classmethod
    def initial(cls, num_layers: int, num_logical: int, ep_size: int, strategy: str) -> Hosting:
        """vLLM's start-up placement (``determine_expert_map`` for every rank)."""
        determine = import_vllm(MAP_MODULE).determine_expert_map
        ranks = []
        for rank in range(ep_size):
            _count, expert_map, _mask = determine(ep_size, rank, num_logical, strategy)
            local = torch.full((num_logical,), -1) if expert_map is None else expert_map
            order = sorted((int(local[e]), e) for e in range(num_logical) if local[e] >= 0)
            ranks.append(tuple(e for _local, e in order))
        return cls(tuple(tuple(ranks) for _ in range(num_layers)), num_logical)

    @property
    def ep_size(self) -> int:
        return len(self.hosts[0])

    def placement(self, dead: frozenset[int]) -> ExpertPlacement:
        """A virtual slot map: each rank's experts, then enough empty slots per rank for the
        survivors to take every expert of ``dead`` without evicting one of their own."""
        survivors = self.ep_size - len(dead)
        orphans = max(sum(len(layer[r]) for r in dead) for layer in self.hosts)
        width = max(len(r) for layer in self.hosts for r in layer) + math.ceil(orphans / survivors)
        p2l = torch.full((len(self.hosts), self.ep_size * width), EMPTY, dtype=torch.int64)
        for layer, ranks in enumerate(self.hosts):
            for rank, experts in enumerate(ranks):
                start = rank * width
                p2l[layer, start : start + len(experts)] = torch.tensor(experts, dtype=torch.int64)
        return ExpertPlacement.from_physical_to_logical(
            p2l, num_logical=self.num_logical, ep_size=self.ep_size
        )


@attrs.frozen
class RehostPlan:
    """The hosting after a scale-down and what each rank adopts: ``adopted[layer][rank]``."""

    before: Hosting
    after: Hosting
    adopted: Hosts
    lower_bound: int


def plan_rehost(hosting: Hosting, dead: frozenset[int]) -> RehostPlan:
    """Give every expert of the (cumulative) ``dead`` ranks to a survivor, through
    ftengine's planner (``PreconditionFailed`` for a dead set it refuses)."""
    placement = hosting.placement(dead)
    plan = plan_redistribution(placement, dead)
    width = placement.local_slots
    adopted = [[list[int]() for _ in range(hosting.ep_size)] for _ in hosting.hosts]
    for move in plan.moves:  # sorted by (layer, slot): local ids follow slot order
        adopted[move.layer][move.slot // width].append(move.logical_expert)
    balance_ties(hosting, dead, adopted)
    after = tuple(
        tuple(
            () if rank in dead else own + tuple(adopted[layer][rank])
            for rank, own in enumerate(ranks)
        )
        for layer, ranks in enumerate(hosting.hosts)
    )
    adopted_t = tuple(tuple(tuple(r) for r in layer) for layer in adopted)
    return RehostPlan(hosting, Hosting(after, hosting.num_logical), adopted_t, plan.lower_bound)


def balance_ties(hosting: Hosting, dead: frozenset[int], adopted: list[list[list[int]]]) -> None:
    """Spread each layer's adoptions over the survivors the planner found tied, by what they
    adopted in earlier layers (in place).

    The planner balances each layer alone and breaks ties by the lowest slot, so with
    uniform load every layer's orphans went to the same lowest survivors (DP=4: ranks 0 and
    1 in every layer). Only whole lists move between ranks that held the same number of
    experts in that layer before the scale-down, so each layer's balance is the planner's.
    """
    taken = [0] * hosting.ep_size
    for layer, ranks in enumerate(hosting.hosts):
        lists = adopted[layer]
        ties: dict[int, list[int]] = {}
        for rank, own in enumerate(ranks):
            if rank not in dead:
                ties.setdefault(len(own), []).append(rank)
        for group in ties.values():
            shares = sorted((lists[r] for r in group), key=len, reverse=True)
            for rank, share in zip(sorted(group, key=lambda r: (taken[r], r)), shares, strict=True):
                lists[rank] = share
                taken[rank] += len(share)


def moe_layer_index(module: Any) -> int:
    """The decoder-layer number in a RoutedExperts module's ``layer_name``."""
    match = _LAYER.search(str(getattr(module, "layer_name", "")))
    if match is None:
        raise PlacementError(
            f"expected a MoE layer named like 'model.layers.N.mlp.experts', found "
            f"{getattr(module, 'layer_name', None)!r}"
        )
    return int(match.group(1))


def expert_weights(
    index: CheckpointIndex, layer: int, experts: Sequence[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """vLLM's unpacked layout for ``experts`` of ``layer``: w13 ``[k, 2I, H]`` (gate rows
    then up rows), w2 ``[k, H, I]``, and the bytes read from the checkpoint."""
    w13, w2, read = [], [], 0
    for expert in experts:
        names = [index.expert_tensor(layer, expert, p).name for p in ("gate_proj", "up_proj")]
        down = index.expert_tensor(layer, expert, "down_proj").name
        gate, up, down_w = (index.read(n) for n in (*names, down))
        read += sum(t.numel() * t.element_size() for t in (gate, up, down_w))
        w13.append(torch.cat((gate, up)).to(dtype))
        w2.append(down_w.to(dtype))
    return torch.stack(w13), torch.stack(w2), read


def grow_layer(module: Any, experts: Sequence[int], index: CheckpointIndex) -> int:
    """Append ``experts`` (logical ids) to one RoutedExperts module: weights from the
    checkpoint through the layer's own post-load transform, then ``expert_map`` (in place)
    and ``local_num_experts``. Returns the bytes read."""
    first, read = append_rows(module, experts, index)
    route(module, {expert: first + offset for offset, expert in enumerate(experts)})
    return read


def append_rows(module: Any, experts: Sequence[int], index: CheckpointIndex) -> tuple[int, int]:
    """Append ``experts``' weights (from the checkpoint, through the layer's own post-load
    transform) as new rows of ``w13_weight`` / ``w2_weight`` and count them in
    ``local_num_experts``; ``expert_map`` is left alone (no token reaches the new rows yet).
    Returns (the first new row, the bytes read)."""
    old13, old2 = module.w13_weight, module.w2_weight
    first = int(old13.shape[0])
    if not experts:
        return first, 0
    layer = moe_layer_index(module)
    w13, w2, read = expert_weights(index, layer, experts, old13.dtype)
    scratch = torch.nn.Module()
    scratch.register_parameter("w13_weight", torch.nn.Parameter(w13, requires_grad=False))
    scratch.register_parameter("w2_weight", torch.nn.Parameter(w2, requires_grad=False))
    transform: Callable[[torch.nn.Module], None] = (
        module.quant_method.moe_kernel.fused_experts.process_weights_after_loading
    )
    transform(scratch)  # the same padding / prepacking the loaded experts went through
    new13, new2 = _param(scratch, "w13_weight"), _param(scratch, "w2_weight")
    if new13.shape[1:] != old13.shape[1:] or new2.shape[1:] != old2.shape[1:]:
        raise WeightLoadError(
            f"layer {layer}: adopted experts have w13 {list(new13.shape)} / w2 "
            f"{list(new2.shape)}, expected rows like {list(old13.shape)} / {list(old2.shape)}"
        )
    replace = import_vllm(UTILS_MODULE).replace_parameter
    replace(module, "w13_weight", torch.cat((old13.data, new13)))
    replace(module, "w2_weight", torch.cat((old2.data, new2)))
    # vLLM's modular kernel reads the local count off w1.shape[0]; the layer and its
    # expert-map manager say the same.
    count = first + len(experts)
    module.local_num_experts = count
    manager = getattr(module, "expert_map_manager", None)
    if manager is not None:
        manager._local_num_experts = count
    return first, read


def route(module: Any, rows: Mapping[int, int]) -> None:
    """Route each logical expert of ``rows`` to its local row: ``expert_map`` written in
    place (vLLM's expert-map manager holds the same tensor)."""
    expert_map = module._expert_map
    for expert, row in rows.items():
        expert_map[expert] = row


def _param(module: torch.nn.Module, name: str) -> torch.Tensor:
    value = getattr(module, name)
    if not isinstance(value, torch.Tensor):
        raise WeightLoadError(f"the post-load transform left {name} as {type(value).__name__}")
    return value.data


def rehost(
    layers: Sequence[Any],
    plan: RehostPlan,
    ep_rank: int,
    index: CheckpointIndex,
    spare: Spare | None = None,
) -> RepairReport:
    """Give this rank's layers what ``plan`` gives it: a row it still holds unrouted
    (``spare``, from an earlier admission) is routed again, the rest is grown from the
    checkpoint; the report counts the reloads."""
    reloaded: list[tuple[int, int]] = []
    read = 0
    for position, module in enumerate(layers):  # the plan counts MoE layers in model order
        experts = plan.adopted[position][ep_rank]
        rows = spare.layer(position) if spare is not None else {}
        route(module, {e: rows.pop(e) for e in experts if e in rows})
        grown = [e for e in experts if int(module._expert_map[e]) < 0]
        read += grow_layer(module, grown, index)
        reloaded += [(moe_layer_index(module), e) for e in grown]
    logger.info(
        "[FT] EP rank %d adopted %d experts (%d bytes); lower bound %d cluster-wide",
        ep_rank,
        len(reloaded),
        read,
        plan.lower_bound,
    )
    return RepairReport(len(reloaded), plan.lower_bound, read, tuple(reloaded))


@attrs.define
class Spare:
    """Rows a rank holds but routes no token to, per MoE layer (model order): logical expert
    -> row. An admission unroutes the copies a survivor took for the returning ranks and
    keeps them here; a later scale-down routes them again instead of growing new rows, so
    kill / scale_down / rejoin cycles do not grow the layers."""

    rows: list[dict[int, int]] = attrs.field(factory=list)

    def layer(self, position: int) -> dict[int, int]:
        while len(self.rows) <= position:
            self.rows.append({})
        return self.rows[position]


def reconcile(
    layers: Sequence[Any], target: Hosting, ep_rank: int, index: CheckpointIndex, spare: Spare
) -> RepairReport:
    """Route exactly ``target``'s experts of this rank in every layer: the others are
    unrouted into ``spare``, the missing ones routed from ``spare`` or grown (read)."""
    reloaded: list[tuple[int, int]] = []
    read = 0
    for position, module in enumerate(layers):
        want = target.hosts[position][ep_rank]
        expert_map = module._expert_map
        rows = spare.layer(position)
        for expert in range(int(expert_map.shape[0])):
            row = int(expert_map[expert])
            if row >= 0 and expert not in want:
                rows[expert] = row
                expert_map[expert] = -1
        missing = [e for e in want if int(expert_map[e]) < 0]
        route(module, {e: rows.pop(e) for e in missing if e in rows})
        grown = [e for e in missing if int(expert_map[e]) < 0]
        read += grow_layer(module, grown, index)
        reloaded += [(moe_layer_index(module), e) for e in grown]
    return RepairReport(len(reloaded), 0, read, tuple(reloaded))


def start_hosting(layers: Sequence[Any], ep_size: int) -> Hosting:
    """vLLM's start-up hosting of the model's RoutedExperts ``layers`` over ``ep_size`` ranks."""
    if not layers:
        raise PlacementError("the model has no MoE layer: there are no experts to re-host")
    first = layers[0]
    strategy = str(getattr(first, "expert_placement_strategy", "linear"))
    return Hosting.initial(len(layers), int(first.global_num_experts), ep_size, strategy)


class CpuExpertRehoster:
    """One CPU worker's re-hosting state: the cluster-wide hosting every survivor tracks
    alike (vLLM's start-up placement, then each scale-down's plan applied in turn).

    ``layers`` returns the model's RoutedExperts modules in model order, ``checkpoint`` the
    checkpoint index; ``ep_rank`` / ``ep_size`` are this worker's original EP rank and size.
    """

    def __init__(
        self,
        layers: Callable[[], Sequence[Any]],
        checkpoint: Callable[[], CheckpointIndex],
        *,
        ep_rank: int,
        ep_size: int,
    ) -> None:
        self._layers = layers
        self._checkpoint = checkpoint
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.hosting: Hosting | None = None
        self.spare = Spare()

    def repair(self, dead_ranks: frozenset[int]) -> RepairReport:
        """Adopt this rank's share of the experts of ``dead_ranks`` (cumulative)."""
        layers = self._layers()
        hosting = self.hosting if self.hosting is not None else start_hosting(layers, self.ep_size)
        plan = plan_rehost(hosting, dead_ranks)
        report = rehost(layers, plan, self.ep_rank, self._checkpoint(), self.spare)
        self.hosting = plan.after
        return report

    def admit(self, added: frozenset[int], removed: frozenset[int]) -> RepairReport:
        """Ranks ``added`` are back (``removed``: what stays removed): route this rank's
        experts as that deployment's hosting has them (the start-up hosting when nothing
        stays removed; else the plan for ``removed`` from it, which every member computes
        alike), the copies taken for the returning ranks kept unrouted (:class:`Spare`)."""
        layers = self._layers()
        initial = start_hosting(layers, self.ep_size)
        target = plan_rehost(initial, removed).after if removed else initial
        report = reconcile(layers, target, self.ep_rank, self._checkpoint(), self.spare)
        self.hosting = target
        logger.info(
            "[FT] EP rank %d: DP ranks %s admitted back; %d expert copies unrouted and kept, "
            "%d reloaded",
            *(self.ep_rank, sorted(added), sum(len(r) for r in self.spare.rows), report.reloads),
        )  # fmt: skip
        return report
