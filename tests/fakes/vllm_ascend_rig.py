"""vLLM-Ascend workers on the stand-in, started the way vLLM starts them, with ftengine registered.

:func:`start_worker` builds the stand-in ``NPUWorker`` of one EP rank, registers ftengine's
Ascend glue with test seams, runs vLLM's real ``WorkerWrapperBase.init_device`` (so the
glue takes control exactly where vLLM-Ascend builds its sentinel) and loads the model.
Needs the fake torch_npu installed (``npu_state`` fixture) and vLLM importable.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ftengine.backends.npu_runtime import NpuRuntime
from ftengine.clock import ManualClock
from ftengine.integrations.vllm.messages import VllmMessages
from ftengine.integrations.vllm_ascend import plugin
from ftengine.integrations.vllm_ascend.sentinel import AscendWorkerSentinel
from tests.fakes.npu_host import RecordingGroupFactory
from tests.fakes.npu_state import STATE
from tests.unit.test_vllm_standin import (
    Distributed,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
)


@dataclass
class AscendVllmConfig(VllmConfig):
    """The stand-in vLLM config with the flag vLLM-Ascend's worker reads for its runner and
    vLLM's speculative decoding config (None: off)."""

    use_v2_model_runner: bool = True
    speculative_config: Any = None


@dataclass
class AscendDistributed(Distributed):
    """The DP-group stand-in of the vLLM tests, whose all2all manager is the worker's MC2 one
    (vLLM's ``get_ep_all2all_manager()`` under vLLM-Ascend)."""

    worker: Any = field(default=None)

    def all2all_manager(self) -> Any:
        return self.worker.ep_group.device_communicator.all2all_manager


@dataclass
class AscendWorker:
    """One started worker: the stand-in ``NPUWorker``, vLLM's wrapper, the DP-group stand-in."""

    worker: Any
    wrapper: Any
    dist: AscendDistributed

    @property
    def sentinel(self) -> AscendWorkerSentinel:
        sentinel = self.worker.worker_sentinel
        assert isinstance(sentinel, AscendWorkerSentinel), type(sentinel)
        return sentinel

    @property
    def manager(self) -> Any:
        return self.dist.all2all_manager()


def ascend_config(
    checkpoint: Path,
    *,
    dp_rank: int,
    dp_size: int,
    tp_size: int = 1,
    redundant: int,
    additional: dict[str, object] | None = None,
    speculative_method: str | None = None,
) -> AscendVllmConfig:
    parallel = ParallelConfig(
        data_parallel_rank=dp_rank,
        data_parallel_size=dp_size,
        tensor_parallel_size=tp_size,
        world_size=tp_size,
    )
    parallel.eplb_config.num_redundant_experts = redundant
    speculative = None if speculative_method is None else SimpleNamespace(method=speculative_method)
    return AscendVllmConfig(
        parallel, ModelConfig(str(checkpoint)), dict(additional or {}), True, speculative
    )


def start_worker(
    checkpoint: Path,
    *,
    dp_rank: int = 0,
    dp_size: int = 4,
    tp_size: int = 1,
    tp_rank: int = 0,
    redundant: int = 4,
    additional: dict[str, object] | None = None,
    speculative_method: str | None = None,
) -> AscendWorker:
    """EP rank ``dp_rank * tp_size + tp_rank``'s worker, initialised and loaded."""
    worker_module = importlib.import_module("vllm_ascend.worker.worker")
    wrapper_cls = importlib.import_module("vllm.v1.worker.worker_base").WorkerWrapperBase
    config = ascend_config(
        checkpoint,
        dp_rank=dp_rank,
        dp_size=dp_size,
        tp_size=tp_size,
        redundant=redundant,
        additional=additional,
        speculative_method=speculative_method,
    )
    local_rank = dp_rank * tp_size + tp_rank
    worker = worker_module.NPUWorker(config, local_rank, tp_rank, "tcp://127.0.0.1:0")
    dist = AscendDistributed(worker=worker)
    plugin.install(
        functools.partial(
            AscendWorkerSentinel,
            dist=dist,
            messages=VllmMessages.load(),
            clock=ManualClock(),
            runtime=NpuRuntime.load(aclnn_probe=STATE.has_aclnn),
            group_factory=RecordingGroupFactory(),
        )
    )
    wrapper = wrapper_cls()
    wrapper.worker, wrapper.vllm_config = worker, config
    wrapper.init_device()
    worker.load_model()
    return AscendWorker(worker, wrapper, dist)


@dataclass
class SchedulerOutput:
    """What the stand-in runner reads of vLLM's ``SchedulerOutput``: the requests to step."""

    req_ids: list[str]
