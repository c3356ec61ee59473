"""ftengine takes control where vLLM-Ascend builds its sentinel, and nowhere else.

On the "npu" platform the vLLM plugin leaves vLLM's GPU sentinel alone (vLLM-Ascend's own
sentinel subclasses it) and wraps vLLM's ``WorkerWrapperBase.init_device``: before the
stand-in ``NPUWorker._init_device`` sets the NPU up, the FT environment is in place and its
``WorkerSentinel(worker=self, device=device)`` builds ftengine's sentinel.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest

import ftengine
from ftengine.backends.npu_env import ASYNC_ERROR_HANDLING_NAMES, TASK_QUEUE_ENABLE
from ftengine.backends.npu_runtime import TorchNpuUnavailable
from ftengine.integrations.vllm import plugin as vllm_plugin
from ftengine.integrations.vllm.config import VllmConfigError
from ftengine.integrations.vllm.patches.install import PATCHES
from ftengine.integrations.vllm_ascend import names
from ftengine.integrations.vllm_ascend import plugin as ascend_plugin
from ftengine.integrations.vllm_ascend.plugin import prepare_worker, unregister
from ftengine.integrations.vllm_ascend.sentinel import AscendWorkerSentinel
from tests.fakes.npu_state import FakeNpuState
from tests.fakes.vllm_ascend_rig import ascend_config, start_worker
from tests.unit.npu_fixtures import MC2_HIDDEN, TinyCheckpoints
from tests.unit.npu_fixtures import npu_state as npu_state
from tests.unit.npu_fixtures import tiny_checkpoints as tiny_checkpoints
from tests.unit.test_vllm_standin import make_worker

gpu_sentinel = pytest.importorskip("vllm.v1.worker.sentinel.gpu_worker_sentinel")
gpu_worker = pytest.importorskip("vllm.v1.worker.gpu_worker")
worker_base = pytest.importorskip("vllm.v1.worker.worker_base")

FT_ENV = (
    TASK_QUEUE_ENABLE,
    *ASYNC_ERROR_HANDLING_NAMES,
    "HCCL_EVENT_TIMEOUT",
    "HCCL_EXEC_TIMEOUT",
)


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in FT_ENV:
        monkeypatch.delenv(name, raising=False)
    yield
    unregister()


@pytest.fixture
def checkpoint(tiny_checkpoints: TinyCheckpoints) -> Path:
    return tiny_checkpoints.path(layers=2, experts=8, hidden=MC2_HIDDEN)


def ftengine_classes(cls: type) -> list[type]:
    return [base for base in cls.__mro__ if base.__module__.startswith(ftengine.__name__)]


def test_both_entry_points_are_installed() -> None:
    found = {ep.name: ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert found["ftengine"] == "ftengine.integrations.vllm.plugin:register"
    assert found["ftengine_ascend"] == "ftengine.integrations.vllm_ascend.plugin:register"


@pytest.mark.parametrize("device_type", ["npu", "cpu"])
def test_on_npu_only_the_ascend_entry_point_acts_and_the_gpu_sentinel_stays_vllms(
    npu_state: FakeNpuState, monkeypatch: pytest.MonkeyPatch, device_type: str
) -> None:
    for patch in PATCHES:  # the engine-core / CPU seams it patches on every platform
        owner, _ = patch.target()  # (imported under the real platform: some read it)
        monkeypatch.setattr(owner, patch.name, getattr(owner, patch.name))
    platforms = importlib.import_module("vllm.platforms")
    monkeypatch.setattr(platforms, "current_platform", SimpleNamespace(device_type=device_type))
    for module in (gpu_sentinel, gpu_worker):  # what the generic plugin patches off an NPU
        monkeypatch.setattr(module, "WorkerSentinel", module.WorkerSentinel)
    gpu_class = gpu_sentinel.WorkerSentinel
    vllm_init_device = worker_base.WorkerWrapperBase.init_device
    vllm_plugin.register()
    ascend_plugin.register()
    ascend_plugin.register()  # idempotent: one wrapper, whatever the count
    wrapped = worker_base.WorkerWrapperBase.init_device
    if device_type == "npu":
        assert gpu_sentinel.WorkerSentinel is gpu_class
        assert wrapped is not vllm_init_device and wrapped.__wrapped__ is vllm_init_device
        # vLLM-Ascend's own sentinel, imported afterwards, subclasses vLLM's whole class.
        ascend = importlib.import_module(names.SENTINEL_MODULE).WorkerSentinel
        assert gpu_class in ascend.__mro__ and ftengine_classes(ascend) == []
    else:
        assert gpu_sentinel.WorkerSentinel is vllm_plugin.worker_fault_adapter
        assert wrapped is vllm_init_device


def test_the_worker_gets_ftengines_sentinel_and_vllm_ascends_stays_whole(
    npu_state: FakeNpuState, checkpoint: Path
) -> None:
    rig = start_worker(checkpoint, dp_rank=1)
    ascend = importlib.import_module(names.SENTINEL_MODULE).WorkerSentinel
    assert isinstance(rig.worker.worker_sentinel, AscendWorkerSentinel)
    assert not isinstance(rig.worker.worker_sentinel, ascend)
    assert not issubclass(ascend, AscendWorkerSentinel) and ftengine_classes(ascend) == []
    assert ascend.__init__ is not AscendWorkerSentinel.__init__
    # ... built where vLLM-Ascend builds its own, with the worker's device
    module = importlib.import_module(names.WORKER_MODULE)
    assert "WorkerSentinel(worker=self, device=device)" in inspect.getsource(module.NPUWorker)
    assert getattr(module, names.SENTINEL_NAME) is not ascend
    assert rig.sentinel.device == rig.worker.device
    assert rig.sentinel.ft is not None  # built once load_model had run


def test_the_ft_environment_is_in_place_before_the_npu_is_set_up(
    npu_state: FakeNpuState, checkpoint: Path
) -> None:
    rig = start_worker(
        checkpoint,
        dp_rank=1,
        tp_size=2,
        redundant=8,
        additional={"ft_communication_abort_timeout": 30},
    )
    assert rig.worker.env_at_set_device == {
        "TASK_QUEUE_ENABLE": "0",
        "HCCL_ASYNC_ERROR_HANDLING": "0",
        "TORCH_HCCL_ASYNC_ERROR_HANDLING": "0",
        "HCCL_EVENT_TIMEOUT": "30",
        "HCCL_EXEC_TIMEOUT": "29",
    }
    names_ = npu_state.names()
    assert names_.index("npu.set_op_timeout_ms") < names_.index("npu.set_device")
    assert npu_state.op_timeout_ms == 30_000


def test_a_bad_flag_stops_start_up_before_the_npu_is_touched(
    npu_state: FakeNpuState, checkpoint: Path
) -> None:
    with pytest.raises(VllmConfigError, match=r"ftengine\.policy"):
        start_worker(checkpoint, additional={"ftengine": {"policy": "sometimes"}})
    assert "npu.set_device" not in npu_state.names()


def test_an_op_timeout_on_torch_npu_7_2_stops_start_up_naming_the_versions(
    npu_state: FakeNpuState, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch_npu

    monkeypatch.delattr(torch_npu.npu, "set_op_timeout_ms")
    with pytest.raises(TorchNpuUnavailable, match=r"torch_npu 7\.3\.0.*aclrtSetOpExecuteTimeOutV2"):
        start_worker(checkpoint, additional={"ft_communication_abort_timeout": 30})
    assert "npu.set_device" not in npu_state.names()


def test_without_fault_tolerance_vllm_ascend_is_left_alone(
    npu_state: FakeNpuState, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker_module = importlib.import_module(names.WORKER_MODULE)
    original = getattr(worker_module, names.SENTINEL_NAME)
    config = ascend_config(checkpoint, dp_rank=0, dp_size=4, redundant=4)
    config.parallel_config.enable_fault_tolerance = False
    worker = worker_module.NPUWorker(config, 0, 0, "tcp://127.0.0.1:0")
    assert prepare_worker(worker) is False
    assert getattr(worker_module, names.SENTINEL_NAME) is original
    assert npu_state.names() == [] and "TASK_QUEUE_ENABLE" not in os.environ


def test_a_worker_that_is_not_vllm_ascends_is_left_alone(npu_state: FakeNpuState) -> None:
    assert prepare_worker(make_worker()) is False


def test_every_name_the_glue_uses_exists_in_the_stand_in(npu_state: FakeNpuState) -> None:
    """The stand-in was built from vLLM-Ascend's FT branch; these are the names ftengine
    relies on (names.py), so a rename there shows up here first."""
    assert callable(names.resolve(names.WRAPPER_MODULE, names.WRAPPER_CLASS).init_device)
    worker_cls = names.resolve(names.WORKER_MODULE, names.WORKER_CLASS)
    assert worker_base.WorkerBase in worker_cls.__mro__
    assert gpu_worker.Worker not in worker_cls.__mro__
    for method in (
        "_init_device",
        "init_device",
        "load_model",
        "handle_ft_command",
        *names.WRAPPED_STEPS,
    ):
        assert callable(getattr(worker_cls, method)), method
    assert names.resolve(names.SENTINEL_MODULE, names.SENTINEL_NAME)
    config = importlib.import_module(names.ASCEND_CONFIG_MODULE).AscendConfig()
    for option in (names.FUSED_MC2, names.HIERARCHY_COMM, names.NZ_MODE):
        assert hasattr(config, option), option
    assert callable(names.resolve(names.DEVICE_CONFIG_MODULE, names.DEVICE_TYPE))
    assert callable(names.resolve_first(names.ROUTING_MODULES, names.REFRESH_ROUTING))
    assert names.resolve(names.OUTPUTS_MODULE, names.EMPTY_OUTPUT) is not None
    manager = importlib.import_module(
        "vllm_ascend.distributed.device_communicators.npu_communicator"
    )._NpuAll2AllManager
    for method in (
        "update_mask",
        "query_active_mask",
        "get_elastic_info",
        "set_num_local_physical_experts",
        "clean_buffers",
    ):
        assert callable(getattr(manager, method)), method


def test_missing_lists_nothing_on_the_stand_in_and_names_what_moved(
    npu_state: FakeNpuState, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert names.missing() == []
    monkeypatch.setattr(names, "ASCEND_CONFIG", "get_ascend_config_v2")
    assert names.missing() == ["vllm_ascend.ascend_config.get_ascend_config_v2"]


def test_a_moved_name_is_reported_as_such() -> None:
    with pytest.raises(names.AscendGlueError, match="has no WorkerSentinel2"):
        names.resolve(names.WRAPPER_MODULE, "WorkerSentinel2")
    with pytest.raises(names.AscendGlueError, match="PR #16145"):
        names.resolve("vllm_ascend_that_is_not_there", "x")
