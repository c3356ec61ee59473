"""The sentinel vLLM-Ascend's ``NPUWorker._init_device`` builds once ftengine is registered.

``WorkerSentinel(worker=self, device=device)`` becomes :class:`AscendWorkerSentinel`: the
generic vLLM plugin sentinel (settings checked now, ftengine's sentinel built after
``load_model``, model-step exceptions reported) plus the NPU fault barrier around every
model step *and* around the ``get_output`` of the asynchronous outputs the steps return
(vLLM-Ascend's ``AscendAsyncOutput``), where a device fault of an async step surfaces. It
is not vLLM-Ascend's sentinel class nor a subclass of it: that class stays untouched.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any, TypedDict, cast

import torch

from ftengine.backends.npu import NpuBackend
from ftengine.backends.npu_env import ft_environment_problems
from ftengine.backends.npu_groups import GroupFactory
from ftengine.backends.npu_runtime import NpuRuntime
from ftengine.clock import Clock
from ftengine.errors import DeviceError
from ftengine.integrations.vllm.config import VllmFtSettings
from ftengine.integrations.vllm.messages import VllmMessages, import_vllm
from ftengine.integrations.vllm.shapes import VllmDistributed, WorkerLike
from ftengine.integrations.vllm.worker.adapter import WorkerFaultAdapter
from ftengine.integrations.vllm.worker.distributed import RealVllmDistributed
from ftengine.integrations.vllm.worker.factory import DeviceBackend
from ftengine.integrations.vllm.worker.hooks import VllmWorkerHooks
from ftengine.integrations.vllm_ascend.factory import npu_backend
from ftengine.integrations.vllm_ascend.hooks import AscendWorkerHooks
from ftengine.integrations.vllm_ascend.names import (
    EMPTY_OUTPUT,
    GET_OUTPUT,
    OUTPUTS_MODULE,
    WRAPPED_STEPS,
)

if TYPE_CHECKING:
    from typing import Unpack  # 3.11+; annotations are never evaluated at run time

logger = logging.getLogger(__name__)

BARRIER_FAULT = "vLLM-Ascend's fault barrier caught a device fault"


class AscendSeams(TypedDict, total=False):
    """What a test may swap in (vLLM-Ascend passes only ``worker`` and ``device``)."""

    dist: VllmDistributed | None
    messages: VllmMessages | None
    clock: Clock | None
    runtime: NpuRuntime | None
    group_factory: GroupFactory | None
    environ: MutableMapping[str, str] | None


def empty_output() -> Any:
    """vLLM's ``EMPTY_MODEL_RUNNER_OUTPUT``: what a fenced model step returns."""
    return getattr(import_vllm(OUTPUTS_MODULE), EMPTY_OUTPUT)


class AscendWorkerSentinel(WorkerFaultAdapter):
    """ftengine's sentinel of one vLLM-Ascend worker, built in ``_init_device``.

    ``device`` is the worker's NPU (the backend's tensors live there). ``npu`` is the NPU
    backend once ``load_model`` has run. ``worker_faulted`` / ``reset_device`` are what
    vLLM-Ascend's own ``fault_barrier_wrapper`` reads on ``worker.worker_sentinel`` (in two
    of its three revisions; the third reads a module global this sentinel never sets, and
    then does nothing: ftengine's barrier alone handles the fault, see docs/ascend.md).
    """

    def __init__(
        self, worker: WorkerLike, device: torch.device, **seams: Unpack[AscendSeams]
    ) -> None:
        self.device = device
        self.npu: NpuBackend | None = None
        dist = seams.get("dist") or RealVllmDistributed()
        environ = seams.get("environ")
        self._npu_seams: dict[str, Any] = {
            "runtime": seams.get("runtime"),
            "group_factory": seams.get("group_factory"),
            "environ": environ,
            "device": device,
        }
        problems = ft_environment_problems(
            os.environ if environ is None else environ, worker.parallel_config.tensor_parallel_size
        )
        if problems:  # too late to fix: the NPU is set up; register the plugin earlier
            logger.warning("[FT] %s", "; ".join(problems))
        super().__init__(
            worker,
            backend_factory=self._backend,
            dist=dist,
            hooks=AscendWorkerHooks(worker, dist),
            messages=seams.get("messages"),
            clock=seams.get("clock"),
        )
        for name in WRAPPED_STEPS:
            step = getattr(worker, name, None)
            if callable(step):
                setattr(worker, name, self._guarded(step))

    def _backend(
        self, worker: WorkerLike, hooks: VllmWorkerHooks, settings: VllmFtSettings
    ) -> DeviceBackend:
        device = npu_backend(worker, hooks, settings, **self._npu_seams)
        self.npu = cast(NpuBackend, device.backend)
        return device

    def _guarded(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """``step`` behind the NPU fault barrier (once the backend exists), its async output
        too: the first error resets the device and is re-raised; later calls are empty."""

        @functools.wraps(step)
        def run(*args: Any, **kwargs: Any) -> Any:
            npu = self.npu
            if npu is None:  # before load_model: no device state to protect yet
                return step(*args, **kwargs)
            return self._guard_output(npu.guard(step, empty_output)(*args, **kwargs))

        return run

    def _guard_output(self, output: Any) -> Any:
        get_output = getattr(output, GET_OUTPUT, None)
        if not callable(get_output) or self.npu is None:
            return output  # a finished ModelRunnerOutput (or None): nothing deferred
        barrier = self.npu.guard(self._reporting(get_output), empty_output)
        setattr(output, GET_OUTPUT, functools.wraps(get_output)(barrier))
        return output

    def _reporting(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return call(*args, **kwargs)
            except Exception as exc:
                self.report_exception(exc)
                raise

        return run

    def report_exception(self, exc: BaseException) -> None:
        """Report a model-step exception, once per fault: while the worker is fenced the
        fault is already being handled (vLLM-Ascend's barrier may have reported it first)."""
        if not self.worker_faulted:
            super().report_exception(exc)

    # What vLLM-Ascend's fault_barrier_wrapper reads on worker.worker_sentinel --------------

    @property
    def worker_faulted(self) -> bool:
        """Whether model calls are fenced (the barrier is tripped)."""
        return self.npu is not None and self.npu.barrier.tripped

    @worker_faulted.setter
    def worker_faulted(self, value: bool) -> None:
        # vLLM-Ascend's barrier sets it inside its ``except`` block, before it swallows or
        # re-raises the fault: report the exception it is handling.
        if value:
            handled = sys.exc_info()[1]
            self.report_exception(handled if handled is not None else DeviceError(BARRIER_FAULT))

    def reset_device(self) -> None:
        """The local reset vLLM-Ascend's barrier asks for: ftengine's, once per fault."""
        if self.npu is not None:
            self.npu.barrier.trip(BARRIER_FAULT)
