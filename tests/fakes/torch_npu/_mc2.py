"""Fake MC2 dispatch_v2 / combine_v2 with the published schemas and the A2 / A3 limits.

The signatures are the op-plugin schemas of torch_npu 7.3 (positional parameters first,
then keyword-only ones, nothing else: a misspelt keyword is a ``TypeError``). The checks
are the op docs': static arguments, ``elastic_info``'s layout, the expert-id bound, the
SoC limits (A3: H in [1024, 8192], BS <= 512, no dispatch ``expert_scales``; A2: no
``elastic_info``, BS <= 256) and that ``elastic_info`` needs CANN's aclnn V3 kernels. One
process cannot all-to-all, so experts act as the identity: combine returns
``x * sum(expert_scales)`` per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tests.fakes.npu_state import ACLNN_V3, COMBINE, DISPATCH, STATE, AclnnMissing, Mc2ArgumentError

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


def _int(kw: Mapping[str, object], name: str) -> int:
    value = kw[name]
    _check(isinstance(value, int) and not isinstance(value, bool), f"{name} must be an int")
    assert isinstance(value, int)
    return value


def _check_static(kw: Mapping[str, object], op: str) -> tuple[int, int, int]:
    """Static arguments; returns (world, rank, local experts per MoE rank)."""
    world, rank, experts = (
        _int(kw, "ep_world_size"),
        _int(kw, "ep_rank_id"),
        _int(kw, "moe_expert_num"),
    )
    shared_ranks = _int(kw, "shared_expert_rank_num")
    group_ep = kw["group_ep"]
    _check(isinstance(group_ep, str) and 1 <= len(group_ep) < 128, "group_ep: 1..127 chars")
    assert isinstance(group_ep, str)
    _check(group_ep != kw["group_tp"], "group_ep must differ from group_tp")
    STATE.require_group(group_ep, op)
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


def _check_kernel(kw: Mapping[str, object], kernel: str) -> None:
    """elastic_info (and the special-expert counts) switch the op to CANN's aclnn V3 (V4)."""
    special = any(
        _int(kw, name) for name in ("zero_expert_num", "copy_expert_num", "const_expert_num")
    )
    successor = kernel.replace("V3", "V4")  # op-plugin prefers V4 where CANN has it
    needed = kw["elastic_info"] is not None or special
    if needed and not (STATE.has_aclnn(kernel) or STATE.has_aclnn(successor)):
        raise AclnnMissing(
            f"{kernel} not found: elastic_info needs a CANN with the aclnn V3 kernels"
        )


def _check_soc(kw: Mapping[str, object], bs: int, hidden: int) -> None:
    if STATE.soc == "A3":
        _check(1024 <= hidden <= 8192, f"A3: H must be in [1024, 8192], got {hidden}")
        _check(0 < bs <= 512, f"A3: BS must be in (0, 512], got {bs}")
        _check(kw.get("expert_scales") is None, "A3: expert_scales is not supported")
    elif STATE.soc == "A2":
        _check(kw["elastic_info"] is None, "A2: elastic_info must be None (reserved)")
        _check(0 < bs <= 256, f"A2: BS must be in (0, 256], got {bs}")
    else:
        raise Mc2ArgumentError(f"the fake models Atlas A2 and A3, not {STATE.soc!r}")


def _check_elastic(kw: Mapping[str, object], world: int, local: int) -> tuple[int, int]:
    """Validate elastic_info; returns the id bound the kernel enforces and this rank's index.

    Both are the original values unless elastic_info's flag is set (then: shrunk expert
    count and dense rank).
    """
    experts, rank = _int(kw, "moe_expert_num"), _int(kw, "ep_rank_id")
    info = kw["elastic_info"]
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
    _check(kw["tp_world_size"] in (0, 1), "elastic_info needs tp_world_size == 1")
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


def _dispatch(kw: Mapping[str, Any]) -> tuple[torch.Tensor | None, ...]:
    """Validate a dispatch_v2 call like the op docs; its seven outputs, documented shapes."""
    world, _, local = _check_static(kw, DISPATCH)
    x = kw["x"]
    _check(isinstance(x, torch.Tensor) and x.dim() == 2, "x must be a 2-D tensor [BS, H]")
    _check(x.dtype in (torch.bfloat16, torch.float16), f"x must be bf16/fp16, got {x.dtype}")
    bs, hidden = x.shape
    _check_soc(kw, bs, hidden)
    _check_kernel(kw, ACLNN_V3[0])
    bound, my_rank = _check_elastic(kw, world, local)
    ids = _check_ids(kw["expert_ids"], bound, bs)
    global_bs, quant_mode = _int(kw, "global_bs"), _int(kw, "quant_mode")
    _check(
        global_bs == 0 or global_bs >= bs * world, f"global_bs must be 0 or >= BS*W: {global_bs}"
    )
    _check(quant_mode in (0, 2), f"quant_mode must be 0 or 2, got {quant_mode}")
    rows = (global_bs or bs * world) * min(local, ids.shape[1])
    mine = ids // local == my_rank
    token_nums = torch.bincount((ids[mine] % local).long(), minlength=local)[:local]
    return (
        torch.zeros(rows, hidden, dtype=torch.int8 if quant_mode else x.dtype),
        torch.ones(rows, dtype=torch.float32) if quant_mode else None,
        torch.zeros(rows * 128, dtype=torch.int32),
        token_nums.to(torch.int64),
        torch.zeros(world * local, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        None,
    )


def _combine(kw: Mapping[str, Any]) -> torch.Tensor:
    """Validate a combine_v2 call against the dispatch before it; the identity experts' sum."""
    last = STATE.last_dispatch
    _check(last is not None, "combine_v2 without a dispatch_v2 before it")
    assert last is not None
    for name in _STATIC:
        _check(kw[name] == last[name], f"{name} differs from dispatch: {kw[name]!r}")
    _check_static(kw, COMBINE)
    _check_kernel(kw, ACLNN_V3[1])
    ids, info, last_info = kw["expert_ids"], kw["elastic_info"], last["elastic_info"]
    _check(torch.equal(ids, last["expert_ids"]), "combine must get the expert_ids dispatch got")
    _check((info is None) == (last_info is None), "pass elastic_info to both ops or neither")
    if info is not None:
        _check(torch.equal(info, last_info), "elastic_info changed between dispatch and combine")
    scales = kw["expert_scales"]
    _check(isinstance(scales, torch.Tensor), "expert_scales must be a tensor")
    _check(scales.dtype == torch.float32, f"expert_scales must be float32, got {scales.dtype}")
    _check(tuple(scales.shape) == tuple(ids.shape), "expert_scales must be [BS, K]")
    for name in ("expand_x", "assist_info_for_combine", "ep_send_counts"):
        _check(isinstance(kw[name], torch.Tensor), f"{name} must be a tensor")
    x = last["x"]
    combined: torch.Tensor = (x.float() * scales.sum(dim=1, keepdim=True)).to(x.dtype)
    return combined


def npu_moe_distribute_dispatch_v2(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    group_ep: str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    scales: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None,
    expert_scales: torch.Tensor | None = None,
    elastic_info: torch.Tensor | None = None,
    performance_info: torch.Tensor | None = None,
    group_tp: str = "",
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    quant_mode: int = 0,
    global_bs: int = 0,
    expert_token_nums_type: int = 1,
    comm_alg: str = "",
    zero_expert_num: int = 0,
    copy_expert_num: int = 0,
    const_expert_num: int = 0,
) -> tuple[torch.Tensor | None, ...]:
    """Validate like the op docs; return the seven outputs with documented shapes.

    Recorded with every parameter bound (so a test reads any of them by name).
    """
    kw = dict(locals())
    STATE.record(DISPATCH, **kw)
    STATE.require_usable(DISPATCH)
    outputs = _dispatch(kw)
    STATE.last_dispatch = kw
    return outputs


def npu_moe_distribute_combine_v2(
    expand_x: torch.Tensor,
    expert_ids: torch.Tensor,
    assist_info_for_combine: torch.Tensor,
    ep_send_counts: torch.Tensor,
    expert_scales: torch.Tensor,
    group_ep: str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    tp_send_counts: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None,
    expand_scales: torch.Tensor | None = None,
    shared_expert_x: torch.Tensor | None = None,
    elastic_info: torch.Tensor | None = None,
    ori_x: torch.Tensor | None = None,
    const_expert_alpha_1: torch.Tensor | None = None,
    const_expert_alpha_2: torch.Tensor | None = None,
    const_expert_v: torch.Tensor | None = None,
    performance_info: torch.Tensor | None = None,
    group_tp: str = "",
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    global_bs: int = 0,
    comm_quant_mode: int = 0,
    comm_alg: str = "",
    zero_expert_num: int = 0,
    copy_expert_num: int = 0,
    const_expert_num: int = 0,
) -> torch.Tensor:
    """Validate against the matching dispatch; identity experts: ``x * sum_k(expert_scales)``."""
    kw = dict(locals())
    STATE.record(COMBINE, **kw)
    STATE.require_usable(COMBINE)
    return _combine(kw)
