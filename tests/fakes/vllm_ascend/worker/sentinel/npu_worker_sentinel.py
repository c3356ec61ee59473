"""Stand-in of ``vllm_ascend.worker.sentinel.npu_worker_sentinel`` (vLLM-Ascend's own sentinel).

``WorkerSentinel`` subclasses vLLM's GPU ``WorkerSentinel`` (bound when this module is
imported) and, like the real one, does not call its ``__init__``. ``fault_barrier_wrapper``
exists in three revisions on vLLM-Ascend's FT branches; :data:`BARRIER_REVISION` picks the
one the stand-in runs (a test sets it before driving the worker):

- ``"swallow"``: reads ``self.worker_sentinel``; on the first fault marks it faulted, asks
  it for the local device reset and returns the empty output (the fault is swallowed);
- ``"reraise"``: the same, but the fault propagates;
- ``"module_global"``: reads this module's ``_sentinel``, which only vLLM-Ascend's own
  ``WorkerSentinel.__init__`` sets: while ftengine's sentinel stands in its place the
  barrier does nothing at all; otherwise as ``"reraise"``.

While the sentinel it found is faulted, a wrapped method returns the empty output.
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

BARRIER_REVISIONS = ("swallow", "reraise", "module_global")
BARRIER_REVISION = "reraise"
_sentinel: Any = None
"""The newest revision's sentinel: set by vLLM-Ascend's ``WorkerSentinel.__init__`` only."""


def _barrier_sentinel(owner: Any) -> Any:
    if BARRIER_REVISION == "module_global":
        return _sentinel
    return getattr(owner, "worker_sentinel", None)


def fault_barrier_wrapper(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        sentinel = _barrier_sentinel(self)
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
            if BARRIER_REVISION == "swallow":
                return EMPTY_MODEL_RUNNER_OUTPUT
            raise

    return wrapped


class WorkerSentinel(GPUWorkerSentinel):
    """vLLM-Ascend's per-worker sentinel (what ftengine replaces, never subclasses)."""

    def __init__(self, worker: Any, device: torch.device) -> None:
        global _sentinel
        self.worker = worker
        self.device = device
        self.worker_faulted = False
        _sentinel = self

    def reset_device(self) -> None:
        torch_npu.npu.set_device(self.device.index or 0)
        torch_npu.npu.stop_device(self.device.index or 0)
        torch_npu.npu.restart_device(self.device.index or 0)
        torch_npu.distributed.reinit_process_group(None, False)
        torch_npu.npu.synchronize()
