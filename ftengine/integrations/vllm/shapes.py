"""The parts of vLLM's worker, configs and model runner the adapter touches, as Protocols.

The adapter is typed against these, never against vLLM's classes, so ftengine type-checks
and imports without vLLM. Names are vLLM 0.33.0's (``vllm.v1.worker.gpu_worker.Worker``,
``vllm.config.ParallelConfig``, ...); ``tests/unit/test_vllm_shapes.py`` checks each one
against the real classes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Protocol

import torch


class FaultToleranceConfigLike(Protocol):
    """``vllm.config.FaultToleranceConfig`` (``--fault-tolerance-config``)."""

    @property
    def engine_recovery_timeout_sec(self) -> object: ...


class EplbConfigLike(Protocol):
    """``vllm.config.EPLBConfig`` (``--eplb-config``)."""

    @property
    def num_redundant_experts(self) -> object: ...


class ParallelConfigLike(Protocol):
    """``vllm.config.ParallelConfig``."""

    @property
    def data_parallel_rank(self) -> int: ...
    @property
    def data_parallel_size(self) -> int: ...
    @property
    def data_parallel_master_ip(self) -> str: ...
    @property
    def tensor_parallel_size(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def enable_fault_tolerance(self) -> bool: ...
    @property
    def fault_tolerance_config(self) -> FaultToleranceConfigLike: ...
    @property
    def cpu_distributed_timeout_seconds(self) -> object: ...
    @property
    def enable_eplb(self) -> bool: ...
    @property
    def eplb_config(self) -> EplbConfigLike: ...


class ModelConfigLike(Protocol):
    """``vllm.config.ModelConfig``: ``model`` is the checkpoint path (or hub id)."""

    @property
    def model(self) -> str: ...


class VllmConfigLike(Protocol):
    """``vllm.config.VllmConfig``; ``additional_config`` is ``--additional-config``."""

    @property
    def parallel_config(self) -> ParallelConfigLike: ...
    @property
    def model_config(self) -> ModelConfigLike: ...
    @property
    def additional_config(self) -> object: ...


class ModuleTree(Protocol):
    """A ``torch.nn.Module`` as far as finding its FusedMoE layers goes."""

    def modules(self) -> Iterator[torch.nn.Module]: ...


class EplbModelStateLike(Protocol):
    """``vllm.distributed.eplb.eplb_state.EplbModelState`` (int64 maps, updated in place)."""

    @property
    def physical_to_logical_map(self) -> torch.Tensor: ...
    @property
    def logical_to_physical_map(self) -> torch.Tensor: ...
    @property
    def logical_replica_count(self) -> torch.Tensor: ...


class EplbStateLike(Protocol):
    """``vllm.distributed.eplb.eplb_state.EplbState``: one model state per loaded model."""

    @property
    def model_states(self) -> Mapping[str, EplbModelStateLike]: ...


class WorkerLike(Protocol):
    """``vllm.v1.worker.gpu_worker.Worker`` (and vLLM-Ascend's NPU worker, its subclass in
    shape). ``model_runner`` is a v1 ``GPUModelRunner`` or a v2 one, by
    ``use_v2_model_runner``; it is read through the runner protocols in ``hooks``."""

    @property
    def vllm_config(self) -> VllmConfigLike: ...
    @property
    def parallel_config(self) -> ParallelConfigLike: ...
    @property
    def rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def use_v2_model_runner(self) -> bool: ...
    @property
    def model_runner(self) -> object: ...

    def execute_dummy_batch(self) -> None: ...


class GroupCoordinatorLike(Protocol):
    """``vllm.distributed.parallel_state.GroupCoordinator``: its gloo group is replaced."""

    cpu_group: object


class All2AllManagerLike(Protocol):
    """``vllm.distributed.device_communicators.all2all.All2AllManagerBase``."""

    def clean_buffers(self) -> None: ...


class VllmDistributed(Protocol):
    """vLLM's process-group functions the DP group's close and rebuild and the all2all mask
    need."""

    def dp_group(self) -> GroupCoordinatorLike: ...

    def all2all_manager(self) -> All2AllManagerLike | None: ...

    def init_gloo_group(
        self, host: str, port: int, rank: int, world_size: int, timeout: timedelta | None
    ) -> object: ...

    def destroy_group(self, group: object) -> None: ...

    def closed_group(self, like: object) -> object: ...

    def close_groups(self, groups: list[object]) -> int: ...
