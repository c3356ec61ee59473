"""MC2 dispatch/combine v2 with ``elastic_info``: the dead-rank mask Ascend's kernels read.

The ``elastic_info`` device tensor (``ftengine.placement.elastic.ElasticInfo``) is allocated
once and rebuilt in place from a pinned host buffer, so captured graphs keep pointing at
it. Callers keep passing the *original*
``ep_world_size`` / ``ep_rank_id`` / ``moe_expert_num`` / ``global_bs``; only
``elastic_info`` and the expert ids change after a scale-down. The ids come from a routing
table (vllm-ascend's ``expert_replica_routing_table``) that :func:`densify_routing_table`
renumbers once per redistribution, in place: no MoE call pays a host sync for it.
"""

from __future__ import annotations

import attrs
import torch

from ftengine.backends.npu_runtime import NpuRuntime
from ftengine.errors import PlacementError
from ftengine.placement.elastic import ElasticInfo, densify_routing_ids


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, found {value}")


@attrs.frozen
class Mc2Params:
    """The fixed MC2 arguments of one rank, identical on every layer and every call.

    ``moe_expert_num`` is the physical (EPLB) expert count, ``global_bs`` the EP-wide batch
    (0 = ``bs * ep_world_size``). Validated like the op docs:
    ``moe_expert_num % (ep_world_size - shared_expert_rank_num) == 0``.
    """

    group_ep: str
    ep_world_size: int = attrs.field(validator=_positive)
    ep_rank_id: int
    moe_expert_num: int = attrs.field(validator=_positive)
    global_bs: int = 0
    shared_expert_num: int = 1
    shared_expert_rank_num: int = 0
    quant_mode: int = 0
    expert_shard_type: int = 0
    expert_token_nums_type: int = 1
    group_tp: str = ""

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.ep_rank_id < self.ep_world_size:
            raise PlacementError(
                f"ep_rank_id must be in [0, {self.ep_world_size}), found {self.ep_rank_id}"
            )
        if not 0 <= self.shared_expert_rank_num < self.ep_world_size:
            raise PlacementError(
                f"shared_expert_rank_num must be in [0, {self.ep_world_size}), "
                f"found {self.shared_expert_rank_num}"
            )
        moe_ranks = self.ep_world_size - self.shared_expert_rank_num
        if self.moe_expert_num % moe_ranks:
            raise PlacementError(
                f"moe_expert_num {self.moe_expert_num} must be divisible by ep_world_size - "
                f"shared_expert_rank_num = {moe_ranks} (MC2 gives every MoE rank the same count)"
            )

    @property
    def local_slots(self) -> int:
        """Experts per MoE rank (unchanged by a scale-down)."""
        return self.moe_expert_num // (self.ep_world_size - self.shared_expert_rank_num)


@attrs.frozen
class DispatchResult:
    """The seven dispatch_v2 outputs plus the (densified) ids combine must see again."""

    expand_x: torch.Tensor
    dynamic_scales: torch.Tensor | None
    assist_info_for_combine: torch.Tensor
    expert_token_nums: torch.Tensor
    ep_recv_counts: torch.Tensor
    tp_recv_counts: torch.Tensor | None
    expand_scales: torch.Tensor | None
    expert_ids: torch.Tensor
    x_active_mask: torch.Tensor | None = None


class Mc2Communicator:
    """Builds and issues dispatch_v2 / combine_v2 calls for one rank, with elastic_info."""

    def __init__(self, runtime: NpuRuntime, params: Mc2Params, elastic: ElasticInfo) -> None:
        shape = (elastic.world, elastic.local_slots, elastic.shared_expert_rank_num)
        wanted = (params.ep_world_size, params.local_slots, params.shared_expert_rank_num)
        if shape != wanted:
            raise PlacementError(
                f"elastic_info was built for (W, local slots, shared ranks) = {shape}, "
                f"but the MC2 parameters give {wanted}; build both from the same placement"
            )
        self._runtime = runtime
        self.params = params
        self.elastic = elastic

    def _common(self) -> dict[str, object]:
        p = self.params
        return {
            "group_ep": p.group_ep,
            "ep_world_size": p.ep_world_size,
            "ep_rank_id": p.ep_rank_id,
            "moe_expert_num": p.moe_expert_num,
            "elastic_info": self.elastic.tensor,
            "group_tp": p.group_tp,
            "tp_world_size": 1,
            "tp_rank_id": 0,
            "expert_shard_type": p.expert_shard_type,
            "shared_expert_num": p.shared_expert_num,
            "shared_expert_rank_num": p.shared_expert_rank_num,
            "global_bs": p.global_bs,
        }

    def dispatch_kwargs(
        self,
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        *,
        scales: torch.Tensor | None = None,
        x_active_mask: torch.Tensor | None = None,
    ) -> dict[str, object]:
        """Keyword arguments of ``npu_moe_distribute_dispatch_v2`` for tokens ``x`` ``[BS, H]``
        and ``expert_ids`` ``[BS, K]`` read from a (densified) routing table."""
        kwargs = self._common()
        kwargs.update(
            x=x,
            expert_ids=expert_ids.to(torch.int32),
            scales=scales,
            x_active_mask=x_active_mask,
            quant_mode=self.params.quant_mode,
            expert_token_nums_type=self.params.expert_token_nums_type,
        )
        return kwargs

    def combine_kwargs(
        self, dispatched: DispatchResult, expand_x: torch.Tensor, expert_scales: torch.Tensor
    ) -> dict[str, object]:
        """Keyword arguments of ``npu_moe_distribute_combine_v2`` for expert outputs."""
        kwargs = self._common()
        kwargs.update(
            expand_x=expand_x,
            expert_ids=dispatched.expert_ids,
            assist_info_for_combine=dispatched.assist_info_for_combine,
            ep_send_counts=dispatched.ep_recv_counts,
            tp_send_counts=dispatched.tp_recv_counts,
            expert_scales=expert_scales.to(torch.float32),
            x_active_mask=dispatched.x_active_mask,
            expand_scales=dispatched.expand_scales,
        )
        return kwargs

    def dispatch(
        self,
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        *,
        scales: torch.Tensor | None = None,
        x_active_mask: torch.Tensor | None = None,
    ) -> DispatchResult:
        """Send tokens to the ranks hosting their experts (dead ranks masked)."""
        kwargs = self.dispatch_kwargs(x, expert_ids, scales=scales, x_active_mask=x_active_mask)
        out = self._runtime.dispatch_v2(kwargs)
        expand_x, assist, token_nums, ep_recv = out[0], out[2], out[3], out[4]
        if expand_x is None or assist is None or token_nums is None or ep_recv is None:
            raise PlacementError(
                "npu_moe_distribute_dispatch_v2 returned None for a required output"
            )
        ids = kwargs["expert_ids"]
        assert isinstance(ids, torch.Tensor)
        return DispatchResult(
            expand_x=expand_x,
            dynamic_scales=out[1],
            assist_info_for_combine=assist,
            expert_token_nums=token_nums,
            ep_recv_counts=ep_recv,
            tp_recv_counts=out[5],
            expand_scales=out[6],
            expert_ids=ids,
            x_active_mask=x_active_mask,
        )

    def combine(
        self, dispatched: DispatchResult, expand_x: torch.Tensor, expert_scales: torch.Tensor
    ) -> torch.Tensor:
        """Bring expert outputs back and sum them with ``expert_scales`` ``[BS, K]``."""
        return self._runtime.combine_v2(self.combine_kwargs(dispatched, expand_x, expert_scales))


def densify_routing_table(table: torch.Tensor, table1: torch.Tensor, local_slots: int) -> None:
    """Renumber a routing table of physical expert ids into MC2's dense numbering, in place.

    ``table`` holds original physical ids (any shape and integer dtype, e.g. vllm-ascend's
    ``expert_replica_routing_table`` ``[rows, logical experts]`` int32) and keeps its
    storage, so captured graphs keep reading it; ``table1`` is ``elastic_info``'s original
    -> dense EP rank table ``[W]`` (identity when none is dead). Call it once, right after
    the table is rebuilt from the maps. An id on a dead rank raises ``PlacementError`` and
    leaves the table unchanged.
    """
    table.copy_(densify_routing_ids(table, table1, local_slots))
