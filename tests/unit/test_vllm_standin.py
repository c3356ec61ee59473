"""A stand-in vLLM worker for the adapter tests, and the checks that its shape is vLLM's.

The stand-in carries exactly the attribute and method names the adapter touches; the
tests below check each name against the installed vLLM 0.33.0 classes. What the real
classes cannot do on a CPU machine (so the adapter tests use this stand-in instead):

- ``vllm.v1.worker.gpu_worker.Worker`` imports, but building one needs a CUDA device
  (``init_device``) and a loaded model; its methods are checked by name and
  ``handle_ft_command`` is called unbound on the stand-in.
- ``vllm.config.ParallelConfig`` refuses ``enable_eplb`` here ("only supported on CUDA
  devices or ROCm devices or XPU devices"), and ``VllmConfig`` / the CLI parser fail to
  infer a device type; the config tests build ``ParallelConfig`` without EPLB.
- vLLM's compiled kernels (``vllm._C_stable_libtorch``, ``vllm._moe_C_stable_libtorch``,
  ``vllm.cumem_allocator``) need ``libcuda.so.1``, so no FusedMoE forward runs here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
import torch

from ftengine.placement.maps import ExpertPlacement

vllm_worker = pytest.importorskip(
    "vllm.v1.worker.gpu_worker", reason="vllm is not installed (scripts/install_vllm_cpu.sh)"
)


@dataclass
class FtConfig:
    engine_recovery_timeout_sec: object = 120


@dataclass
class EplbConfig:
    num_redundant_experts: object = 8


@dataclass
class ParallelConfig:
    data_parallel_rank: int = 0
    data_parallel_size: int = 4
    data_parallel_master_ip: str = "127.0.0.1"
    tensor_parallel_size: int = 1
    world_size: int = 1
    enable_fault_tolerance: bool = True
    fault_tolerance_config: FtConfig = field(default_factory=FtConfig)
    cpu_distributed_timeout_seconds: object = None
    enable_eplb: bool = True
    eplb_config: EplbConfig = field(default_factory=EplbConfig)


@dataclass
class ModelConfig:
    model: str = "/nonexistent"


@dataclass
class VllmConfig:
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    model_config: ModelConfig = field(default_factory=ModelConfig)
    additional_config: object = field(default_factory=dict)


class InputBatch:
    """vLLM's v1 ``InputBatch``: requests by id; records its bookkeeping calls."""

    def __init__(self, req_ids: list[str]) -> None:
        self.req_id_to_index = {r: i for i, r in enumerate(req_ids)}
        self.req_prompt_embeds: dict[int, torch.Tensor] = {0: torch.zeros(1)}
        self.calls: list[str] = []

    def remove_request(self, req_id: str) -> int | None:
        self.calls.append(f"remove:{req_id}")
        return self.req_id_to_index.pop(req_id, None)

    def condense(self) -> None:
        self.calls.append("condense")

    def refresh_metadata(self) -> None:
        self.calls.append("refresh_metadata")


class FusedMoE(torch.nn.Module):
    """FusedMoE's slot parameters, vLLM-Ascend layout: w13 [slots, H, 2I], w2 [slots, I, H]."""

    def __init__(self, slots: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.w13_weight = torch.nn.Parameter(
            torch.zeros(slots, hidden, 2 * inter, dtype=dtype), requires_grad=False
        )
        self.w2_weight = torch.nn.Parameter(
            torch.zeros(slots, inter, hidden, dtype=dtype), requires_grad=False
        )


@dataclass
class EplbModelState:
    physical_to_logical_map: torch.Tensor
    logical_to_physical_map: torch.Tensor
    logical_replica_count: torch.Tensor


@dataclass
class EplbState:
    model_states: dict[str, EplbModelState]


@dataclass
class RequestStates:
    req_id_to_index: dict[str, int]


class RunnerV1:
    """The v1 ``GPUModelRunner``'s per-request state."""

    def __init__(self, req_ids: list[str]) -> None:
        self.execute_model_state: object = "in-flight"
        self.kv_connector_output: object = "kv"
        self.requests: dict[str, object] = dict.fromkeys(req_ids, "state")
        self.num_prompt_logprobs: dict[str, object] = dict.fromkeys(req_ids, 1)
        self.input_batch = InputBatch(req_ids)
        self.model: torch.nn.Module | None = None
        self.eplb_state: EplbState | None = None


class RunnerV2:
    """The v2 ``GPUModelRunner``: requests live in ``req_states``."""

    def __init__(self, req_ids: list[str]) -> None:
        self.execute_model_state: object = "in-flight"
        self.req_states = RequestStates({r: i for i, r in enumerate(req_ids)})
        self.removed: list[str] = []
        self.model: torch.nn.Module | None = None
        self.eplb_state: EplbState | None = None

    def _remove_request(self, req_id: str) -> None:
        self.removed.append(req_id)
        del self.req_states.req_id_to_index[req_id]


class Worker:
    """``vllm.v1.worker.gpu_worker.Worker`` as far as the adapter and the plugin go."""

    def __init__(self, config: VllmConfig, runner: RunnerV1 | RunnerV2, *, rank: int = 0) -> None:
        self.vllm_config = config
        self.parallel_config = config.parallel_config
        self.rank = rank
        self.local_rank = rank
        self.use_v2_model_runner = isinstance(runner, RunnerV2)
        self.model_runner = runner
        self.worker_sentinel: Any = None
        self.dummy_batches = 0
        self.step_error: BaseException | None = None
        self.dummy_error: BaseException | None = None
        self.loaded = False

    def execute_dummy_batch(self) -> None:
        self.dummy_batches += 1
        if self.dummy_error is not None:
            raise self.dummy_error

    def load_model(self) -> None:
        self.loaded = True

    def execute_model(self, scheduler_output: object) -> object:
        if self.step_error is not None:
            raise self.step_error
        return scheduler_output


class All2AllManager:
    def __init__(self) -> None:
        self.cleaned = 0

    def clean_buffers(self) -> None:
        self.cleaned += 1


@dataclass
class DpGroup:
    cpu_group: object
    device_group: object = None


@dataclass
class Distributed:
    """Records what the DP-group rebuild did instead of opening sockets."""

    group: DpGroup = field(default_factory=lambda: DpGroup("group-0"))
    manager: All2AllManager | None = field(default_factory=All2AllManager)
    inits: list[tuple[str, int, int, int, timedelta | None]] = field(default_factory=list)
    destroyed: list[object] = field(default_factory=list)
    closed: list[object] = field(default_factory=list)
    held: int = 0  # close_groups' answer: groups still referenced elsewhere

    def dp_group(self) -> DpGroup:
        return self.group

    def all2all_manager(self) -> All2AllManager | None:
        return self.manager

    def init_gloo_group(
        self, host: str, port: int, rank: int, world_size: int, timeout: timedelta | None
    ) -> object:
        self.inits.append((host, port, rank, world_size, timeout))
        return f"group-{len(self.inits)}"

    def destroy_group(self, group: object) -> None:
        self.destroyed.append(group)

    def closed_group(self, like: object) -> object:
        return f"closed-{like}"

    def close_groups(self, groups: list[object]) -> int:
        self.closed.extend(groups)
        groups.clear()  # as the real one: the caller keeps no reference
        return self.held


def moe_model(
    placement: ExpertPlacement, hidden: int, inter: int, dtype: torch.dtype
) -> torch.nn.Module:
    """A model whose modules include one FusedMoE per placement layer."""
    return torch.nn.ModuleList(
        FusedMoE(placement.local_slots, hidden, inter, dtype) for _ in range(placement.num_layers)
    )


def make_worker(
    *,
    dp_rank: int = 0,
    dp_size: int = 4,
    v2: bool = False,
    requests: tuple[str, ...] = ("r1", "r2"),
    layers: int = 2,
    experts: int = 8,
    redundant: int = 8,
    hidden: int = 32,
    inter: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    model: str = "/nonexistent",
    additional: object = None,
    configure: Callable[[ParallelConfig], None] | None = None,
) -> Worker:
    """A loaded DP rank ``dp_rank`` worker with EPLB maps in vLLM's initial placement."""
    parallel = ParallelConfig(data_parallel_rank=dp_rank, data_parallel_size=dp_size)
    parallel.eplb_config.num_redundant_experts = redundant
    if configure is not None:
        configure(parallel)
    config = VllmConfig(parallel, ModelConfig(model), {} if additional is None else additional)
    runner: RunnerV1 | RunnerV2 = RunnerV2(list(requests)) if v2 else RunnerV1(list(requests))
    placement = ExpertPlacement.default(layers, experts, redundant, dp_size)
    runner.model = moe_model(placement, hidden, inter, dtype)
    runner.eplb_state = EplbState(
        {
            "main": EplbModelState(
                placement.physical_to_logical_map,
                placement.logical_to_physical_map,
                placement.logical_replica_count,
            )
        }
    )
    return Worker(config, runner, rank=dp_rank)


# -- the stand-in's names are vLLM's ------------------------------------------------------


def _init_source(cls: Any) -> str:
    return inspect.getsource(cls.__init__)


def test_worker_names_are_vllms() -> None:
    real = vllm_worker.Worker
    for method in ("execute_dummy_batch", "load_model", "execute_model", "handle_ft_command"):
        assert callable(getattr(real, method)), method
    source = "".join(
        inspect.getsource(cls) for cls in real.__mro__ if cls.__module__.startswith("vllm.")
    )
    attrs = ("vllm_config", "model_runner", "worker_sentinel", "use_v2_model_runner")
    for attr in (*attrs, "parallel_config", "rank", "local_rank"):
        assert f"self.{attr} =" in source or f"self.{attr}:" in source, attr
    # the sentinel is built exactly where the plugin replaces it
    assert "WorkerSentinel(worker=self)" in source
    assert "self.worker_sentinel.handle_command(ft_request)" in inspect.getsource(
        real.handle_ft_command
    )


def test_model_runner_names_are_vllms() -> None:
    v1 = pytest.importorskip("vllm.v1.worker.gpu_model_runner").GPUModelRunner
    v2 = pytest.importorskip("vllm.v1.worker.gpu.model_runner").GPUModelRunner
    batch = pytest.importorskip("vllm.v1.worker.gpu_input_batch").InputBatch
    v1_source = _init_source(v1)
    for attr in ("execute_model_state", "kv_connector_output", "requests", "input_batch"):
        assert f"self.{attr}" in inspect.getsource(v1), attr
    for attr in ("num_prompt_logprobs", "eplb_state", "model"):
        assert f"self.{attr}" in inspect.getsource(v1), attr
    assert v1_source
    for method in ("remove_request", "condense", "refresh_metadata"):
        assert callable(getattr(batch, method)), method
    for attr in ("req_id_to_index", "req_prompt_embeds"):
        assert f"self.{attr}" in _init_source(batch), attr
    assert callable(v2._remove_request)
    assert "self.req_states" in inspect.getsource(v2)


def test_config_names_are_vllms() -> None:
    config = pytest.importorskip("vllm.config")
    fields = set(config.ParallelConfig.__dataclass_fields__)
    assert {f for f in ParallelConfig.__dataclass_fields__} <= fields
    assert "engine_recovery_timeout_sec" in config.FaultToleranceConfig.__dataclass_fields__
    assert "num_redundant_experts" in config.EPLBConfig.__dataclass_fields__
    assert "model" in config.ModelConfig.__dataclass_fields__
    assert {"parallel_config", "model_config", "additional_config"} <= set(
        config.VllmConfig.__dataclass_fields__
    )


def test_eplb_and_moe_names_are_vllms() -> None:
    eplb = pytest.importorskip("vllm.distributed.eplb.eplb_state")
    assert set(EplbModelState.__dataclass_fields__) <= set(eplb.EplbModelState.__dataclass_fields__)
    assert "self.model_states" in _init_source(eplb.EplbState)
    unquantized = pytest.importorskip(
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"
    ).UnquantizedFusedMoEMethod
    source = inspect.getsource(unquantized.create_weights)
    assert '"w13_weight"' in source and '"w2_weight"' in source


def test_initial_maps_match_vllms() -> None:
    """The stand-in's EPLB maps start where vLLM's do (ExpertPlacement.default)."""
    eplb = pytest.importorskip("vllm.distributed.eplb.eplb_state").EplbState
    placement = ExpertPlacement.default(2, 8, 8, 4)
    row = eplb.build_initial_global_physical_to_logical_map(8, 8)
    assert placement.physical_to_logical_map.tolist() == [row, row]


def test_distributed_names_are_vllms() -> None:
    dist = pytest.importorskip("vllm.distributed")
    init = inspect.signature(dist.stateless_init_torch_distributed_process_group)
    assert list(init.parameters)[:5] == ["host", "port", "rank", "world_size", "backend"]
    assert "timeout" in init.parameters
    assert callable(dist.stateless_destroy_torch_distributed_process_group)
    assert callable(dist.get_dp_group)
    a2a = pytest.importorskip("vllm.distributed.device_communicators.all2all")
    assert callable(a2a.DeepEPLLAll2AllManager.clean_buffers)
    utils = pytest.importorskip("vllm.model_executor.layers.fused_moe.all2all_utils")
    assert callable(utils.get_ep_all2all_manager)
