"""The vLLM general plugin: with ``--enable-fault-tolerance`` every worker runs ftengine.

vLLM loads ``ftengine.integrations.vllm.plugin:register`` (entry point group
``vllm.general_plugins``) in each of its processes before the worker class is imported.
``register`` puts :func:`worker_fault_adapter` where vLLM's GPU worker (and its CPU
subclass) builds its ``WorkerSentinel(worker=self)``, which vLLM does only when fault
tolerance is on: on vLLM's CPU platform that is ftengine's
:class:`~ftengine.integrations.vllm.worker.adapter.WorkerFaultAdapter`, elsewhere vLLM's own
sentinel (one warning). On vLLM-Ascend (platform "npu") it leaves vLLM's GPU modules alone:
vLLM-Ascend's ``NPUWorker`` is no GPU ``Worker`` and builds a sentinel of its own, which
ftengine's second entry point (``ftengine.integrations.vllm_ascend.plugin:register``) takes
over. It also installs
the engine-core agent and, on CPU, the DP+EP pieces vLLM lacks (``patches``), and routes
ftengine's logs through vLLM's logging with the ``[FT]`` prefix.

The package is laid out by the process each module runs in: ``worker/`` (vLLM's worker
process: the fault adapter, its backend and hooks), ``engine_core/`` (vLLM's engine-core
process: the agent beside ``EngineCoreSentinel``, re-inference, scale-down), ``api_server/``
(vLLM's API server: metrics, the FT router's checks), ``patches/`` (the vLLM names
replaced, by the process they run in); the modules here are shared by all three.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from ftengine.integrations.vllm.api_server.metrics import register_collector
from ftengine.integrations.vllm.logs import route_logs
from ftengine.integrations.vllm.messages import VllmUnavailable, import_vllm
from ftengine.integrations.vllm.patches.install import (
    apply_api_server_patches,
    apply_cpu_patches,
    apply_engine_core_patches,
)
from ftengine.integrations.vllm.patches.mechanism import VllmSeamMoved
from ftengine.integrations.vllm.shapes import WorkerLike
from ftengine.integrations.vllm.worker.adapter import WorkerFaultAdapter
from ftengine.integrations.vllm.worker.factory import (
    CPU,
    NPU,
    SUPPORTED_PLATFORMS,
    SentinelSeams,
    current_device_type,
)

if TYPE_CHECKING:
    from typing import Unpack  # 3.11+; annotations are never evaluated at run time

logger = logging.getLogger(__name__)

SENTINEL_MODULE = "vllm.v1.worker.sentinel.gpu_worker_sentinel"
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
SENTINEL_NAME = "WorkerSentinel"
"""vLLM's name (in both modules) that :func:`worker_fault_adapter` replaces."""

_upstream: dict[str, Any] = {}
_warned: list[str] = []


def register() -> None:
    """Install :func:`worker_fault_adapter` as vLLM's worker sentinel, the engine-core agent
    and, on vLLM's CPU platform, the DP+EP pieces it lacks (``patches``); idempotent."""
    try:
        modules = [import_vllm(SENTINEL_MODULE)]
    except VllmUnavailable as exc:
        logger.warning("ftengine's vLLM plugin is inactive: %s", exc)
        return
    device_type = current_device_type()
    # On vLLM-Ascend, replacing the GPU sentinel would make vLLM-Ascend's own sentinel, which
    # subclasses it, a half-initialised subclass of ours; vllm_ascend.plugin acts instead.
    if device_type != NPU:
        if WORKER_MODULE in sys.modules:  # imported already: it bound the name at import
            modules.append(sys.modules[WORKER_MODULE])
        original = getattr(modules[0], SENTINEL_NAME)
        if original is not worker_fault_adapter:
            _upstream[SENTINEL_NAME] = original
        for module in modules:
            setattr(module, SENTINEL_NAME, worker_fault_adapter)
    route_logs()
    register_collector()  # scraped only where vLLM serves /metrics: its API server
    try:
        if device_type in SUPPORTED_PLATFORMS:
            apply_engine_core_patches()
        if device_type == CPU:
            apply_cpu_patches()
        apply_api_server_patches()
    except VllmSeamMoved as exc:  # never break a deployment by being installed
        logger.error("[FT] ftengine's vLLM patches are off for this vLLM version: %s", exc)


def worker_fault_adapter(worker: WorkerLike, **seams: Unpack[SentinelSeams]) -> Any:
    """What vLLM's ``Worker.__init__`` builds as ``WorkerSentinel(worker=self)``: ftengine's
    on a platform it supports (or with a test's ``backend_factory``), else vLLM's own."""
    if seams.get("backend_factory") is None:
        device_type = current_device_type()
        if device_type not in SUPPORTED_PLATFORMS:
            if not _warned:
                _warned.append(device_type)
                logger.warning(
                    "[FT] ftengine does not support vLLM platform %r yet (it supports %s): "
                    "vLLM's own worker sentinel runs",
                    device_type,
                    ", ".join(SUPPORTED_PLATFORMS),
                )
            return _upstream[SENTINEL_NAME](worker=worker)
    return WorkerFaultAdapter(worker, **seams)
