"""Stand-in of ``vllm_ascend.worker.worker``: ``NPUWorker`` as far as fault tolerance goes.

Like the real one it subclasses vLLM's ``WorkerBase`` (not the GPU ``Worker``), imports
``WorkerSentinel`` from its sentinel module at import time and builds it in
``_init_device`` as ``WorkerSentinel(worker=self, device=device)`` after the distributed
init, having set the HCCL timeouts and the op timeout for ``ft_communication_abort_timeout``
first (PR #14113). The device is the fake torch_npu's; tensors live on the CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch_npu
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from tests.fakes.npu_state import STATE

from ..ascend_config import get_ascend_config, init_ascend_config
from ..distributed.device_communicators.npu_communicator import NPUCommunicator
from ..ops.fused_moe import MC2_GROUP
from .sentinel.npu_worker_sentinel import WorkerSentinel, fault_barrier_wrapper
from .v2.model_runner import NPUModelRunner

WATCHED_ENV = (
    "TASK_QUEUE_ENABLE",
    "HCCL_ASYNC_ERROR_HANDLING",
    "TORCH_HCCL_ASYNC_ERROR_HANDLING",
    "HCCL_EVENT_TIMEOUT",
    "HCCL_EXEC_TIMEOUT",
)


@dataclass
class EpGroup:
    """vLLM's EP ``GroupCoordinator``: its size, this rank, its device communicator."""

    world_size: int
    rank_in_group: int
    device_communicator: NPUCommunicator


class NPUWorker(WorkerBase):
    def __init__(
        self,
        vllm_config: Any,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
        **kwargs: Any,
    ) -> None:
        init_ascend_config(vllm_config)
        # WorkerBase.__init__ needs vLLM's full config; the attributes FT reads are set here.
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.model_config = vllm_config.model_config
        self.local_rank, self.rank = local_rank, rank
        self.distributed_init_method = distributed_init_method
        self.device: torch.device | None = None
        self.worker_sentinel: Any = None
        self.use_v2_model_runner = vllm_config.use_v2_model_runner
        self.model_runner: Any = None
        self.ep_group: EpGroup | None = None
        self.env_at_set_device: dict[str, str | None] = {}

    def handle_ft_command(self, ft_request: Any) -> Any:
        assert self.worker_sentinel is not None
        return self.worker_sentinel.handle_command(ft_request)

    def _init_device(self) -> torch.device:
        if self.parallel_config.enable_fault_tolerance:
            abort_timeout = get_ascend_config().ft_communication_abort_timeout
            if abort_timeout > 0:
                os.environ.setdefault("HCCL_EVENT_TIMEOUT", str(abort_timeout))
                os.environ.setdefault("HCCL_EXEC_TIMEOUT", str(abort_timeout - 1))
                torch_npu.npu.set_op_timeout_ms(abort_timeout * 1000)
        torch_npu.npu.set_device(self.local_rank)
        self.env_at_set_device = {name: os.environ.get(name) for name in WATCHED_ENV}
        device = torch.device("cpu")
        self._init_worker_distributed_environment(device)
        if self.parallel_config.enable_fault_tolerance:
            self.worker_sentinel = WorkerSentinel(worker=self, device=device)
        return device

    def init_device(self) -> None:
        self.device = self._init_device()
        assert self.ep_group is not None
        self.model_runner = NPUModelRunner(self.vllm_config, self.device, self.ep_group)

    def _init_worker_distributed_environment(self, device: torch.device) -> None:
        parallel = self.parallel_config
        tp = parallel.tensor_parallel_size
        ep_size = parallel.data_parallel_size * tp
        ep_rank = parallel.data_parallel_rank * tp + self.rank % tp
        self.ep_group = EpGroup(ep_size, ep_rank, NPUCommunicator(ep_size, device))
        STATE.add_hccl_group(MC2_GROUP)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        self.model_runner.load_model()

    def compile_or_warm_up_model(self) -> CompilationTimes:
        self.model_runner._dummy_run(1, uniform_decode=True)
        return CompilationTimes(language_model=0.0, encoder=0.0)

    @fault_barrier_wrapper
    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput | None:
        self.model_runner.execute_model(scheduler_output)
        return None

    @fault_barrier_wrapper
    def sample_tokens(self, grammar_output: Any) -> Any:
        return self.model_runner.sample_tokens(grammar_output)

    def execute_dummy_batch(self) -> None:
        self.model_runner._dummy_run(1, uniform_decode=True)
