"""What vLLM's CPU platform lacks for DP+EP MoE, as plain functions ``patches/worker.py`` installs.

``CpuCommunicator`` inherits the base class's ``NotImplementedError`` for ``all_gatherv`` /
``reduce_scatterv``, which the ``allgather_reducescatter`` all2all calls: both are written
here over gloo (the all-gatherv gathers only the members of a scale-down's rebuilt group).
``local_expert_ids`` turns the router's global expert ids into this rank's local ones, with
zero weight for experts another rank holds (the CPU kernel ignores ``expert_map``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ftengine.integrations.vllm.worker.distributed import ALIVE_ATTR


def _pieces(comm: Any, tensor: torch.Tensor, sizes: Sequence[int] | None) -> list[int]:
    """Rows per rank along dim 0, checked against this rank's ``tensor``."""
    world = int(comm.world_size)
    counts = [int(tensor.shape[0])] * world if sizes is None else [int(s) for s in sizes]
    if len(counts) != world or counts[comm.rank_in_group] != tensor.shape[0]:
        raise ValueError(
            f"all_gatherv/reduce_scatterv: expected {world} sizes with this rank's "
            f"({comm.rank_in_group}) equal to its {tensor.shape[0]} rows, found {counts}"
        )
    return counts


def alive_members(comm: Any, counts: Sequence[int]) -> list[int]:
    """The original ranks behind ``comm``'s device group, ascending (a scale-down's rebuilt
    group has only the survivors, marked :data:`ALIVE_ATTR`; their dense rank is their index
    here). A dead rank's piece must be empty: its column of the DP padding all-reduce is 0."""
    alive = getattr(comm, ALIVE_ATTR, None)
    if alive is None:
        return list(range(len(counts)))
    members = sorted(int(r) for r in alive)
    dead_rows = [(r, n) for r, n in enumerate(counts) if n and r not in members]
    if dead_rows:
        raise ValueError(
            f"all_gatherv: expected no rows from removed ranks (group members {members}), "
            f"found (rank, rows) {dead_rows}"
        )
    return members


def _gatherv_one(comm: Any, tensor: torch.Tensor, sizes: Sequence[int] | None) -> torch.Tensor:
    counts = _pieces(comm, tensor, sizes)
    members = alive_members(comm, counts)
    most = max(counts[r] for r in members)
    # Gloo's all_gather needs equal shapes: pad every rank's rows to the largest count.
    padded = tensor.new_zeros((most, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    gathered = tensor.new_empty((len(members) * most, *tensor.shape[1:]))
    dist.all_gather_into_tensor(gathered, padded, group=comm.device_group)
    return torch.cat([gathered[i * most : i * most + counts[r]] for i, r in enumerate(members)])


def all_gatherv(
    self: Any,
    input_: torch.Tensor | list[torch.Tensor],
    dim: int = 0,
    sizes: list[int] | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """``CpuCommunicator.all_gatherv``: concatenate every rank's rows (``sizes[r]`` from rank
    r) along dim 0, for one tensor or a list of them (CUDA's semantics, dim 0 only)."""
    if dim != 0:
        raise NotImplementedError(f"only dim 0 all-gatherv is supported, found dim={dim}")
    if isinstance(input_, torch.Tensor):
        return _gatherv_one(self, input_, sizes)
    return [_gatherv_one(self, t, sizes) for t in input_]


def reduce_scatterv(
    self: Any, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
) -> torch.Tensor:
    """``CpuCommunicator.reduce_scatterv``: sum ``input_`` (every rank's rows, ``sizes[r]``
    for rank r along ``dim``) over the ranks and keep this rank's rows.

    Gloo has no reduce-scatter: an all-reduce of the whole tensor, then a slice. The MoE
    combine's tensors are a step's tokens, so the extra traffic is small.
    """
    dim = dim + input_.dim() if dim < 0 else dim
    rows = input_.movedim(dim, 0).contiguous()
    world = int(self.world_size)
    if sizes is None:
        if rows.shape[0] % world:
            raise ValueError(
                f"reduce_scatterv: expected rows divisible by {world} ranks, found {rows.shape[0]}"
            )
        sizes = [rows.shape[0] // world] * world
    if len(sizes) != world or sum(sizes) != rows.shape[0]:
        raise ValueError(
            f"reduce_scatterv: expected {world} sizes summing to {rows.shape[0]}, found {sizes}"
        )
    dist.all_reduce(rows, group=self.device_group)
    start = sum(sizes[: self.rank_in_group])
    mine = rows[start : start + sizes[self.rank_in_group]]
    return mine.movedim(0, dim).contiguous()


def local_expert_ids(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global expert ids ``[tokens, k]`` as this rank's local ids, with zero weight (and a
    valid id, 0) where the expert lives on another rank (``expert_map[e] == -1``)."""
    if expert_map is None:
        return topk_ids, topk_weights
    local = expert_map[topk_ids.long()]
    remote = local < 0
    ids = torch.where(remote, torch.zeros_like(local), local).to(topk_ids.dtype)
    weights = topk_weights.masked_fill(remote, 0.0)
    return ids, weights
