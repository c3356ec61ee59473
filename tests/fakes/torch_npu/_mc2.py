"""Fake MC2 dispatch_v2 / combine_v2: validate arguments as the op docs say, then act locally.

One process cannot all-to-all, so the fake keeps only the shapes and bookkeeping honest and
treats every expert as the identity: combine returns ``x * sum(expert_scales)`` per token.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tests.fakes.npu_state import STATE, Mc2ArgumentError

# Parameters every call must repeat unchanged (the op docs' "keep consistent" list).
_STATIC = (
    "group_ep",
    "ep_world_size",
    "ep_rank_id",
    "moe_expert_num",
    "group_tp",
    "tp_world_size",
    "expert_shard_type",
    "shared_expert_num",
    "shared_expert_rank_num",
    "global_bs",
)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise Mc2ArgumentError(message)


def _check_static(kw: Mapping[str, object]) -> tuple[int, int, int]:
    world, rank, experts = kw["ep_world_size"], kw["ep_rank_id"], kw["moe_expert_num"]
    shared_ranks = kw.get("shared_expert_rank_num", 0)
    assert isinstance(world, int) and isinstance(rank, int) and isinstance(experts, int)
    assert isinstance(shared_ranks, int)
    group_ep = kw["group_ep"]
    _check(isinstance(group_ep, str) and 1 <= len(group_ep) < 128, "group_ep: 1..127 chars")
    _check(group_ep != kw.get("group_tp", ""), "group_ep must differ from group_tp")
    _check(2 <= world <= 768, f"ep_world_size must be in [2, 768], got {world}")
    _check(0 <= rank < world, f"ep_rank_id must be in [0, {world}), got {rank}")
    _check(1 <= experts <= 1024, f"moe_expert_num must be in [1, 1024], got {experts}")
    _check(0 <= shared_ranks < world, f"shared_expert_rank_num out of range: {shared_ranks}")
    _check(
        experts % (world - shared_ranks) == 0,
        f"moe_expert_num % (ep_world_size - shared_expert_rank_num) must be 0: "
        f"{experts} % {world - shared_ranks}",
    )
    return world, rank, experts // (world - shared_ranks)


def _check_elastic(kw: Mapping[str, object], world: int, local: int) -> tuple[int, int]:
    """Validate elastic_info; returns the id bound the kernel enforces and this rank's index.

    Both are the original values unless elastic_info's flag is set (then: shrunk expert
    count and dense rank).
    """
    experts, rank = kw["moe_expert_num"], kw["ep_rank_id"]
    assert isinstance(experts, int) and isinstance(rank, int)
    info = kw.get("elastic_info")
    if info is None:
        return experts, rank
    _check(isinstance(info, torch.Tensor), "elastic_info must be a tensor")
    assert isinstance(info, torch.Tensor)
    _check(info.dtype == torch.int32, f"elastic_info must be int32, got {info.dtype}")
    _check(info.dim() == 1, f"elastic_info must be 1-D, got {info.dim()}-D")
    _check(info.numel() == 4 + 2 * world, f"elastic_info length must be 4 + 2W = {4 + 2 * world}")
    values = [int(v) for v in info.tolist()]
    if values[0] == 0:
        return experts, rank
    _check(values[0] == 1, f"elastic_info[0] must be 0 or 1, got {values[0]}")
    _check(kw.get("tp_world_size", 0) in (0, 1), "elastic_info needs tp_world_size == 1")
    table1, table2 = values[4 : 4 + world], values[4 + world :]
    alive = [r for r in range(world) if table1[r] != -1]
    _check(values[1] == len(alive) >= 1, f"elastic_info[1] must count live ranks: {values}")
    _check(all(table1[r] == i and table2[i] == r for i, r in enumerate(alive)), "bad tables")
    _check(all(v == -1 for v in table2[len(alive) :]), "table2 must be padded with -1")
    _check(table1[rank] != -1, f"rank {rank} calls MC2 but elastic_info marks it dead")
    moe_ranks = values[1] - values[2]
    _check(moe_ranks >= 1, "at least one MoE rank must remain")
    _check(values[3] == moe_ranks * local, f"experts per rank must not change: {values}")
    return values[3], table1[rank]


def _check_ids(ids: object, bound: int, bs: int) -> torch.Tensor:
    _check(isinstance(ids, torch.Tensor), "expert_ids must be a tensor")
    assert isinstance(ids, torch.Tensor)
    _check(ids.dtype == torch.int32, f"expert_ids must be int32, got {ids.dtype}")
    _check(ids.dim() == 2 and ids.shape[0] == bs, f"expert_ids must be [BS={bs}, K]")
    _check(0 < ids.shape[1] <= 16, f"K must be in (0, 16], got {ids.shape[1]}")
    if ids.numel():
        _check(int(ids.min()) >= 0 and int(ids.max()) < bound, f"expert_ids must be < {bound}")
        for row in ids.tolist():
            _check(len(set(row)) == len(row), f"duplicate expert ids in a row: {row}")
    return ids


def npu_moe_distribute_dispatch_v2(**kw: object) -> tuple[torch.Tensor | None, ...]:
    """Validate like the op docs; return the seven outputs with documented shapes."""
    STATE.record("npu_moe_distribute_dispatch_v2", **kw)
    STATE.require_usable("npu_moe_distribute_dispatch_v2")
    world, _, local = _check_static(kw)
    x = kw["x"]
    _check(isinstance(x, torch.Tensor) and x.dim() == 2, "x must be a 2-D tensor [BS, H]")
    assert isinstance(x, torch.Tensor)
    _check(x.dtype in (torch.bfloat16, torch.float16), f"x must be bf16/fp16, got {x.dtype}")
    bs, hidden = x.shape
    bound, my_rank = _check_elastic(kw, world, local)
    ids = _check_ids(kw["expert_ids"], bound, bs)
    global_bs = kw.get("global_bs", 0)
    assert isinstance(global_bs, int)
    _check(
        global_bs == 0 or global_bs >= bs * world, f"global_bs must be 0 or >= BS*W: {global_bs}"
    )
    quant_mode = kw.get("quant_mode", 0)
    _check(quant_mode in (0, 2), f"quant_mode must be 0 or 2, got {quant_mode}")
    k = ids.shape[1]
    rows = (global_bs or bs * world) * min(local, k)
    mine = ids // local == my_rank
    token_nums = torch.bincount((ids[mine] % local).long(), minlength=local)[:local]
    STATE.last_dispatch = dict(kw)
    return (
        torch.zeros(rows, hidden, dtype=torch.int8 if quant_mode else x.dtype),
        torch.ones(rows, dtype=torch.float32) if quant_mode else None,
        torch.zeros(rows * 128, dtype=torch.int32),
        token_nums.to(torch.int64),
        torch.zeros(world * local, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        None,
    )


def npu_moe_distribute_combine_v2(**kw: object) -> torch.Tensor:
    """Validate against the matching dispatch; identity experts: ``x * sum_k(expert_scales)``."""
    STATE.record("npu_moe_distribute_combine_v2", **kw)
    STATE.require_usable("npu_moe_distribute_combine_v2")
    last = STATE.last_dispatch
    _check(last is not None, "combine_v2 without a dispatch_v2 before it")
    assert last is not None
    for name in _STATIC:
        _check(kw.get(name) == last.get(name), f"{name} differs from dispatch: {kw.get(name)!r}")
    _check_static(kw)
    ids, last_ids = kw["expert_ids"], last["expert_ids"]
    assert isinstance(ids, torch.Tensor) and isinstance(last_ids, torch.Tensor)
    _check(torch.equal(ids, last_ids), "combine must get the expert_ids dispatch got")
    info, last_info = kw.get("elastic_info"), last.get("elastic_info")
    if isinstance(info, torch.Tensor) and isinstance(last_info, torch.Tensor):
        _check(torch.equal(info, last_info), "elastic_info changed between dispatch and combine")
    scales = kw["expert_scales"]
    _check(isinstance(scales, torch.Tensor), "expert_scales must be a tensor")
    assert isinstance(scales, torch.Tensor)
    _check(scales.dtype == torch.float32, f"expert_scales must be float32, got {scales.dtype}")
    _check(tuple(scales.shape) == tuple(ids.shape), "expert_scales must be [BS, K]")
    for name in ("expand_x", "assist_info_for_combine", "ep_send_counts"):
        _check(isinstance(kw.get(name), torch.Tensor), f"{name} must be a tensor")
    x = last["x"]
    assert isinstance(x, torch.Tensor)
    return (x.float() * scales.sum(dim=1, keepdim=True)).to(x.dtype)
