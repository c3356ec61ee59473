"""scale_up on the engine: the command's validation (each 400-style reason), the survivors'
and the returning rank's admission sequences, the policy's admit hook, and the failure paths
(back to quarantined on a survivor, back to ready on the returning rank, never dead)."""

from __future__ import annotations

import threading

import pytest

from ftengine.backends.fake import Call, FakeBackend
from ftengine.clock import ManualClock
from ftengine.context import AdmissionContext
from ftengine.engine import SCALE_UP_ACTIONS, RecoveryEngine
from ftengine.faults import Fault, FaultKind, Phase
from ftengine.policies import (
    AllOf,
    AutoRecovery,
    OrchestratorDriven,
    ScaleUp,
    as_policy,
    decide_admission,
)
from tests.engine_support import Rig, dead_peer, make_rig

pytestmark = pytest.mark.timeout(30)


def scaled_down(rig: Rig, dead: int = 3) -> None:
    """Kill ``dead``, scale it down, and forget the calls so far."""
    rig.engine.report_fault(dead_peer(dead))
    result = rig.engine.apply("scale_down", {"removed_dp_ranks": [dead]}, f"down-{dead}")
    assert result.success, result.reason
    assert rig.engine.phase is Phase.HEALTHY
    rig.backend._calls.clear()


def scale_up(rig: Rig, params: dict[str, object], request_id: str = "up") -> tuple[bool, str]:
    result = rig.engine.apply("scale_up", params, request_id)
    return result.success, result.reason or ""


def test_a_ready_removed_rank_is_admitted_with_a_fresh_epoch_and_nothing_reloaded() -> None:
    rig = make_rig()
    scaled_down(rig)
    epoch = rig.engine.epoch
    rig.engine.note_ready(frozenset({3}))
    assert rig.engine.status().to_dict()["ready_ranks"] == [3]
    ok, reason = scale_up(rig, {"added_dp_ranks": [3]})
    assert ok, reason
    assert rig.backend.calls == (
        Call("rebuild_groups", (frozenset({0, 1, 2, 3}), epoch + 1)),
        Call("admit_ranks", (frozenset({3}), frozenset())),
        Call("run_dummy_batch"),
    )
    assert tuple(c.name for c in rig.backend.calls) == SCALE_UP_ACTIONS
    assert "repair_experts" not in rig.backend.names()  # survivors reload nothing
    status = rig.engine.status()
    assert status.phase is Phase.HEALTHY and status.removed_ranks == frozenset()
    assert status.ready_ranks == frozenset() and status.epoch == epoch + 1
    assert rig.phases()[-2:] == [Phase.SCALING_UP, Phase.HEALTHY]
    assert rig.backend.masked == frozenset()
    admission = status.to_dict()["last_admission"]
    assert isinstance(admission, dict)
    assert (admission["added"], admission["ok"], admission["reloads"]) == ([3], True, 0)
    # The admission is no fault: the scale-down episode's timeline is left as it was.
    assert status.timeline is not None
    assert "admit" not in [step.name for step in status.timeline.steps]


def test_a_replayed_scale_up_returns_its_first_result_without_acting_again() -> None:
    rig = make_rig()
    scaled_down(rig)
    rig.engine.note_ready(frozenset({3}))
    first = rig.engine.apply("scale_up", {"added_dp_ranks": [3]}, "same")
    calls = len(rig.backend.calls)
    again = rig.engine.apply("scale_up", {"added_dp_ranks": [3]}, "same")
    assert first == again and first.success
    assert len(rig.backend.calls) == calls


@pytest.mark.parametrize(
    ("params", "ready", "expected"),
    [
        ({"added_dp_ranks": []}, {3}, "added_dp_ranks is empty"),
        ({"added_dp_ranks": [2]}, {3}, "ranks [2] were not removed (removed: [3])"),
        ({"added_dp_ranks": [7]}, {3}, "ranks [7] are out of range: not DP ranks 0..3"),
        ({"added_dp_ranks": [3]}, set(), "ranks [3] are not ready"),
        ({"added_dp_ranks": [3, 3]}, {3}, "names ranks [3] more than once"),
        ({"added_dp_ranks": [0]}, {3}, "contains this engine's own rank 0"),
        ({"added_dp_ranks": [3], "epoch": 0}, {3}, "epoch 0 is not this engine's epoch 1"),
        (
            {"added_dp_ranks": [3], "removed_dp_ranks": [2, 3]},
            {3},
            "removed_dp_ranks [2, 3] is not this engine's removed set [3]",
        ),
        ({"added_dp_ranks": ["3"]}, {3}, "must hold DP ranks (ints >= 0)"),
        ({"added": [3]}, {3}, "scale_up takes params"),
    ],
)
def test_a_wrong_scale_up_is_refused_naming_why_and_changes_nothing(
    params: dict[str, object], ready: set[int], expected: str
) -> None:
    rig = make_rig()
    scaled_down(rig)
    rig.engine.note_ready(frozenset(ready))
    before = rig.engine.status()
    ok, reason = scale_up(rig, params)
    assert not ok
    assert expected in reason
    assert rig.backend.calls == ()
    after = rig.engine.status()
    assert (after.phase, after.removed_ranks, after.epoch) == (
        before.phase,
        before.removed_ranks,
        before.epoch,
    )


def test_scale_up_is_refused_outside_healthy() -> None:
    rig = make_rig()
    ok, reason = scale_up(rig, {"added_dp_ranks": [3]})
    assert not ok and "has removed no rank (phase running)" in reason
    rig.engine.report_fault(dead_peer(3))
    ok, reason = scale_up(rig, {"added_dp_ranks": [3]}, "up2")
    assert not ok and "only accepted while HEALTHY" in reason and "quarantined" in reason


def test_a_backend_without_admit_ranks_refuses_scale_up() -> None:
    class NoAdmit(FakeBackend):
        admit_ranks = None  # type: ignore[assignment]

    backend = NoAdmit()
    engine = RecoveryEngine(OrchestratorDriven(10.0), backend, world_size=4, clock=ManualClock(1))
    engine.report_fault(dead_peer(3))
    assert engine.apply("scale_down", {"removed_dp_ranks": [3]}, "d").success
    engine.note_ready(frozenset({3}))
    result = engine.apply("scale_up", {"added_dp_ranks": [3]}, "u")
    assert not result.success and "cannot admit ranks" in (result.reason or "")


def test_a_failed_rebuild_quarantines_and_a_retry_restores_the_old_membership() -> None:
    rig = make_rig()
    scaled_down(rig)
    rig.engine.note_ready(frozenset({3}))
    rig.backend.fail_on("rebuild_groups")
    ok, reason = scale_up(rig, {"added_dp_ranks": [3]})
    assert not ok and "rebuild_groups failed" in reason
    status = rig.engine.status()
    assert status.phase is Phase.QUARANTINED  # never dead: an orchestrator may retry
    assert status.removed_ranks == frozenset({3})  # not committed: 3 still removed
    assert status.ready_ranks == frozenset()  # it must report ready again
    assert status.to_dict()["last_admission"]["ok"] is False  # type: ignore[index]
    assert rig.engine.apply("retry", {}, "r").success
    assert rig.backend.calls[-2] == Call("rebuild_groups", (frozenset({0, 1, 2}), status.epoch + 1))
    assert rig.engine.phase is Phase.HEALTHY
    rig.engine.note_ready(frozenset({3}))
    ok, reason = scale_up(rig, {"added_dp_ranks": [3]}, "up-again")
    assert ok, reason
    assert rig.engine.removed_ranks == frozenset()


def test_a_failure_after_the_commit_leaves_the_rank_a_member_to_scale_down_again() -> None:
    rig = make_rig()
    scaled_down(rig)
    rig.engine.note_ready(frozenset({3}))
    rig.backend.fail_on("run_dummy_batch")
    ok, _ = scale_up(rig, {"added_dp_ranks": [3]})
    assert not ok
    assert rig.engine.phase is Phase.QUARANTINED
    assert rig.engine.removed_ranks == frozenset()  # admit_ranks returned: committed
    # The returning rank died again: it is a newly dead rank for a scale-down.
    result = rig.engine.apply("scale_down", {"removed_dp_ranks": [3]}, "down-again")
    assert result.success, result.reason
    assert rig.engine.removed_ranks == frozenset({3})


def test_a_fault_during_the_admission_interrupts_it_into_quarantined() -> None:
    rig = make_rig()
    scaled_down(rig)
    rig.engine.note_ready(frozenset({3}))
    hang = rig.backend.hang_on("rebuild_groups")
    results: list[tuple[bool, str]] = []
    runner = threading.Thread(target=lambda: results.append(scale_up(rig, {"added_dp_ranks": [3]})))
    runner.start()
    assert hang.entered.wait(5)
    assert rig.engine.phase is Phase.SCALING_UP
    assert rig.engine.health.name == "HEALTHY"  # the survivors still count as serving
    rig.engine.report_fault(Fault(FaultKind.TRANSIENT, rank=0, info="RuntimeError"))
    assert rig.engine.status().phase is Phase.QUARANTINED
    hang.release()
    runner.join(5)
    assert results and not results[0][0] and "interrupted" in results[0][1]
    assert rig.engine.removed_ranks == frozenset({3})


# -- the policy's admit hook ---------------------------------------------------------------


def test_under_auto_a_ready_rank_is_admitted_at_poll_without_a_command() -> None:
    rig = make_rig(AutoRecovery())
    rig.engine.report_fault(dead_peer(3))
    rig.engine.poll()  # auto scales 3 down
    assert rig.engine.phase is Phase.HEALTHY and rig.engine.removed_ranks == frozenset({3})
    rig.engine.poll()
    assert rig.backend.count("admit_ranks") == 0  # nothing ready: nothing to admit
    rig.engine.note_ready(frozenset({3}))
    rig.engine.poll()
    assert rig.engine.removed_ranks == frozenset()
    assert rig.backend.count("admit_ranks") == 1
    assert Phase.SCALING_UP in rig.phases()


def test_the_orchestrator_policy_waits_for_a_command() -> None:
    rig = make_rig()
    scaled_down(rig)
    rig.engine.note_ready(frozenset({3}))
    rig.poll_after(60.0)
    assert rig.engine.removed_ranks == frozenset({3}) and rig.backend.calls == ()


def test_admission_decisions_compose_and_never_exceed_the_ready_ranks() -> None:
    ctx = AdmissionContext(ready_ranks={2, 3}, removed_ranks={1, 2, 3}, now=1.0, world_size=4)
    assert decide_admission(AutoRecovery(), ctx) == ScaleUp({2, 3})
    assert decide_admission(AutoRecovery(admit_ready=False), ctx) is None
    assert decide_admission(OrchestratorDriven(), ctx) is None
    assert decide_admission(AutoRecovery() | OrchestratorDriven(), ctx) == ScaleUp({2, 3})
    assert decide_admission(OrchestratorDriven() | AutoRecovery(), ctx) == ScaleUp({2, 3})

    class OnlyTwo:
        def __call__(self, ctx: object) -> None:
            return None

        def admit(self, ctx: AdmissionContext) -> ScaleUp:
            return ScaleUp({1, 2})  # 1 is not ready: dropped

    assert decide_admission(as_policy(OnlyTwo()), ctx) == ScaleUp({2})
    assert decide_admission(AllOf.of(AutoRecovery(), as_policy(OnlyTwo())), ctx) == ScaleUp({2})

    class Broken:
        def __call__(self, ctx: object) -> None:
            return None

        def admit(self, ctx: AdmissionContext) -> ScaleUp:
            raise RuntimeError("policy bug")

    assert decide_admission(Broken(), ctx) is None  # logged; the worker keeps serving


# -- the returning rank --------------------------------------------------------------------


def joining_rig(rank: int = 3) -> tuple[RecoveryEngine, FakeBackend]:
    backend = FakeBackend(rank=rank)
    engine = RecoveryEngine(
        OrchestratorDriven(10.0),
        backend,
        rank=rank,
        world_size=4,
        clock=ManualClock(5.0),
        rejoining=True,
    )
    return engine, backend


def test_the_returning_rank_goes_loading_ready_joining_healthy() -> None:
    engine, backend = joining_rig()
    seen: list[Phase] = []
    engine.subscribe(lambda change: seen.append(change.dest))
    assert engine.status().to_dict()["phase"] == "loading"
    refused = engine.apply("scale_up", {"added_dp_ranks": [3]}, "early")
    assert not refused.success and "phase loading" in (refused.reason or "")
    engine.loaded(frozenset({1, 3}), epoch=4)
    assert engine.phase is Phase.READY
    assert not engine.apply("retry", {}, "r").success
    result = engine.apply("scale_up", {"added_dp_ranks": [3]}, "join")
    assert result.success, result.reason
    assert backend.calls == (
        Call("rebuild_groups", (frozenset({0, 2, 3}), 5)),
        Call("admit_ranks", (frozenset({3}), frozenset({1}))),
        Call("run_dummy_batch"),
    )
    assert seen == [Phase.READY, Phase.JOINING, Phase.HEALTHY]
    status = engine.status()
    assert status.removed_ranks == frozenset({1}) and status.epoch == 5


def test_the_returning_rank_takes_the_deployment_state_from_the_command() -> None:
    engine, backend = joining_rig(rank=0)
    engine.loaded()
    missing = engine.apply("scale_up", {"added_dp_ranks": [0]}, "j0")
    assert not missing.success and "needs the deployment's" in (missing.reason or "")
    params = {"added_dp_ranks": [0], "removed_dp_ranks": [0], "epoch": 2}
    result = engine.apply("scale_up", params, "j1")
    assert result.success, result.reason
    assert backend.calls[0] == Call("rebuild_groups", (frozenset({0, 1, 2, 3}), 3))
    not_me = engine.apply("scale_up", {"added_dp_ranks": [2]}, "j2")
    assert not not_me.success  # healthy now: a survivor's rules


def test_a_failed_join_goes_back_to_ready_and_can_be_admitted_again() -> None:
    engine, backend = joining_rig()
    engine.loaded(frozenset({3}), epoch=1)
    backend.fail_on("run_dummy_batch")
    result = engine.apply("scale_up", {"added_dp_ranks": [3]}, "j1")
    assert not result.success and "run_dummy_batch failed" in (result.reason or "")
    assert engine.phase is Phase.READY
    assert "joining failed at run_dummy_batch" in (engine.status().ft_error or "")
    result = engine.apply("scale_up", {"added_dp_ranks": [3], "epoch": 2}, "j2")
    assert result.success, result.reason
    assert engine.status().phase is Phase.HEALTHY and engine.epoch == 3


def test_a_fault_before_admission_ends_the_returning_rank() -> None:
    engine, _ = joining_rig()
    engine.report_fault(Fault(FaultKind.SELF_DEAD, rank=3, info="killed"))
    assert engine.phase is Phase.DEAD
