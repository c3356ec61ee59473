"""Every vLLM-Ascend (and vLLM) name the Ascend glue patches or reads, in one place.

vLLM-Ascend's fault-tolerance code lives only on open PR branches (#14113, #16145), so any
of these may move; each is checked against the stand-in built from those branches'
classes (``tests/unit/test_vllm_ascend_names.py``), and :func:`resolve` names the one that
moved instead of failing with a bare ``AttributeError``.
"""

from __future__ import annotations

import importlib
from typing import Any

from ftengine.errors import ConfigError

# Where the sentinel is built: ``NPUWorker._init_device`` calls the ``WorkerSentinel`` of
# its own module (imported from the sentinel module at import time).
WORKER_MODULE = "vllm_ascend.worker.worker"
WORKER_CLASS = "NPUWorker"
SENTINEL_MODULE = "vllm_ascend.worker.sentinel.npu_worker_sentinel"
SENTINEL_NAME = "WorkerSentinel"

# vLLM calls every worker's ``init_device`` through its wrapper: the last moment before
# ``_init_device`` sets the NPU up and creates the HCCL communicators.
WRAPPER_MODULE = "vllm.v1.worker.worker_base"
WRAPPER_CLASS = "WorkerWrapperBase"
INIT_DEVICE = "init_device"

# The worker's model steps; under async scheduling a step returns an AsyncModelRunnerOutput
# whose ``get_output`` is where device faults surface (vLLM-Ascend's AscendAsyncOutput).
WRAPPED_STEPS = ("execute_model", "sample_tokens")
GET_OUTPUT = "get_output"
OUTPUTS_MODULE = "vllm.v1.outputs"
EMPTY_OUTPUT = "EMPTY_MODEL_RUNNER_OUTPUT"

# Configuration: ``get_ascend_config()`` and ``get_ascend_device_type()`` (an enum; .name).
ASCEND_CONFIG_MODULE = "vllm_ascend.ascend_config"
ASCEND_CONFIG = "get_ascend_config"
FUSED_MC2 = "enable_fused_mc2"
HIERARCHY_COMM = "enable_mc2_hierarchy_comm"
NZ_MODE = "weight_nz_mode"
DEVICE_CONFIG_MODULE = "vllm_ascend.device.device_config"
DEVICE_TYPE = "get_ascend_device_type"
# Some #16145 revisions: MC2's V3 dispatch path, on with "1" (scale-down refuses it).
MC2_V3_ENV = "VLLM_ASCEND_ENABLE_MOE_DISTRIBUTE_V3"

# EPLB: the routing tables are rebuilt from the maps by ``refresh_model_routing_tables``
# (``vllm_ascend.distributed.eplb_state`` on #14113; #16145 imports it from
# ``vllm_ascend.distributed.eplb.state``: the first importable one is used).
ROUTING_MODULES = ("vllm_ascend.distributed.eplb_state", "vllm_ascend.distributed.eplb.state")
REFRESH_ROUTING = "refresh_model_routing_tables"
MOE_LAYERS = "moe_layers"  # on EplbModelState.model
# MTP speculative decoding: vLLM's ``speculative_config.method`` names it ("mtp",
# "deepseek_mtp", ...); its drafter has an EPLB state of its own (the newest #16145
# sentinel refreshes it; ftengine refuses scale-down instead).
SPECULATIVE_CONFIG = "speculative_config"
MTP = "mtp"
LAYER_EPLB_STATE = "eplb_state"  # on each MoE layer: AscendEplbLayerState
ROUTING_TABLE = "expert_replica_routing_table"
ROUTED_EXPERTS = "routed_experts"  # where a wrapped MoE layer keeps its weights, if present

# The MoE parameters the forward reads, by ftengine's slot-field name: the per-expert lists
# of the v2 runner with EPLB first, else the stacked ``[slots, ...]`` tensors.
SLOT_LISTS = {
    "w13": "w13_weight_list",
    "w2": "w2_weight_list",
    "w13_scale": "w13_weight_scale_fp32_list",
    "w2_scale": "w2_weight_scale_list",
    "w13_scale_int64": "fused_w1_scale_list",
    "w2_scale_int64": "fused_w2_scale_list",
}
SLOT_TENSORS = {
    "w13": "w13_weight",
    "w2": "w2_weight",
    "w13_scale": "w13_weight_scale_fp32",
    "w2_scale": "w2_weight_scale",
    "w13_offset": "w13_weight_offset",
    "w2_offset": "w2_weight_offset",
    "w13_scale_int64": "fused_w1_scale",
    "w2_scale_int64": "fused_w2_scale",
}
MOE_CONFIG = "moe_config"  # .moe_parallel_config.tp_rank / .tp_size: the MoE TP shard


class AscendGlueError(ConfigError):
    """vLLM-Ascend lacks a name the glue needs (it moved, or this is another version)."""


def resolve(module: str, name: str) -> Any:
    """``module.name``, or :class:`AscendGlueError` saying what moved."""
    try:
        found = importlib.import_module(module)
    except ImportError as exc:
        raise AscendGlueError(
            f"cannot import {module} ({exc}); ftengine's Ascend glue targets vllm-ascend's "
            "fault-tolerance branch (PR #16145): install that vllm-ascend"
        ) from exc
    try:
        return getattr(found, name)
    except AttributeError as exc:
        raise AscendGlueError(
            f"{module} has no {name}: this vllm-ascend is not the fault-tolerance branch "
            "ftengine targets (PR #16145), or the name moved; update "
            "ftengine.integrations.vllm_ascend.names"
        ) from exc


def resolve_first(modules: tuple[str, ...], name: str) -> Any:
    """``name`` from the first of ``modules`` that has it (see :func:`resolve`)."""
    errors = []
    for module in modules:
        try:
            return resolve(module, name)
        except AscendGlueError as exc:
            errors.append(str(exc))
    raise AscendGlueError(f"no module of {list(modules)} has {name}: " + "; ".join(errors))


def missing() -> list[str]:
    """Every name above this vLLM-Ascend / vLLM lacks, as ``module.name`` (empty: all found).

    For a person on an Ascend machine: ``python -c "from ftengine.integrations.vllm_ascend
    .names import missing; print(missing() or 'all found')"``.
    """
    wanted = [
        (WRAPPER_MODULE, WRAPPER_CLASS),
        (WORKER_MODULE, WORKER_CLASS),
        (WORKER_MODULE, SENTINEL_NAME),
        (SENTINEL_MODULE, SENTINEL_NAME),
        (ASCEND_CONFIG_MODULE, ASCEND_CONFIG),
        (DEVICE_CONFIG_MODULE, DEVICE_TYPE),
        (OUTPUTS_MODULE, EMPTY_OUTPUT),
    ]
    problems = []
    for module, name in wanted:
        try:
            resolve(module, name)
        except AscendGlueError:
            problems.append(f"{module}.{name}")
    try:
        resolve_first(ROUTING_MODULES, REFRESH_ROUTING)
    except AscendGlueError:
        problems.append(f"{' or '.join(ROUTING_MODULES)}.{REFRESH_ROUTING}")
    return problems
