"""Start-up checks for NPU scale-down: every unmet precondition reported at once.

MC2 scale-down masks dead ranks through ``elastic_info`` in dispatch_v2 / combine_v2;
that only works on the deployments listed in :func:`scale_down_problems`. TP > 1 is fine:
each DP rank owns ``tp_size`` EP ranks and MC2 is always called with ``tp_world_size=1``.
"""

from __future__ import annotations

import logging

import attrs

from ftengine.errors import PreconditionFailed

logger = logging.getLogger(__name__)

ELASTIC_INFO_DEVICE = "A3"
"""The Atlas generation whose MC2 ops implement ``elastic_info`` (reserved on A2)."""


@attrs.frozen
class NpuDeployment:
    """The facts about a vLLM-Ascend deployment that decide whether scale-down can work.

    ``model_runner``: "v1" or "v2"; ``num_redundant_experts``: EPLB's extra slots;
    ``fused_mc2``: vllm-ascend's ``enable_fused_mc2`` (its fused dispatch/FFN/combine ops
    take no ``elastic_info``); ``hierarchical_comm``: ``enable_mc2_hierarchy_comm``;
    ``has_dispatch_v2``: whether torch_npu offers ``npu_moe_distribute_dispatch_v2`` /
    ``combine_v2``; ``elastic_info_kernels``: whether CANN has the aclnn V4 / V3 MC2 kernels
    those switch to when ``elastic_info`` is passed (None: could not tell, warned);
    ``device_type``: vllm-ascend's ``AscendDeviceType`` name ("A2", "A3", ...; the op docs
    list ``elastic_info`` as reserved, unsupported, on Atlas A2); ``mc2_dispatch_v3``: MC2's
    V3 dispatch path is on (its ``elastic_info`` is refreshed by a call ftengine does not
    make); ``unmanaged_eplb_models``: EPLB models besides the served one (the MTP drafter),
    whose maps and routing tables a scale-down would leave pointing at dead ranks.
    """

    model_runner: str = "v2"
    eplb_enabled: bool = True
    num_redundant_experts: int = 1
    fused_mc2: bool = False
    hierarchical_comm: bool = False
    has_dispatch_v2: bool = True
    elastic_info_kernels: bool | None = True
    device_type: str = ELASTIC_INFO_DEVICE
    mc2_dispatch_v3: bool = False
    unmanaged_eplb_models: tuple[str, ...] = ()


def scale_down_problems(deployment: NpuDeployment) -> tuple[str, ...]:
    """Every reason scale-down cannot run on ``deployment`` (empty when it can)."""
    problems: list[str] = []
    if deployment.model_runner != "v2":
        problems.append(
            f"scale-down needs the v2 model runner, found {deployment.model_runner!r}: "
            "enable the v2 model runner"
        )
    if not deployment.eplb_enabled:
        problems.append("scale-down needs EPLB: start with --enable-eplb")
    if deployment.num_redundant_experts <= 0:
        problems.append(
            f"scale-down needs num_redundant_experts > 0, found "
            f"{deployment.num_redundant_experts}: set --eplb-config "
            "'{\"num_redundant_experts\": N}' so survivors have spare slots"
        )
    if deployment.fused_mc2:
        problems.append("scale-down does not support fused MC2: disable fused MC2")
    if deployment.hierarchical_comm:
        problems.append("scale-down does not support hierarchical communication: disable it")
    if not deployment.has_dispatch_v2:
        problems.append(
            "torch_npu lacks npu_moe_distribute_dispatch_v2 / combine_v2 (elastic_info): "
            "upgrade torch_npu and CANN"
        )
    if deployment.elastic_info_kernels is False:
        problems.append(
            "CANN lacks the aclnn MC2 kernels dispatch_v2 / combine_v2 need once "
            "elastic_info is passed (aclnnMoeDistributeDispatchV4 / aclnnMoeDistributeCombineV4, "
            "or aclnnMoeDistributeDispatchV3 / aclnnMoeDistributeCombineV3; every CANN "
            "op-API library was searched): install CANN 8.5.x"
        )
    if deployment.mc2_dispatch_v3:
        problems.append(
            "scale-down does not support vLLM-Ascend's MC2 V3 dispatch "
            "(VLLM_ASCEND_ENABLE_MOE_DISTRIBUTE_V3): its elastic_info is refreshed by "
            "set_v3_elastic_info_from_ep(), which ftengine does not call; unset the variable"
        )
    if deployment.unmanaged_eplb_models:
        problems.append(
            "scale-down updates the EPLB maps and routing tables of the served model only; "
            f"{', '.join(deployment.unmanaged_eplb_models)} would keep routing to dead ranks "
            "(vLLM-Ascend's own sentinel also refreshes the MTP drafter's EPLB state): turn "
            "MTP off for scale-down"
        )
    if deployment.device_type != ELASTIC_INFO_DEVICE:
        problems.append(
            f"MC2 elastic_info is only supported on Atlas {ELASTIC_INFO_DEVICE}, found "
            f"{deployment.device_type!r}"
        )
    return tuple(problems)


def check_scale_down(deployment: NpuDeployment) -> None:
    """Raise one ``PreconditionFailed`` listing every unmet scale-down precondition."""
    problems = scale_down_problems(deployment)
    if deployment.elastic_info_kernels is None:
        logger.warning(
            "could not tell whether CANN has the aclnn V4 / V3 MC2 kernels elastic_info "
            "needs (some op-API library did not load); the first dummy batch of a "
            "scale-down will fail if it does not"
        )
    if problems:
        raise PreconditionFailed(
            f"NPU scale-down is not possible ({len(problems)} problem"
            f"{'s' if len(problems) > 1 else ''}): " + "; ".join(problems),
            reasons=problems,
        )
