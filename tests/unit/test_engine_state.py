"""EngineState: slotted, changed through its intent methods, pending decisions as typed values."""

from __future__ import annotations

import pytest

from ftengine.backends.base import RepairReport
from ftengine.clock import ManualClock
from ftengine.engine_state import EngineState
from ftengine.errors import TransitionError
from ftengine.faults import Fault, FaultKind, Phase
from ftengine.fsm import Trigger
from ftengine.policies import GiveUp, Retry, ScaleDown, WaitForOrchestrator
from ftengine.recovery import STEP, Deadline, PendingRetry, PendingScaleDown

FAULT = Fault(FaultKind.DEAD_PEER, rank=3, info="PeerDead", at=100.0)


def quarantined() -> tuple[EngineState, ManualClock]:
    """A four-rank engine's state right after a fault while serving."""
    clock = ManualClock(100.0)
    state = EngineState(0, 4, clock, history=8)
    state.note_fault(FAULT, Phase.RUNNING, clock.now())
    state.fire(Trigger.FAULT, "fault")
    return state, clock


def test_it_is_slotted() -> None:
    state, _ = quarantined()
    assert not hasattr(state, "__dict__")
    with pytest.raises(AttributeError):
        state.epcoh = 1  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("decision", "pending"),
    [
        (Retry(2.0), PendingRetry(102.0)),
        (ScaleDown({2}), PendingScaleDown(100.0, frozenset({2}))),
        (WaitForOrchestrator(110.0), Deadline(110.0)),
        (GiveUp("no"), None),
    ],
)
def test_a_kept_decision_is_a_typed_pending_value(decision: object, pending: object) -> None:
    state, clock = quarantined()
    state.schedule(decision, clock.now())  # type: ignore[arg-type]
    assert state.pending == pending


def test_a_due_decision_is_taken_once_and_never_while_an_action_is_in_flight() -> None:
    state, clock = quarantined()
    state.schedule(Retry(1.0), clock.now())
    assert state.take_due() is None  # not due yet
    clock.advance(1.0)
    state.in_flight = "rebuild_groups"  # an interrupted run's action has not returned
    assert state.take_due() is None and state.pending == PendingRetry(101.0)
    state.action_returned()
    assert state.take_due() == PendingRetry(101.0)
    assert state.pending is None and state.take_due() is None


def test_a_deadline_is_never_taken_only_expired() -> None:
    state, clock = quarantined()
    state.schedule(WaitForOrchestrator(100.0), clock.now())
    assert state.take_due() is None and state.pending == Deadline(100.0)


def test_a_run_from_begin_to_complete() -> None:
    state, clock = quarantined()
    plan = state.begin(Trigger.SCALE_DOWN, frozenset({3}), "command s1")
    assert (plan.phase, plan.attempt, plan.token, plan.fault) == (
        Phase.SCALING_DOWN,
        1,
        1,
        FAULT,
    )
    assert plan.alive == frozenset({0, 1, 2})
    assert [s.action for s in plan.steps] == [
        "mask_ranks",
        "rebuild_groups",
        "repair_experts",
        "run_dummy_batch",
    ]
    epochs = []
    for step in plan.steps:
        started = state.action_started(plan, step)
        assert state.in_flight == step.action
        epochs.append(started.args.epoch)
        state.action_returned()
        clock.advance(1.0)
        report = RepairReport(reloads=2) if step.action == "repair_experts" else None
        state.action_finished(started, report)
    assert epochs == [0, 1, 1, 1]  # the rebuild opens epoch 1 for itself and what follows
    assert state.owns(plan) and state.in_flight is None
    state.complete(plan)
    status = state.snapshot()
    assert (status.phase, status.removed_ranks, status.epoch, status.fault_info) == (
        Phase.HEALTHY,
        frozenset({3}),
        1,
        None,
    )
    timeline = status.timeline
    assert timeline is not None and timeline.repair == RepairReport(reloads=2)
    assert [s.name for s in timeline.steps[1:]] == [  # after "detect"
        "mask",
        "comm_rebuild",
        "expert_repair",
        "validate",
    ]


def test_quarantine_is_recorded_but_never_in_flight() -> None:
    state, _ = quarantined()
    state.in_flight = "rebuild_groups"  # an interrupted run's action, still in the backend
    started = state.quarantine_started(FAULT)
    assert started.args.fault is FAULT and started.args.alive == frozenset({0, 1, 2, 3})
    state.action_finished(started)
    assert state.in_flight == "rebuild_groups"


def test_an_action_outside_its_phase_is_refused_and_leaves_no_trace() -> None:
    state, _ = quarantined()
    plan = state.begin(Trigger.RETRY, frozenset(), "policy retry")
    steps_before = state.snapshot().timeline.steps  # type: ignore[union-attr]
    with pytest.raises(TransitionError, match="'mask_ranks' is not allowed in phase 'retrying'"):
        state.action_started(plan, STEP["mask_ranks"])
    with pytest.raises(TransitionError, match="'quarantine' is not allowed in phase 'retrying'"):
        state.quarantine_started(FAULT)
    assert (state.epoch, state.in_flight) == (0, None)
    assert state.snapshot().timeline.steps == steps_before  # type: ignore[union-attr]


def test_a_failed_step_becomes_a_recovery_fault_of_the_episode() -> None:
    state, _ = quarantined()
    plan = state.begin(Trigger.RETRY, frozenset(), "policy retry")
    fault = state.fail(plan, STEP["reset_device"], "DeviceError: lost")
    assert (fault.kind, fault.info) == (FaultKind.RECOVERY_ERROR, "reset_device: DeviceError: lost")
    assert state.ft_error == "retrying failed at reset_device: DeviceError: lost"
    assert state.current().last is fault and state.fault_info == fault.info
