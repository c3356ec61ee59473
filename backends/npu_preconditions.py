"""Start-up checks for NPU scale-down: every unmet precondition reported at once.

MC2 scale-down masks dead ranks through ``elastic_info`` in dispatch_v2 / combine_v2;
that only works on the deployments listed in :func:`scale_down_problems`.
"""

from __future__ import annotations

import attrs

from ftengine.errors import PreconditionFailed


@attrs.frozen
class NpuDeployment:
    """The facts about a vLLM-Ascend deployment that decide whether scale-down can work.

    ``model_runner``: "v1" or "v2"; ``num_redundant_experts``: EPLB's extra slots;
    ``tp_size``: tensor parallel size of the MoE layers; ``has_dispatch_v2``: whether
    torch_npu offers ``npu_moe_distribute_dispatch_v2`` / ``combine_v2``; ``device_type``:
    "A2" or "A3" (the op docs list ``elastic_info`` as a reserved, unsupported argument on
    Atlas A2, so the dead-rank mask needs A3).
    """

    model_runner: str = "v2"
    eplb_enabled: bool = True
    num_redundant_experts: int = 1
    fused_mc2: bool = False
    hierarchical_comm: bool = False
    tp_size: int = 1
    has_dispatch_v2: bool = True
    device_type: str = "A3"


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
    if deployment.tp_size != 1:
        problems.append(
            f"elastic_info is only valid with tp_world_size == 1, found tp {deployment.tp_size}"
        )
    if not deployment.has_dispatch_v2:
        problems.append(
            "torch_npu lacks npu_moe_distribute_dispatch_v2 / combine_v2 (elastic_info): "
            "upgrade torch_npu and CANN"
        )
    if deployment.device_type != "A3":
        problems.append(
            f"MC2 elastic_info is only supported on Atlas A3, found {deployment.device_type!r}"
        )
    return tuple(problems)


def check_scale_down(deployment: NpuDeployment) -> None:
    """Raise one ``PreconditionFailed`` listing every unmet scale-down precondition."""
    problems = scale_down_problems(deployment)
    if problems:
        raise PreconditionFailed(
            f"NPU scale-down is not possible ({len(problems)} problem"
            f"{'s' if len(problems) > 1 else ''}): " + "; ".join(problems),
            reasons=problems,
        )
