"""torch_npu is imported lazily, and its absence is explained (package, CANN, missing APIs)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import cast

import pytest

from ftengine.backends.npu import NpuBackend
from ftengine.backends.npu_host import NpuHost, NpuTopology
from ftengine.backends.npu_runtime import NpuRuntime, TorchNpuUnavailable
from ftengine.errors import BackendError
from tests.fakes.npu_state import FakeNpuState
from tests.unit.npu_fixtures import npu_state as npu_state

NPU_MODULES = (
    "ftengine.backends.npu",
    "ftengine.backends.npu_config",
    "ftengine.backends.npu_env",
    "ftengine.backends.npu_groups",
    "ftengine.backends.npu_host",
    "ftengine.backends.npu_mc2",
    "ftengine.backends.npu_preconditions",
    "ftengine.backends.npu_reload",
    "ftengine.backends.npu_reset",
    "ftengine.backends.npu_runtime",
    "ftengine.backends.npu_timeouts",
    "ftengine.integrations.vllm_ascend",
    "ftengine.integrations.vllm_ascend.config",
    "ftengine.integrations.vllm_ascend.engine_core",
    "ftengine.integrations.vllm_ascend.factory",
    "ftengine.integrations.vllm_ascend.hooks",
    "ftengine.integrations.vllm_ascend.names",
    "ftengine.integrations.vllm_ascend.plugin",
    "ftengine.integrations.vllm_ascend.sentinel",
)


class RefuseTorchNpu(importlib.abc.MetaPathFinder):
    """Makes ``import torch_npu`` fail with ``error`` and counts the attempts."""

    def __init__(self, error: ImportError) -> None:
        self.error = error
        self.attempts = 0

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] == "torch_npu":
            self.attempts += 1
            raise self.error
        return None


@pytest.fixture
def no_torch_npu(monkeypatch: pytest.MonkeyPatch) -> Iterator[RefuseTorchNpu]:
    """No torch_npu at all: every import attempt raises ModuleNotFoundError."""
    finder = RefuseTorchNpu(ModuleNotFoundError("No module named 'torch_npu'", name="torch_npu"))
    for name in [n for n in sys.modules if n.split(".")[0] == "torch_npu"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    yield finder


def test_importing_the_npu_backend_never_imports_torch_npu(
    no_torch_npu: RefuseTorchNpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in NPU_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    for name in NPU_MODULES:
        importlib.import_module(name)
    assert no_torch_npu.attempts == 0
    assert "torch_npu" not in sys.modules


def test_building_the_backend_without_torch_npu_says_what_to_install(
    no_torch_npu: RefuseTorchNpu,
) -> None:
    host = cast(NpuHost, object())  # never reached: the runtime is loaded first
    with pytest.raises(TorchNpuUnavailable) as caught:
        NpuBackend(host, NpuTopology(dp_rank=0, dp_size=1, device_index=0))
    message = str(caught.value)
    assert "`torch_npu` package, which is not installed" in message
    assert "set_env.sh" in message and "cpu backend" in message
    assert isinstance(caught.value, ImportError) and isinstance(caught.value, BackendError)
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_a_torch_npu_without_cann_names_the_cann_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    error = ImportError("libhccl.so: cannot open shared object file: No such file or directory")
    monkeypatch.setattr(sys, "meta_path", [RefuseTorchNpu(error), *sys.meta_path])
    for name in [n for n in sys.modules if n.split(".")[0] == "torch_npu"]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(TorchNpuUnavailable, match=r"libhccl\.so.*set_env\.sh") as caught:
        NpuRuntime.load()
    assert caught.value.__cause__ is error


def test_a_torch_npu_lacking_an_api_is_named(
    npu_state: FakeNpuState, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch_npu

    monkeypatch.delattr(torch_npu.npu, "stop_device")
    monkeypatch.delattr(torch_npu.distributed, "reinit_process_group")
    with pytest.raises(TorchNpuUnavailable) as caught:
        NpuRuntime.load()
    assert "torch_npu.npu.stop_device, torch_npu.distributed.reinit_process_group" in str(
        caught.value
    )


def test_mc2_v2_presence_is_detected(
    npu_state: FakeNpuState, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch_npu

    assert NpuRuntime.load().has_mc2_v2
    monkeypatch.delattr(torch_npu, "npu_moe_distribute_combine_v2")
    assert not NpuRuntime.load().has_mc2_v2
