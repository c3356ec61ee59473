"""MC2-style MoE dispatch and combine over a gloo EP group (the CPU stand-in for Ascend's
``npu_moe_distribute_dispatch_v2`` / ``combine_v2`` with ``elastic_info``).

Per layer: pick a physical replica for each (token, k) pair from the EPLB maps, densify
the physical ids with elastic_info's table1 when ranks are masked, exchange per-rank
counts, ``all_to_all`` the token rows to the ranks hosting their slots, run the experts
there (one row at a time), and ``all_to_all`` the results back in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from ftengine.errors import PlacementError

Tensor = torch.Tensor


class EpComm(Protocol):
    """The collectives the MoE layer needs (``ftengine.testbed.cpu.comm.GlooGroup``)."""

    size: int
    rank: int

    def all_reduce_sum(self, tensor: Tensor) -> None: ...

    def all_to_all(self, inp: Tensor, in_splits: list[int], out_splits: list[int]) -> Tensor: ...


class ExpertStore(Protocol):
    """Float32 expert weights by (layer, local slot): ``w13 [H, 2I]``, ``w2 [I, H]``."""

    def w13(self, layer: int, slot: int) -> Tensor: ...

    def w2(self, layer: int, slot: int) -> Tensor: ...


def expert_ffn(x: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """One expert on rows ``x [n, H]``, one row at a time (batch-shape independent).

    ``w13 [H, 2I]`` holds gate columns then up columns; ``w2 [I, H]``. Returns ``[n, H]``.
    """
    inter = w2.shape[0]
    rows = []
    for i in range(x.shape[0]):
        a = x[i : i + 1] @ w13
        rows.append((F.silu(a[:, :inter]) * a[:, inter:]) @ w2)
    if not rows:
        return x.new_zeros((0, w2.shape[1]))
    return torch.cat(rows)


def combine_topk(outputs: Tensor, weights: Tensor) -> Tensor:
    """Weighted sum of ``outputs [T, k, H]`` by ``weights [T, k]`` in fixed k order."""
    acc = outputs[:, 0] * weights[:, 0:1]
    for j in range(1, outputs.shape[1]):
        acc = acc + outputs[:, j] * weights[:, j : j + 1]
    return acc


def choose_replicas(
    logical_to_physical: Tensor, replica_count: Tensor, topk_ids: Tensor, keys: Tensor
) -> Tensor:
    """Physical slot ids ``[T, k]`` for logical ``topk_ids [T, k]`` of one layer.

    ``logical_to_physical [E, R]`` (rows packed, -1 padded) and ``replica_count [E]`` are
    one layer's EPLB maps; replica ``(key + j) % count`` spreads a token's k picks and
    successive tokens over the replicas. Raises PlacementError if an expert has none.
    """
    counts = replica_count[topk_ids]
    if bool((counts <= 0).any()):
        missing = sorted(set(topk_ids[counts <= 0].tolist()))
        raise PlacementError(
            f"logical experts {missing} have no live replica; scale_down must re-host them "
            "before the layer can run"
        )
    k = topk_ids.shape[1]
    replica = (keys[:, None] + torch.arange(k)[None, :]) % counts
    physical = logical_to_physical[topk_ids, replica]
    if bool((physical < 0).any()):
        raise PlacementError("logical_to_physical rows must be packed: found -1 within count")
    return physical


def dispatch_combine(
    comm: EpComm,
    experts: ExpertStore,
    layer: int,
    hidden: Tensor,
    dense_ids: Tensor,
    local_slots: int,
) -> Tensor:
    """Run the experts named by ``dense_ids [T, k]`` on ``hidden [T, H]`` across the group.

    Dense id ``d`` lives on dense rank ``d // local_slots`` in slot ``d % local_slots``.
    Returns the expert outputs ``[T, k, H]`` (not yet weighted). Three collectives: the
    counts exchange, the dispatch and the combine; ranks with ``T = 0`` still take part.
    """
    t, k = dense_ids.shape
    h = hidden.shape[1]
    flat = dense_ids.reshape(-1)
    dest = torch.div(flat, local_slots, rounding_mode="floor")
    if bool(((dest < 0) | (dest >= comm.size)).any()):
        raise PlacementError(
            f"routing ids {sorted(set(flat.tolist()))} address ranks outside the "
            f"{comm.size}-rank group; densify them with elastic_info table1 first"
        )
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=comm.size).to(torch.int64)
    recv_counts = comm.all_to_all(send_counts, [1] * comm.size, [1] * comm.size)
    rows = hidden.repeat_interleave(k, dim=0)[order]  # pair p = token * k + j
    slots = (flat % local_slots)[order].to(torch.float32)[:, None]
    payload = torch.cat([rows, slots], dim=1)
    send = send_counts.tolist()
    recv = recv_counts.tolist()
    got = comm.all_to_all(payload, send, recv)
    results = _run_local_experts(experts, layer, got[:, :h], got[:, h].to(torch.int64))
    back = comm.all_to_all(results, recv, send)
    out = torch.empty(t * k, h)
    out[order] = back
    return out.view(t, k, h)


def _run_local_experts(experts: ExpertStore, layer: int, rows: Tensor, slots: Tensor) -> Tensor:
    out = torch.empty_like(rows)
    for slot in sorted(set(slots.tolist())):
        mask = slots == slot
        out[mask] = expert_ffn(rows[mask], experts.w13(layer, slot), experts.w2(layer, slot))
    return out


class DistributedMoe:
    """The EP MoE layer of one worker (a ``model.MoeLayerFn``).

    ``comm`` returns the current epoch's group (groups change on rebuild);
    ``routing(layer)`` returns that layer's ``(logical_to_physical [E, R],
    replica_count [E])``; ``densify(physical_ids)`` maps physical ids to dense ids
    (identity while nothing is masked).
    """

    def __init__(
        self,
        comm: Callable[[], EpComm],
        experts: ExpertStore,
        routing: Callable[[int], tuple[Tensor, Tensor]],
        densify: Callable[[Tensor], Tensor],
        local_slots: int,
    ) -> None:
        self._comm = comm
        self._experts = experts
        self._routing = routing
        self._densify = densify
        self._local_slots = local_slots

    def __call__(
        self, layer: int, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, keys: Tensor
    ) -> Tensor:
        l2p, counts = self._routing(layer)
        physical = choose_replicas(l2p, counts, topk_ids, keys)
        dense = self._densify(physical)
        outputs = dispatch_combine(
            self._comm(), self._experts, layer, hidden, dense, self._local_slots
        )
        return combine_topk(outputs, topk_weights)


class LocalMoe:
    """The single-process MoE layer of the reference: slot ``e`` holds logical expert ``e``."""

    def __init__(self, experts: ExpertStore) -> None:
        self._experts = experts

    def __call__(
        self, layer: int, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, keys: Tensor
    ) -> Tensor:
        t, k = topk_ids.shape
        outputs = torch.empty(t, k, hidden.shape[1])
        for j in range(k):
            for expert in sorted(set(topk_ids[:, j].tolist())):
                mask = topk_ids[:, j] == expert
                outputs[mask, j] = expert_ffn(
                    hidden[mask], self._experts.w13(layer, expert), self._experts.w2(layer, expert)
                )
        return combine_topk(outputs, topk_weights)
