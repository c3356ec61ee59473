"""The vLLM names ftengine replaces in vLLM's worker process on the CPU platform: what it
lacks for DP+EP MoE.

With ``--enable-expert-parallel`` and DP > 1, vLLM on CPU picks the
``allgather_reducescatter`` all2all, which calls ``all_gatherv`` / ``reduce_scatterv`` on the
group's communicator: ``CpuCommunicator`` inherits the base class's ``NotImplementedError``.
Both are written over gloo (``worker/cpu_collectives.py``). Next,
``CPUUnquantizedExperts.apply`` hands the *global* expert ids to a kernel that holds only
this rank's experts (it ignores ``expert_map``) and segfaults; the wrapper maps the ids
through ``expert_map`` and gives the experts this rank does not hold a zero weight (their
rows are then summed in by the other ranks' combine).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from ftengine.integrations.vllm.patches.mechanism import PATCHED_MARK, Patch, replacing
from ftengine.integrations.vllm.worker.cpu_collectives import (
    all_gatherv,
    local_expert_ids,
    reduce_scatterv,
)

COMMUNICATOR_MODULE = "vllm.distributed.device_communicators.cpu_communicator"
CPU_WORKER_MODULE = "vllm.v1.worker.cpu_worker"
EXPERTS_MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"


def _ep_correct_apply(apply: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(apply)
    def ep_apply(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(apply).bind(self, *args, **kwargs)
        arguments = bound.arguments
        arguments["topk_ids"], arguments["topk_weights"] = local_expert_ids(
            arguments["topk_ids"], arguments["topk_weights"], arguments["expert_map"]
        )
        arguments["expert_map"] = None  # the ids are local now
        apply(*bound.args, **bound.kwargs)

    setattr(ep_apply, PATCHED_MARK, apply)
    return ep_apply


CPU_PATCHES = (
    Patch(
        COMMUNICATOR_MODULE, "CpuCommunicator", "all_gatherv", ("input_", "dim", "sizes"),
        replacing(all_gatherv),
    ),
    Patch(
        COMMUNICATOR_MODULE, "CpuCommunicator", "reduce_scatterv", ("input_", "dim", "sizes"),
        replacing(reduce_scatterv),
    ),
    Patch(
        EXPERTS_MODULE,
        "CPUUnquantizedExperts",
        "apply",
        (
            "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation",
            "global_num_experts", "expert_map", "a1q_scale", "a2_scale", "workspace13",
            "workspace2", "expert_tokens_meta", "apply_router_weight_on_input",
        ),
        _ep_correct_apply,
    ),
)  # fmt: skip


def _alone_when_rejoining(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def init_worker_distributed_environment(
        vllm_config: Any,
        rank: int,
        distributed_init_method: str | None = None,
        local_rank: int = -1,
        backend: str = "nccl",
    ) -> None:
        from ftengine.integrations.vllm.worker.rejoin import init_distributed

        init_distributed(init, vllm_config, rank, distributed_init_method, local_rank, backend)

    setattr(init_worker_distributed_environment, PATCHED_MARK, init)
    return init_worker_distributed_environment


REJOIN_WORKER_PATCHES = (
    # A restarted rank that rejoins initialises its distributed state alone
    # (worker/rejoin.py); vLLM's own otherwise. The name the CPU worker imported.
    Patch(
        CPU_WORKER_MODULE, "", "init_worker_distributed_environment",
        ("vllm_config", "rank", "distributed_init_method", "local_rank", "backend"),
        _alone_when_rejoining,
    ),
)  # fmt: skip
