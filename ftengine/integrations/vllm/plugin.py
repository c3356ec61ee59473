"""The vLLM general plugin: with ``--enable-fault-tolerance`` every worker runs ftengine.

vLLM loads ``ftengine.integrations.vllm.plugin:register`` (entry point group
``vllm.general_plugins``) in each of its processes before the worker class is imported.
``register`` puts :class:`PluginWorkerSentinel` where vLLM's GPU worker builds its
``WorkerSentinel(worker=self)``, which vLLM does only when fault tolerance is on.
vLLM has no hook for "model loaded" or "model step failed", so the sentinel wraps the
worker's ``load_model`` (build the engine once the EPLB maps exist) and ``execute_model``
(report the exception, then re-raise it for vLLM's own fault path).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ftengine.integrations.vllm.config import VllmFtSettings
from ftengine.integrations.vllm.cpu_patches import apply_cpu_patches
from ftengine.integrations.vllm.factory import (
    CPU,
    NPU,
    BackendFactory,
    SentinelSeams,
    backend_for_platform,
    build_worker_sentinel,
    current_device_type,
)
from ftengine.integrations.vllm.messages import VllmUnavailable, import_vllm
from ftengine.integrations.vllm.sentinel import FtengineWorkerSentinel
from ftengine.integrations.vllm.shapes import WorkerLike

if TYPE_CHECKING:
    from typing import Unpack  # 3.11+; annotations are never evaluated at run time

logger = logging.getLogger(__name__)

SENTINEL_MODULE = "vllm.v1.worker.sentinel.gpu_worker_sentinel"
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
SENTINEL_NAME = "WorkerSentinel"
WRAPPED_STEPS = ("execute_model", "sample_tokens")


def register() -> None:
    """Install :class:`PluginWorkerSentinel` as vLLM's worker sentinel and, on vLLM's CPU
    platform, the DP+EP pieces it lacks (``cpu_patches``); idempotent."""
    try:
        modules = [import_vllm(SENTINEL_MODULE)]
    except VllmUnavailable as exc:
        logger.warning("ftengine's vLLM plugin is inactive: %s", exc)
        return
    if WORKER_MODULE in sys.modules:  # imported already: it bound the name at import
        modules.append(sys.modules[WORKER_MODULE])
    for module in modules:
        setattr(module, SENTINEL_NAME, PluginWorkerSentinel)
    if current_device_type() == CPU:
        apply_cpu_patches()


class PluginWorkerSentinel:
    """Stands where vLLM builds ``WorkerSentinel(worker)``.

    At construction (vLLM start-up, before the device and the model exist) it checks
    ftengine's settings and the platform, so a bad flag or an unsupported platform stops
    vLLM at once, and applies the NPU op timeout before the HCCL groups are created. The
    ftengine sentinel is built by :meth:`attach` after ``load_model``. ``seams`` (see
    ``build_worker_sentinel``) are for tests; vLLM passes only ``worker``.
    """

    def __init__(self, worker: WorkerLike, **seams: Unpack[SentinelSeams]) -> None:
        self.worker = worker
        self.settings = VllmFtSettings.from_vllm_config(worker.vllm_config)
        if seams.get("backend_factory") is None:
            seams["backend_factory"] = self._platform_backend()
        self._build: Callable[[], FtengineWorkerSentinel] = functools.partial(
            build_worker_sentinel, worker, settings=self.settings, **seams
        )
        self.ready: FtengineWorkerSentinel | None = None
        _wrap_worker(worker, self)

    def _platform_backend(self) -> BackendFactory:
        """vLLM's platform's backend (or ``UnsupportedPlatform``); on Ascend the op timeout
        is applied now, before the HCCL groups exist."""
        device_type = current_device_type()
        factory = backend_for_platform(device_type)
        if device_type == NPU:
            _apply_npu_op_timeout(self.settings)
        return factory

    def attach(self) -> FtengineWorkerSentinel:
        """Build the ftengine sentinel (once; the model and its EPLB maps must be loaded)."""
        if self.ready is None:
            self.ready = self._build()
        return self.ready

    def handle_command(self, ft_request: object) -> Any:
        """vLLM's ``Worker.handle_ft_command`` entry; see ``FtengineWorkerSentinel``."""
        return self._attached().handle_command(ft_request)

    def handle_ft_command(self, ft_request: object) -> Any:
        """``FaultToleranceRequest`` -> ``FaultToleranceResult``; see ``FtengineWorkerSentinel``."""
        return self._attached().handle_ft_command(ft_request)

    def on_fault(self, exc: BaseException) -> None:
        """Report an exception from a model step (ignored before the model is loaded)."""
        if self.ready is not None:
            self.ready.on_fault(exc)

    def _attached(self) -> FtengineWorkerSentinel:
        # A command before load_model finished: build now (the model runner raises if the
        # maps do not exist, and vLLM's engine core reports that as the command's failure).
        return self.attach()


def _wrap_worker(worker: WorkerLike, sentinel: PluginWorkerSentinel) -> None:
    """Instance-level wrappers: build after ``load_model``; report model-step exceptions."""
    load = getattr(worker, "load_model", None)
    if callable(load):

        @functools.wraps(load)
        def load_then_attach(*args: Any, **kwargs: Any) -> Any:
            out = load(*args, **kwargs)
            sentinel.attach()
            return out

        setattr(worker, "load_model", load_then_attach)  # noqa: B010 - an instance attribute
    for name in WRAPPED_STEPS:
        step = getattr(worker, name, None)
        if callable(step):
            setattr(worker, name, _reporting(step, sentinel))


def _reporting(step: Callable[..., Any], sentinel: PluginWorkerSentinel) -> Callable[..., Any]:
    @functools.wraps(step)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return step(*args, **kwargs)
        except Exception as exc:
            sentinel.on_fault(exc)
            raise

    return run


def _apply_npu_op_timeout(settings: VllmFtSettings) -> None:
    """``ft_communication_abort_timeout`` before HCCL exists (the NPU backend re-applies it)."""
    if not settings.npu.communication_abort_timeout_s:
        return
    from ftengine.backends.npu_runtime import NpuRuntime
    from ftengine.backends.npu_timeouts import OpTimeoutController

    OpTimeoutController(NpuRuntime.load(), os.environ).apply(
        settings.npu.communication_abort_timeout_s
    )
