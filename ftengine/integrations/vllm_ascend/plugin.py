"""Registration on vLLM-Ascend: take the place where ``NPUWorker._init_device`` builds its sentinel.

:func:`register` is ftengine's second ``vllm.general_plugins`` entry point
(``ftengine_ascend``; with ``VLLM_PLUGINS`` set, name it beside ``ftengine``) and acts only
when vLLM's platform is "npu" (:func:`install`). It wraps vLLM's
``WorkerWrapperBase.init_device``, through which vLLM calls every worker's ``init_device``:
right before vLLM-Ascend's ``_init_device`` sets the NPU up and creates the HCCL
communicators, a fault-tolerant worker gets the environment FT needs (``npu_env``, the HCCL
timeouts, the op timeout) and its module's ``WorkerSentinel`` name is pointed at ftengine's
sentinel, which ``_init_device`` then builds as ``WorkerSentinel(worker=self,
device=device)``. vLLM's GPU sentinel module is never touched (vLLM-Ascend's sentinel
subclasses it), nor is vLLM-Ascend's sentinel class.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, MutableMapping
from typing import Any

from ftengine.backends.npu_env import apply_ft_environment
from ftengine.backends.npu_runtime import NpuRuntime
from ftengine.backends.npu_timeouts import OpTimeoutController
from ftengine.integrations.vllm.config import VllmFtSettings
from ftengine.integrations.vllm.messages import VllmUnavailable
from ftengine.integrations.vllm.shapes import WorkerLike
from ftengine.integrations.vllm.worker.factory import NPU, current_device_type
from ftengine.integrations.vllm_ascend.engine_core import require_engine_core
from ftengine.integrations.vllm_ascend.names import (
    INIT_DEVICE,
    SENTINEL_NAME,
    WORKER_MODULE,
    WRAPPER_CLASS,
    WRAPPER_MODULE,
    resolve,
)
from ftengine.integrations.vllm_ascend.sentinel import AscendWorkerSentinel

logger = logging.getLogger(__name__)

SentinelFactory = Callable[..., Any]
"""What ``_init_device`` calls as ``WorkerSentinel(worker=..., device=...)``."""

_ORIGINAL = "__ftengine_original__"


def register() -> None:
    """The entry point vLLM loads in each of its processes: :func:`install` on an NPU."""
    try:
        device_type = current_device_type()
    except VllmUnavailable as exc:
        logger.warning("ftengine's vLLM-Ascend plugin is inactive: %s", exc)
        return
    if device_type == NPU:
        install()


def install(sentinel: SentinelFactory = AscendWorkerSentinel) -> None:
    """Wrap ``WorkerWrapperBase.init_device`` (idempotent: installing again only swaps
    ``sentinel``, a test's seam)."""
    wrapper = resolve(WRAPPER_MODULE, WRAPPER_CLASS)
    current = getattr(wrapper, INIT_DEVICE)
    original = getattr(current, _ORIGINAL, current)

    @functools.wraps(original)
    def init_device(self: Any, *args: Any, **kwargs: Any) -> Any:
        worker = getattr(self, "worker", None)
        if worker is not None:
            prepare_worker(worker, sentinel)
        return original(self, *args, **kwargs)

    setattr(init_device, _ORIGINAL, original)
    setattr(wrapper, INIT_DEVICE, init_device)


def unregister() -> None:
    """Put vLLM's own ``init_device`` back (tests)."""
    wrapper = resolve(WRAPPER_MODULE, WRAPPER_CLASS)
    original = getattr(getattr(wrapper, INIT_DEVICE), _ORIGINAL, None)
    if original is not None:
        setattr(wrapper, INIT_DEVICE, original)


def prepare_worker(
    worker: WorkerLike,
    sentinel: SentinelFactory = AscendWorkerSentinel,
    *,
    environ: MutableMapping[str, str] | None = None,
) -> bool:
    """Before ``NPUWorker._init_device``: the FT environment, then ``sentinel`` where it
    builds its own. Returns whether it took control (FT on, a vLLM-Ascend ``NPUWorker``).

    A bad flag raises ``VllmConfigError`` here, and a vLLM whose engine-core seams ftengine
    cannot patch (``engine_core``) ``VllmSeamMoved``, so vLLM stops before touching the NPU.
    """
    parallel = worker.parallel_config
    if not parallel.enable_fault_tolerance:
        return False
    module = sys.modules.get(type(worker).__module__)
    if module is None or module.__name__ != WORKER_MODULE or not hasattr(module, SENTINEL_NAME):
        logger.warning(
            "[FT] %s is not vLLM-Ascend's NPUWorker (%s.%s): ftengine leaves it alone",
            type(worker).__qualname__,
            WORKER_MODULE,
            SENTINEL_NAME,
        )
        return False
    settings = VllmFtSettings.from_vllm_config(worker.vllm_config)
    require_engine_core()
    env = os.environ if environ is None else environ
    apply_ft_environment(env, parallel.tensor_parallel_size)
    if settings.npu.communication_abort_timeout_s:
        OpTimeoutController(NpuRuntime.load(), env).apply(
            settings.npu.communication_abort_timeout_s
        )
    setattr(module, SENTINEL_NAME, sentinel)
    logger.info(
        "[FT] ftengine takes over vLLM-Ascend's worker sentinel (DP rank %d, rank %d): "
        "TASK_QUEUE_ENABLE=%s, op timeout %s s",
        parallel.data_parallel_rank,
        worker.rank,
        env.get("TASK_QUEUE_ENABLE"),
        settings.npu.communication_abort_timeout_s or "torch_npu's default",
    )
    return True
