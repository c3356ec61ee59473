"""MC2 ``elastic_info`` (Ascend dispatch_v2 / combine_v2) and routing-id densification.

Layout, int32 ``[4 + 2W]`` with W the original EP world size: ``[flag, dense EP size,
shared-expert rank count, MoE expert count after shrink, table1 (orig -> dense rank, -1
dead), table2 (dense -> orig rank, -1 padding)]``; all zeros when nothing is dead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ftengine.errors import PlacementError, PreconditionFailed

HEADER = 4
"""Entries before table1: flag, dense EP size, shared-expert ranks, MoE experts after shrink."""


def elastic_info_values(
    world: int,
    dead_ep_ranks: Iterable[int],
    local_slots: int,
    shared_expert_rank_num: int = 0,
) -> list[int]:
    """The ``elastic_info`` values for ``dead_ep_ranks`` of an EP world of ``world`` ranks.

    ``local_slots`` are MoE experts per rank. Shared-expert ranks are the first
    ``shared_expert_rank_num`` ranks. Raises ``PreconditionFailed`` for a dead set out of
    range, a dead shared-expert rank, or no MoE rank left.
    """
    dead = _check_dead(world, dead_ep_ranks, shared_expert_rank_num)
    if not dead:
        return [0] * (HEADER + 2 * world)
    alive = [rank for rank in range(world) if rank not in dead]
    dense_of = dict(zip(alive, range(len(alive)), strict=True))
    table1 = [dense_of.get(rank, -1) for rank in range(world)]
    table2 = alive + [-1] * len(dead)
    moe_ranks = len(alive) - shared_expert_rank_num
    header = [1, len(alive), shared_expert_rank_num, moe_ranks * local_slots]
    return header + table1 + table2


def _check_dead(world: int, dead_ep_ranks: Iterable[int], shared: int) -> frozenset[int]:
    dead = frozenset(dead_ep_ranks)
    reasons = []
    out_of_range = sorted(rank for rank in dead if not 0 <= rank < world)
    if out_of_range:
        reasons.append(f"dead EP ranks {out_of_range} are out of range [0, {world})")
    dead_shared = sorted(rank for rank in dead if 0 <= rank < shared)
    if dead_shared:
        # MC2 places shared experts on the first ranks; losing one would change the
        # shared-expert layout, which the kernel's shrink does not cover (unconfirmed).
        reasons.append(f"shared-expert ranks {dead_shared} are dead; only MoE ranks may shrink")
    if world - shared - len(dead) < 1 and not out_of_range:
        reasons.append(f"no MoE rank would remain of {world - shared}")
    if reasons:
        raise PreconditionFailed("elastic_info refused: " + "; ".join(reasons), tuple(reasons))
    return dead


class ElasticInfo:
    """The device ``elastic_info`` tensor, rebuilt in place from a host buffer.

    The device tensor keeps its storage for its whole life (captured graphs read it by
    address); ``update`` writes the host buffer (pinned where the device supports it) and
    copies it over. Refuses ``tp_size > 1`` and a ``moe_expert_num`` that would change the
    experts per rank (MC2 keeps ``moe_expert_num / (W - shared ranks)`` per rank).
    """

    def __init__(
        self,
        world: int,
        local_slots: int,
        *,
        device: str | torch.device = "cpu",
        shared_expert_rank_num: int = 0,
        tp_size: int = 1,
        moe_expert_num: int | None = None,
    ) -> None:
        _check_layout(world, local_slots, shared_expert_rank_num, tp_size, moe_expert_num)
        self.world = world
        self.local_slots = local_slots
        self.shared_expert_rank_num = shared_expert_rank_num
        self._device = torch.device(device)
        self._host = _host_buffer(HEADER + 2 * world, self._device)
        self._tensor = torch.zeros(HEADER + 2 * world, dtype=torch.int32, device=self._device)
        self._dead: frozenset[int] = frozenset()
        self._copy_in_flight = False

    @property
    def tensor(self) -> torch.Tensor:
        """The int32 ``[4 + 2W]`` device tensor to pass to dispatch_v2 / combine_v2."""
        return self._tensor

    @property
    def dead_ep_ranks(self) -> frozenset[int]:
        """The dead set of the last ``update``."""
        return self._dead

    @property
    def pinned(self) -> bool:
        """Whether the host buffer is in pinned memory (asynchronous copies)."""
        return bool(self._host.is_pinned()) if self._device.type != "cpu" else False

    def update(self, dead_ep_ranks: Iterable[int]) -> None:
        """Rewrite the tensor in place for the cumulative ``dead_ep_ranks``."""
        dead = frozenset(dead_ep_ranks)
        values = elastic_info_values(
            self.world, dead, self.local_slots, self.shared_expert_rank_num
        )
        if self._copy_in_flight:
            # The last asynchronous copy may still read the host buffer: wait before reuse.
            torch.accelerator.synchronize(self._device)
        self._host.copy_(torch.tensor(values, dtype=torch.int32))
        self._tensor.copy_(self._host, non_blocking=self.pinned)
        self._copy_in_flight = self.pinned
        self._dead = dead

    def table1(self) -> torch.Tensor:
        """Original rank -> dense rank (-1 dead), int64 ``[W]`` on CPU; identity if none dead."""
        if not self._dead:
            return torch.arange(self.world, dtype=torch.int64)
        return self._host[HEADER : HEADER + self.world].to(torch.int64)

    def table2(self) -> torch.Tensor:
        """Dense rank -> original rank (-1 padding), int64 ``[W]`` on CPU; identity if none dead."""
        if not self._dead:
            return torch.arange(self.world, dtype=torch.int64)
        return self._host[HEADER + self.world :].to(torch.int64)


def _check_layout(
    world: int, local_slots: int, shared: int, tp_size: int, moe_expert_num: int | None
) -> None:
    reasons = []
    if tp_size != 1:
        reasons.append(f"MC2 elastic_info needs tp_world_size == 1, got {tp_size}")
    if world < 1 or local_slots < 1:
        reasons.append(f"need world >= 1 and local_slots >= 1, got {world} and {local_slots}")
    if not 0 <= shared < world:
        reasons.append(f"shared_expert_rank_num must be in [0, {world}), got {shared}")
    expected = (world - shared) * local_slots
    if moe_expert_num is not None and moe_expert_num != expected:
        reasons.append(
            f"moe_expert_num {moe_expert_num} != (world {world} - shared ranks {shared}) * "
            f"local_slots {local_slots} = {expected}: experts per rank would change on shrink"
        )
    if reasons:
        raise PreconditionFailed("elastic_info refused: " + "; ".join(reasons), tuple(reasons))


def _host_buffer(size: int, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.zeros(size, dtype=torch.int32)
    try:
        return torch.zeros(size, dtype=torch.int32, pin_memory=True)
    except RuntimeError:  # no pinned memory on this host: copies are synchronous instead
        return torch.zeros(size, dtype=torch.int32)


def densify_routing_ids(
    ids: torch.Tensor, table1: torch.Tensor | Sequence[int], local_slots: int
) -> torch.Tensor:
    """Map physical expert ids to the shrunk, dense numbering MC2 expects.

    ``id -> table1[id // L] * L + id % L`` for ids of any shape and integer dtype. Raises
    ``PlacementError`` listing the offending ids if any is negative, out of range, or on
    a dead rank.
    """
    table = torch.as_tensor(table1, dtype=torch.int64, device=ids.device)
    world = int(table.shape[0])
    wide = ids.to(torch.int64)
    in_range = (wide >= 0) & (wide < world * local_slots)
    rank = torch.where(in_range, wide // local_slots, torch.zeros_like(wide))
    dense_rank = table[rank]
    bad = ~in_range | (dense_rank < 0)
    if bool(bad.any()):
        offending = sorted(set(wide[bad].tolist()))
        raise PlacementError(
            f"routing ids {offending[:16]}{' ...' if len(offending) > 16 else ''} are -1, out "
            f"of range [0, {world * local_slots}) or on a dead rank; the expert maps must not "
            "route to dead slots"
        )
    return (dense_rank * local_slots + wide % local_slots).to(ids.dtype)
