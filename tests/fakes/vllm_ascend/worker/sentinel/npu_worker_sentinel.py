"""Stand-in of ``vllm_ascend.worker.sentinel.npu_worker_sentinel`` (vLLM-Ascend's own sentinel).

``WorkerSentinel`` subclasses vLLM's GPU ``WorkerSentinel`` (bound when this module is
imported) and, like the real one, does not call its ``__init__``. ``fault_barrier_wrapper``
is the latest revision's: on the first fault of a wrapped method it marks the worker's
sentinel faulted, asks it for the local device reset and propagates the fault; while
faulted, wrapped methods return the empty output.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch_npu
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
from vllm.v1.worker.sentinel.gpu_worker_sentinel import WorkerSentinel as GPUWorkerSentinel

logger = logging.getLogger(__name__)


def fault_barrier_wrapper(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        sentinel = getattr(self, "worker_sentinel", None)
        if sentinel is not None and sentinel.worker_faulted:
            return EMPTY_MODEL_RUNNER_OUTPUT
        try:
            return func(self, *args, **kwargs)
        except Exception:
            if sentinel is None:
                raise
            sentinel.worker_faulted = True
            try:
                sentinel.reset_device()
            except Exception:
                logger.exception("[FT] self device reset failed")
            raise

    return wrapped


class WorkerSentinel(GPUWorkerSentinel):
    """vLLM-Ascend's per-worker sentinel (what ftengine replaces, never subclasses)."""

    def __init__(self, worker: Any, device: torch.device) -> None:
        self.worker = worker
        self.device = device
        self.worker_faulted = False

    def reset_device(self) -> None:
        torch_npu.npu.set_device(self.device.index or 0)
        torch_npu.npu.stop_device(self.device.index or 0)
        torch_npu.npu.restart_device(self.device.index or 0)
        torch_npu.distributed.reinit_process_group(None, False)
        torch_npu.npu.synchronize()
