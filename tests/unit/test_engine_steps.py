"""The step table and what is read from it: the two recovery sequences, the actions allowed
per phase, the timeline names, the fake's action list; and the engine's run-time refusal of
an action its phase does not allow."""

from __future__ import annotations

import pytest

from ftengine.backends import fake
from ftengine.backends.base import Backend, RankAdmitter, RepairReport
from ftengine.backends.fake import Call, FakeBackend
from ftengine.errors import TransitionError
from ftengine.faults import Fault, FaultKind, Phase
from ftengine.recovery import (
    ALLOWED_ACTIONS,
    QUARANTINE,
    RETRY_ACTIONS,
    SCALE_DOWN_ACTIONS,
    SCALE_UP_ACTIONS,
    STEP,
    STEPS,
    Step,
    StepArgs,
    check_allowed,
    sequence,
)
from ftengine.timeline import STEP_OF_ACTION
from tests.engine_support import make_rig, transient

FAULT = Fault(FaultKind.DEAD_PEER, rank=3, info="PeerDead")


def test_the_sequences_are_the_documented_backend_orders() -> None:
    assert RETRY_ACTIONS == ("reset_device", "rebuild_groups", "run_dummy_batch")
    assert SCALE_DOWN_ACTIONS == (
        "mask_ranks",
        "rebuild_groups",
        "repair_experts",
        "run_dummy_batch",
    )
    # The survivors and the returning rank run the same admission, in the same order.
    assert SCALE_UP_ACTIONS == ("rebuild_groups", "admit_ranks", "run_dummy_batch")
    assert [s.action for s in sequence(Phase.JOINING)] == list(SCALE_UP_ACTIONS)
    assert [s.action for s in sequence(Phase.RETRYING)] == list(RETRY_ACTIONS)
    for phase in Phase:
        if not phase.recovering and phase not in (Phase.SCALING_UP, Phase.JOINING):
            assert sequence(phase) == ()


def test_only_the_admission_commits_a_removed_set_before_its_end() -> None:
    assert [step.action for step in STEPS if step.commits] == ["admit_ranks"]


def test_only_the_group_rebuild_opens_an_epoch() -> None:
    assert [step.action for step in STEPS if step.new_epoch] == ["rebuild_groups"]


def test_the_allowed_actions_per_phase() -> None:
    assert dict(ALLOWED_ACTIONS) == {
        Phase.RUNNING: frozenset(),
        Phase.QUARANTINED: frozenset({"quarantine"}),
        Phase.RETRYING: frozenset(RETRY_ACTIONS),
        Phase.SCALING_DOWN: frozenset(SCALE_DOWN_ACTIONS),
        Phase.HEALTHY: frozenset(),
        Phase.DEAD: frozenset(),
        Phase.SCALING_UP: frozenset(SCALE_UP_ACTIONS),
        Phase.LOADING: frozenset(),
        Phase.READY: frozenset(),
        Phase.JOINING: frozenset(SCALE_UP_ACTIONS),
    }


def test_timeline_names_come_from_the_table() -> None:
    assert dict(STEP_OF_ACTION) == {
        "quarantine": "quarantine",
        "reset_device": "device_reset",
        "mask_ranks": "mask",
        "rebuild_groups": "comm_rebuild",
        "repair_experts": "expert_repair",
        "admit_ranks": "admit",
        "run_dummy_batch": "validate",
    }
    assert {step.action: step for step in STEPS} == dict(STEP)


def test_the_fakes_actions_are_every_backend_method() -> None:
    methods = {
        name
        for protocol in (Backend, RankAdmitter)
        for name, value in vars(protocol).items()
        if callable(value)
    }
    assert set(fake.ACTIONS) == {name for name in methods if not name.startswith("_")}
    assert {step.action for step in STEPS} <= set(fake.ACTIONS)


# What each action's backend call must receive from ``ARGS``.
ARGS = StepArgs(FAULT, removed=frozenset({3}), alive=frozenset({0, 1, 2}), epoch=1)
# A scale-up admitting rank 2 back (the fake checks it was masked and is in the groups).
ADMIT_ARGS = StepArgs(
    None, removed=frozenset({3}), alive=frozenset({0, 1, 2}), epoch=1, added=frozenset({2})
)
EXPECTED_CALL = {
    "quarantine": Call("quarantine", (FAULT,)),
    "reset_device": Call("reset_device"),
    "mask_ranks": Call("mask_ranks", (frozenset({3}),)),
    "rebuild_groups": Call("rebuild_groups", (frozenset({0, 1, 2}), 1)),
    "repair_experts": Call("repair_experts", (frozenset({3}),)),
    "run_dummy_batch": Call("run_dummy_batch"),
    "admit_ranks": Call("admit_ranks", (frozenset({2}), frozenset({3}))),
}


@pytest.mark.parametrize("step", STEPS, ids=[step.action for step in STEPS])
def test_each_steps_call_is_the_backend_method_it_names(step: Step) -> None:
    backend = FakeBackend()
    backend.masked = frozenset({2, 3})
    result = step.call(backend, ADMIT_ARGS if step.action == "admit_ranks" else ARGS)
    assert backend.calls == (EXPECTED_CALL[step.action],)
    reports = ("repair_experts", "admit_ranks")
    assert isinstance(result, RepairReport) is (step.action in reports)


def test_check_allowed_names_the_action_the_phase_and_what_is_allowed() -> None:
    check_allowed(QUARANTINE, Phase.QUARANTINED)
    with pytest.raises(TransitionError) as caught:
        check_allowed(STEP["repair_experts"], Phase.RETRYING)
    message = str(caught.value)
    assert "'repair_experts' is not allowed in phase 'retrying'" in message
    assert "['rebuild_groups', 'reset_device', 'run_dummy_batch']" in message


def test_the_engine_refuses_an_action_its_phase_does_not_allow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A plan that strays from the table (here: a retry that would repair experts) is an
    # engine bug; the engine must refuse the action before the backend sees it.
    monkeypatch.setattr("ftengine.engine_state.sequence", lambda phase: (STEP["repair_experts"],))
    rig = make_rig()
    rig.engine.report_fault(transient())
    with pytest.raises(TransitionError, match="'repair_experts' is not allowed in phase"):
        rig.engine.apply("retry", {}, "r1")
    assert rig.backend.names() == ["quarantine"]
    status = rig.engine.status()
    assert status.epoch == 0
    assert [s.name for s in status.timeline.steps] == ["detect", "quarantine"]  # type: ignore[union-attr]
