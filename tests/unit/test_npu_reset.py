"""Device reset order, the fault barrier (quarantine) and owned-group re-creation on the NPU."""

from __future__ import annotations

import pytest

from ftengine.clock import ManualClock
from ftengine.engine import RecoveryEngine
from ftengine.errors import BackendError, DeviceError
from ftengine.faults import Fault, FaultKind, HealthStatus, Phase
from ftengine.policies import OrchestratorDriven
from ftengine.weights.index import CheckpointIndex
from tests.fakes.npu_host import EP_GROUP, NpuRig, make_npu_rig
from tests.fakes.npu_state import (
    DEFAULT_GROUP,
    RUNNING,
    SUSPENDED,
    Call,
    FakeDeviceError,
    FakeNpuState,
)
from tests.unit.npu_fixtures import COMBINE, DISPATCH, MC2_HIDDEN, TinyCheckpoints
from tests.unit.npu_fixtures import npu_state as npu_state
from tests.unit.npu_fixtures import tiny_checkpoints as tiny_checkpoints

RESET = [
    "npu.set_device",
    "npu.stop_device",
    "npu.restart_device",
    "distributed.reinit_process_group",
    "npu.synchronize",
]


@pytest.fixture(scope="module")
def index(tiny_checkpoints: TinyCheckpoints) -> CheckpointIndex:
    return tiny_checkpoints.index(layers=1, experts=8, hidden=MC2_HIDDEN)


@pytest.fixture
def rig(npu_state: FakeNpuState, index: CheckpointIndex) -> NpuRig:
    """DP rank 1 of 4 on NPU 3, owning one DP-sync group; the call log starts empty."""
    rig = make_npu_rig(index, dp_size=4, dp_rank=1, device_index=3, num_redundant=4)
    rig.backend.groups.register("dp_sync")
    npu_state.clear_calls()
    return rig


def step_into_a_device_error(rig: NpuRig, state: FakeNpuState) -> None:
    """A model step whose dispatch fails like a poisoned stream (an HCCL op aborted by the
    timeout); the error reaches the caller once the fault barrier has run."""
    state.poison()
    state.fail(DISPATCH, FakeDeviceError("EI0002: HCCL op timed out, stream poisoned"))
    with pytest.raises(FakeDeviceError):
        rig.host.step(rig.host.tokens(4))


def test_reset_runs_the_exact_sequence_then_recreates_owned_groups(
    rig: NpuRig, npu_state: FakeNpuState
) -> None:
    old = rig.groups.created[-1]
    rig.backend.reset_device()
    assert npu_state.calls == [
        Call("npu.set_device", (3,)),
        Call("npu.stop_device", (3,)),
        Call("npu.restart_device", (3,)),  # keep every allocation: rebuild_all_resources=False
        Call("distributed.reinit_process_group", (None,), {"rebuild_link": False}),
        Call("npu.synchronize"),
    ]
    assert rig.groups.destroyed == [old]
    new = rig.groups.created[-1]
    assert (new.ranks, new.backend) == ((0, 1, 2, 3), "gloo")
    assert rig.backend.groups.get("dp_sync") is new


def test_reset_resumes_every_hccl_group_not_only_the_default_one(
    rig: NpuRig, npu_state: FakeNpuState
) -> None:
    npu_state.fail("distributed.reinit_process_group", RuntimeError("EI0006: link lost"))
    with pytest.raises(DeviceError, match="reinit_process_group"):
        rig.backend.reset_device()
    # stop_device stopped every watchdog, restart_device left the groups suspended ...
    assert npu_state.hccl_groups == {DEFAULT_GROUP: SUSPENDED, EP_GROUP: SUSPENDED}
    rig.backend.reset_device()
    # ... and reinit_process_group(None, rebuild_link=False) resumed all of them.
    assert npu_state.hccl_groups == {DEFAULT_GROUP: RUNNING, EP_GROUP: RUNNING}


def test_an_mc2_call_on_a_suspended_group_fails(rig: NpuRig, npu_state: FakeNpuState) -> None:
    npu_state.hccl_groups[EP_GROUP] = SUSPENDED  # what a re-link of the default group leaves
    with pytest.raises(FakeDeviceError, match=f"{EP_GROUP}' is suspended"):
        rig.host.step(rig.host.tokens(2))


def test_reset_clears_a_poisoned_device(rig: NpuRig, npu_state: FakeNpuState) -> None:
    npu_state.poison()
    rig.backend.reset_device()
    assert not npu_state.poisoned and npu_state.stopped == set()
    rig.backend.synchronize()


def test_stop_device_failure_stops_the_sequence(rig: NpuRig, npu_state: FakeNpuState) -> None:
    npu_state.stop_result = 1
    with pytest.raises(DeviceError, match=r"stop_device\(3\) returned 1"):
        rig.backend.reset_device()
    assert npu_state.names() == RESET[:2]


def test_a_step_failing_keeps_the_torch_npu_error_as_cause(
    rig: NpuRig, npu_state: FakeNpuState
) -> None:
    error = RuntimeError("EL0004: device lost")
    npu_state.fail("npu.restart_device", error)
    with pytest.raises(DeviceError, match="reset failed at restart_device") as caught:
        rig.backend.reset_device()
    assert caught.value.__cause__ is error
    assert npu_state.names() == RESET[:3]


def test_first_device_error_resets_at_once_and_fences_later_calls(
    rig: NpuRig, npu_state: FakeNpuState
) -> None:
    step_into_a_device_error(rig, npu_state)
    # The reset ran inside the failing call, before anything else touched the stream.
    assert npu_state.names() == [DISPATCH, *RESET]
    assert not npu_state.poisoned
    assert rig.backend.barrier.tripped and rig.backend.groups.stale
    calls_before = len(npu_state.calls)
    for _ in range(3):
        out = rig.host.step(rig.host.tokens(4))
        assert out.shape == (0, MC2_HIDDEN)
    assert len(npu_state.calls) == calls_before  # device-free while quarantined
    with pytest.raises(BackendError, match="stale"):
        rig.backend.groups.get("dp_sync")


def test_quarantine_after_the_barrier_does_not_reset_twice(
    rig: NpuRig, npu_state: FakeNpuState
) -> None:
    step_into_a_device_error(rig, npu_state)
    rig.backend.quarantine(Fault(FaultKind.DEVICE_ERROR, rank=1, info="FakeDeviceError"))
    rig.backend.quarantine(Fault(FaultKind.DEVICE_ERROR, rank=1, info="FakeDeviceError"))
    assert npu_state.names().count("npu.stop_device") == 1


def test_quarantine_without_an_error_resets_locally_without_a_rendezvous(
    rig: NpuRig, npu_state: FakeNpuState
) -> None:
    created = len(rig.groups.created)
    rig.backend.quarantine(Fault(FaultKind.DEAD_PEER, info="ConnectionError"))
    assert npu_state.names() == RESET
    assert len(rig.groups.created) == created  # groups only marked stale
    assert rig.host.step(rig.host.tokens(2)).numel() == 0


def test_rebuild_recreates_groups_for_the_epoch_and_lets_calls_through(
    rig: NpuRig, npu_state: FakeNpuState
) -> None:
    rig.backend.quarantine(Fault(FaultKind.TRANSIENT, rank=1))
    rig.backend.rebuild_groups(frozenset({0, 1, 2, 3}), 1)
    assert rig.backend.epoch == 1 and not rig.backend.groups.stale
    npu_state.clear_calls()
    out = rig.host.step(rig.host.tokens(4))
    assert out.shape == (4, MC2_HIDDEN)
    assert npu_state.names() == [DISPATCH, COMBINE]


def test_a_failed_local_reset_is_retried_by_quarantine(
    rig: NpuRig, npu_state: FakeNpuState
) -> None:
    npu_state.stop_result = 1  # the barrier's local reset will fail
    step_into_a_device_error(rig, npu_state)
    assert rig.backend.barrier.tripped and not rig.backend.barrier.reset_done
    rig.backend.synchronize()  # must not touch the poisoned stream
    assert "npu.synchronize" not in npu_state.names()
    npu_state.stop_result = 0
    rig.backend.quarantine(Fault(FaultKind.DEVICE_ERROR, rank=1))
    assert rig.backend.barrier.reset_done and not npu_state.poisoned


def test_engine_retry_path_calls_the_device_in_order(rig: NpuRig, npu_state: FakeNpuState) -> None:
    engine = RecoveryEngine(
        OrchestratorDriven(), rig.backend, rank=1, world_size=4, clock=ManualClock()
    )
    step_into_a_device_error(rig, npu_state)
    engine.report_fault(Fault(FaultKind.DEVICE_ERROR, rank=1, info="FakeDeviceError"))
    assert engine.health is HealthStatus.UNHEALTHY
    result = engine.apply("retry", {}, "retry-1")
    assert result.success, result.reason
    assert engine.phase is Phase.HEALTHY
    # barrier reset, then the retry's full reset, then the dummy batch through MC2
    # ... and the synchronize that makes its queued kernels' errors surface
    assert npu_state.names() == [DISPATCH, *RESET, *RESET, DISPATCH, COMBINE, "npu.synchronize"]
    assert rig.backend.epoch == engine.epoch == 1
    assert rig.host.dummy_batches == 1
    # groups: the initial one, re-created by reset_device, re-created by rebuild_groups
    assert len(rig.groups.created) == 3 and len(rig.groups.destroyed) == 2
