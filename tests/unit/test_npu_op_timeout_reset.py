"""The op timeout survives what sets torch_npu's default again: its lazy device
initialisation (CANN >= 8.3.RC1) and every ``restart_device``; and the device reset works on
each targeted torch_npu release (``restart_device``'s signature differs, every watchdog
back to RUN)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from ftengine.backends.npu_config import NpuFtConfig
from ftengine.weights.index import CheckpointIndex
from tests.fakes.npu_host import EP_GROUP, make_npu_rig
from tests.fakes.npu_state import (
    DEFAULT_GROUP,
    DEFAULT_OP_TIMEOUT_MS,
    WATCHDOG_RUN,
    FakeNpuState,
)
from tests.fakes.vllm_ascend_rig import SchedulerOutput, start_worker
from tests.unit.npu_fixtures import MC2_HIDDEN, TinyCheckpoints
from tests.unit.npu_fixtures import npu_state as npu_state
from tests.unit.npu_fixtures import tiny_checkpoints as tiny_checkpoints
from tests.unit.npu_fixtures import versioned_npu_state as versioned_npu_state
from tests.unit.test_vllm_npu import command
from tests.unit.test_vllm_npu import isolated as isolated

T = 30
"""ft_communication_abort_timeout of these tests (seconds)."""


@pytest.fixture(scope="module")
def index(tiny_checkpoints: TinyCheckpoints) -> CheckpointIndex:
    return tiny_checkpoints.index(layers=1, experts=8, hidden=MC2_HIDDEN)


def test_the_fake_resets_the_op_timeout_on_lazy_initialisation(npu_state: FakeNpuState) -> None:
    import torch_npu

    torch_npu.npu.set_op_timeout_ms(T * 1000)
    torch_npu.npu.set_device(0)  # lazy set-device: nothing initialised yet
    assert npu_state.op_timeout_ms == T * 1000
    torch_npu.npu.synchronize()  # first stream use
    assert npu_state.op_timeout_ms == DEFAULT_OP_TIMEOUT_MS


def test_the_op_timeout_holds_after_the_first_device_op(
    npu_state: FakeNpuState, index: CheckpointIndex
) -> None:
    rig = make_npu_rig(
        index, dp_size=4, num_redundant=4, config=NpuFtConfig(communication_abort_timeout_s=T)
    )
    rig.host.run_dummy_batch()  # the first kernels: torch_npu initialises the device
    assert npu_state.op_timeout_ms == T * 1000


def test_the_op_timeout_is_applied_again_after_every_device_restart(
    versioned_npu_state: FakeNpuState, index: CheckpointIndex, caplog: pytest.LogCaptureFixture
) -> None:
    state = versioned_npu_state
    rig = make_npu_rig(
        index, dp_size=4, num_redundant=4, config=NpuFtConfig(communication_abort_timeout_s=T)
    )
    with caplog.at_level("INFO", logger="ftengine.backends.npu_timeouts"):
        for _ in range(2):
            rig.backend.reset_device()
            assert state.op_timeout_ms == T * 1000
    names = state.names()
    restart = names.index("npu.restart_device")
    assert names[restart + 1 :].index("npu.set_op_timeout_ms") < names[restart + 1 :].index(
        "distributed.reinit_process_group"
    )
    assert caplog.text.count(f"re-applied after a device restart: {T * 1000} ms in effect") == 2


def test_without_an_op_timeout_a_restart_sets_nothing(
    npu_state: FakeNpuState, index: CheckpointIndex
) -> None:
    rig = make_npu_rig(index, dp_size=4, num_redundant=4)
    rig.backend.reset_device()
    assert npu_state.of("npu.set_op_timeout_ms") == []


def test_reset_on_each_targeted_torch_npu_puts_every_watchdog_back_to_run(
    versioned_npu_state: FakeNpuState, index: CheckpointIndex
) -> None:
    state = versioned_npu_state
    rig = make_npu_rig(index, dp_size=4, num_redundant=4)
    rig.backend.reset_device()
    assert state.watchdogs == {DEFAULT_GROUP: WATCHDOG_RUN, EP_GROUP: WATCHDOG_RUN}
    rig.backend.run_dummy_batch()  # MC2 on the resumed EP group


def test_restart_device_takes_each_releases_signature(versioned_npu_state: FakeNpuState) -> None:
    import torch_npu

    params = list(inspect.signature(torch_npu.npu.restart_device).parameters)
    if versioned_npu_state.version == "26.1.0":
        assert params == ["device_id", "rebuild_all_resources", "disable_tensor_unsafe_check"]
    else:
        assert params == ["device_id", "rebuild_all_resources"]
        with pytest.raises(TypeError):
            torch_npu.npu.restart_device(0, disable_tensor_unsafe_check=True)
    assert torch_npu.__version__.startswith(versioned_npu_state.version)


def test_on_vllm_ascend_the_op_timeout_holds_after_warm_up_and_after_a_retry(
    npu_state: FakeNpuState, tiny_checkpoints: TinyCheckpoints, caplog: pytest.LogCaptureFixture
) -> None:
    path: Path = tiny_checkpoints.path(layers=1, experts=8, hidden=MC2_HIDDEN)
    rig = start_worker(
        path, dp_rank=1, redundant=4, additional={"ft_communication_abort_timeout": T}
    )
    caplog.clear()
    with caplog.at_level("INFO", logger="ftengine.backends.npu_timeouts"):
        rig.worker.compile_or_warm_up_model()
    assert npu_state.op_timeout_ms == T * 1000
    assert f"op timeout applied: {T * 1000} ms in effect" in caplog.text  # after warm-up
    npu_state.poison()
    with pytest.raises(RuntimeError):
        rig.worker.execute_model(SchedulerOutput(["r1"]))
    result = command(rig, "retry", {}, "retry-1")
    assert result.success, result.reason
    assert npu_state.op_timeout_ms == T * 1000
