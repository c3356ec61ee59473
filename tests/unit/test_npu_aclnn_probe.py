"""The aclnn kernel probe searches CANN's op-API libraries as op-plugin does (V4 or V3), and
refuses scale-down only on a confirmed absence."""

from __future__ import annotations

import ctypes

import pytest

from ftengine.backends.npu_preconditions import NpuDeployment, check_scale_down
from ftengine.backends.npu_runtime import NpuRuntime, cann_exports
from ftengine.errors import PreconditionFailed
from tests.fakes.npu_state import ACLNN_V3, ACLNN_V4, MC2_LIBRARY, FakeNpuState
from tests.unit.npu_fixtures import npu_state as npu_state


@pytest.fixture
def fake_cann(npu_state: FakeNpuState, monkeypatch: pytest.MonkeyPatch) -> FakeNpuState:
    """``ctypes.CDLL`` opens the fake CANN's op-API libraries."""
    monkeypatch.setattr(ctypes, "CDLL", npu_state.load_library)
    return npu_state


def kernels(runtime: NpuRuntime) -> bool | None:
    return runtime.has_elastic_info_kernels


def test_kernels_built_into_libopapi_transformer_are_found(fake_cann: FakeNpuState) -> None:
    # CANN's ops-transformer builds its kernels into libopapi_transformer.so, not libopapi.so.
    assert fake_cann.opapi_libraries[MC2_LIBRARY] >= set(ACLNN_V3)
    assert not fake_cann.opapi_libraries["libopapi.so"] & set(ACLNN_V3)
    assert cann_exports(ACLNN_V3[0]) is True
    runtime = NpuRuntime.load()
    assert kernels(runtime) is True
    check_scale_down(NpuDeployment(elastic_info_kernels=kernels(runtime)))  # no refusal


def test_v4_alone_is_enough(fake_cann: FakeNpuState) -> None:
    fake_cann.aclnn.clear()
    fake_cann.aclnn.update(ACLNN_V4)
    assert kernels(NpuRuntime.load()) is True


def test_a_full_search_that_finds_nothing_is_a_confirmed_absence(fake_cann: FakeNpuState) -> None:
    fake_cann.aclnn.clear()
    assert cann_exports(ACLNN_V3[0]) is False
    assert kernels(NpuRuntime.load()) is False
    with pytest.raises(PreconditionFailed, match="aclnnMoeDistributeDispatchV4"):
        check_scale_down(NpuDeployment(elastic_info_kernels=False))


def test_half_a_pair_is_not_a_pair(fake_cann: FakeNpuState) -> None:
    fake_cann.aclnn.discard(ACLNN_V3[1])  # dispatch V3 without combine V3, no V4
    assert kernels(NpuRuntime.load()) is False


def test_a_partial_search_is_unknown_not_absent(fake_cann: FakeNpuState) -> None:
    fake_cann.aclnn.clear()
    del fake_cann.opapi_libraries["libopapi_nn.so"]  # one library failed to load
    assert cann_exports(ACLNN_V3[0]) is None
    assert kernels(NpuRuntime.load()) is None
    check_scale_down(NpuDeployment(elastic_info_kernels=None))  # warned, not refused


def test_found_in_a_loaded_library_is_found_even_if_another_failed(
    fake_cann: FakeNpuState,
) -> None:
    del fake_cann.opapi_libraries["libopapi_math.so"]
    assert cann_exports(ACLNN_V3[0]) is True
