"""What vLLM-Ascend's own configuration says about a worker: the scale-down facts and NZ policy.

Read from ``get_ascend_config()`` (``enable_fused_mc2``, ``enable_mc2_hierarchy_comm``,
``weight_nz_mode``), ``get_ascend_device_type()`` and the worker's vLLM config, so the NPU
backend's start-up preconditions check the deployment as it really is instead of passing
on defaults. What the backend sees for itself (torch_npu's MC2 ops, CANN's aclnn V3
kernels, the redundant slots) it checks on its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs

from ftengine.backends.npu_preconditions import NpuDeployment
from ftengine.backends.npu_reload import NzPolicy
from ftengine.integrations.vllm.shapes import WorkerLike
from ftengine.integrations.vllm_ascend.names import (
    ASCEND_CONFIG,
    ASCEND_CONFIG_MODULE,
    DEVICE_CONFIG_MODULE,
    DEVICE_TYPE,
    FUSED_MC2,
    HIERARCHY_COMM,
    MC2_V3_ENV,
    NZ_MODE,
    AscendGlueError,
    resolve,
)


@attrs.frozen
class AscendFacts:
    """One worker's deployment facts (for the preconditions) and NZ policy (for reloads)."""

    deployment: NpuDeployment
    nz: NzPolicy


def _option(config: object, name: str) -> object:
    try:
        return getattr(config, name)
    except AttributeError as exc:
        raise AscendGlueError(
            f"vllm-ascend's AscendConfig has no {name}: ftengine reads it to decide whether "
            "scale-down can work; update ftengine.integrations.vllm_ascend.names"
        ) from exc


def _env_flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "0").strip().lower() in ("1", "true")


def read_facts(
    worker: WorkerLike,
    *,
    unmanaged_eplb_models: tuple[str, ...] = (),
    environ: Mapping[str, str] | None = None,
) -> AscendFacts:
    """The facts of ``worker`` as vLLM-Ascend and vLLM configured it (``environ``: the
    process environment vLLM-Ascend reads its switches from)."""
    env = os.environ if environ is None else environ
    config = resolve(ASCEND_CONFIG_MODULE, ASCEND_CONFIG)()
    device_type = resolve(DEVICE_CONFIG_MODULE, DEVICE_TYPE)()
    nz_mode = _option(config, NZ_MODE)
    if not isinstance(nz_mode, int):
        raise AscendGlueError(f"vllm-ascend's {NZ_MODE} must be an int, found {nz_mode!r}")
    deployment = NpuDeployment(
        model_runner="v2" if worker.use_v2_model_runner else "v1",
        eplb_enabled=bool(worker.parallel_config.enable_eplb),
        fused_mc2=bool(_option(config, FUSED_MC2)),
        hierarchical_comm=bool(_option(config, HIERARCHY_COMM)),
        device_type=str(getattr(device_type, "name", device_type)),
        mc2_dispatch_v3=_env_flag(env, MC2_V3_ENV),
        unmanaged_eplb_models=unmanaged_eplb_models,
    )
    return AscendFacts(deployment=deployment, nz=NzPolicy(nz_mode))
