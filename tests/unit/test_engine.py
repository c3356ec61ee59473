"""RecoveryEngine: fault intake, the backend order of each recovery, policy-driven recovery,
deadlines, failures during recovery, status and the timeline."""

from __future__ import annotations

import json

import pytest

from ftengine.backends.fake import Call, FakeBackend
from ftengine.context import RedundancyFacts
from ftengine.engine import RecoveryEngine
from ftengine.errors import ConfigError, DeviceError
from ftengine.faults import Fault, FaultKind, HealthStatus, Phase, fault_text
from ftengine.policies import (
    AutoRecovery,
    FlapGuard,
    GiveUp,
    MaxAttempts,
    OrchestratorDriven,
    Retry,
    ScaleDown,
)
from tests.engine_support import dead_peer, make_rig, transient

Q, T, S, H, D = Phase.QUARANTINED, Phase.RETRYING, Phase.SCALING_DOWN, Phase.HEALTHY, Phase.DEAD


def test_a_new_engine_serves_with_an_empty_status() -> None:
    rig = make_rig()
    status = rig.engine.status().to_dict()
    assert status == {
        "id": 0,
        "status": 0,
        "phase": "running",
        "fault_info": None,
        "last_ft_request_id": None,
        "ft_error": None,
        "removed_ranks": [],
        "ready_ranks": [],
        "last_admission": None,
        "epoch": 0,
        "attempts": 0,
        "timeline": None,
    }


def test_fault_text_names_kind_rank_and_info() -> None:
    assert fault_text(dead_peer(3)) == "dead_peer fault on rank 3 (PeerDead)"
    assert fault_text(Fault(FaultKind.TRANSIENT)) == "transient fault"


def test_bad_construction_is_refused() -> None:
    with pytest.raises(ConfigError, match="rank must be in"):
        RecoveryEngine(OrchestratorDriven(), FakeBackend(), rank=4, world_size=4)
    with pytest.raises(ConfigError, match="policy must be callable"):
        RecoveryEngine("auto", FakeBackend())  # type: ignore[arg-type]


def test_a_fault_quarantines_and_waits_without_recovering() -> None:
    rig = make_rig()
    rig.engine.report_fault(dead_peer())
    assert (rig.engine.phase, rig.engine.health) == (Q, HealthStatus.UNHEALTHY)
    stamped = Fault(FaultKind.DEAD_PEER, rank=3, step=7, info="PeerDead", at=100.0)
    assert rig.backend.calls == (Call("quarantine", (stamped,)),)
    assert rig.engine.status().fault_info == "PeerDead"
    rig.engine.poll()
    assert rig.backend.names() == ["quarantine"]


def test_a_retry_command_runs_the_retry_order_then_serves() -> None:
    rig = make_rig()
    rig.engine.report_fault(transient())
    result = rig.engine.apply("retry", {}, "r1")
    assert (result.request_id, result.success, result.reason) == ("r1", True, None)
    assert rig.backend.calls[1:] == (
        Call("reset_device"),
        Call("rebuild_groups", (frozenset({0, 1, 2, 3}), 1)),
        Call("run_dummy_batch"),
    )
    assert rig.phases() == [Q, T, H]
    status = rig.engine.status()
    assert (status.phase, status.epoch, status.attempts, status.fault_info) == (H, 1, 1, None)
    assert status.last_ft_request_id == "r1"


def test_a_scale_down_command_runs_the_scale_down_order() -> None:
    rig = make_rig(redundancy=RedundancyFacts(ep_size=4, local_slots=3, num_logical=8))
    rig.engine.report_fault(dead_peer(3))
    result = rig.engine.apply("scale_down", {"removed_dp_ranks": [3]}, "s1")
    assert result.success, result.reason
    dead, alive = frozenset({3}), frozenset({0, 1, 2})
    assert rig.backend.calls[1:] == (
        Call("mask_ranks", (dead,)),
        Call("rebuild_groups", (alive, 1)),
        Call("repair_experts", (dead,)),
        Call("run_dummy_batch"),
    )
    assert rig.engine.removed_ranks == dead
    timeline = rig.engine.status().timeline
    assert timeline is not None and timeline.repair is not None
    assert timeline.repair.reloads == 2


def test_scale_downs_are_cumulative_4_3_2() -> None:
    rig = make_rig()
    rig.engine.report_fault(dead_peer(3))
    assert rig.engine.apply("scale_down", {"removed_dp_ranks": [3]}, "a").success
    rig.engine.report_fault(dead_peer(2))
    assert rig.engine.apply("scale_down", {"removed_dp_ranks": [2, 3]}, "b").success
    assert rig.engine.removed_ranks == frozenset({2, 3})
    assert rig.backend.calls[-3] == Call("rebuild_groups", (frozenset({0, 1}), 2))
    assert rig.engine.status().timeline.episode == 2  # type: ignore[union-attr]


def test_the_orchestrator_deadline_kills_the_engine_only_once_due() -> None:
    rig = make_rig(OrchestratorDriven(recovery_timeout=10.0))
    rig.engine.report_fault(transient())
    assert rig.poll_after(9.5) is Q
    assert rig.poll_after(0.5) is D
    status = rig.engine.status()
    assert (status.phase, status.status) == (D, HealthStatus.DEAD)
    assert "deadline t=110s" in (status.ft_error or "")


def test_an_expired_deadline_takes_effect_before_a_command_even_without_a_poll() -> None:
    rig = make_rig(OrchestratorDriven(recovery_timeout=10.0))
    rig.engine.report_fault(transient())
    rig.clock.advance(10.0)  # the host has not polled since the deadline passed
    result = rig.engine.apply("retry", {}, "late")
    assert not result.success and "status is DEAD" in (result.reason or "")
    assert (rig.engine.phase, rig.backend.names()) == (D, ["quarantine"])
    assert "deadline t=110s" in (rig.engine.status().ft_error or "")


def test_an_expired_deadline_takes_effect_before_a_later_fault() -> None:
    # Without the deadline, FlapGuard would scale the flapping rank 2 down on this fault.
    rig = make_rig(FlapGuard(k=2, window=60.0) | OrchestratorDriven(recovery_timeout=10.0))
    rig.engine.report_fault(transient(rank=2))
    rig.clock.advance(10.0)  # the host has not polled since the deadline passed
    rig.engine.report_fault(transient(rank=2))
    assert rig.phases() == [Q, D] and rig.backend.names() == ["quarantine"]
    assert "deadline t=110s" in (rig.engine.status().ft_error or "")


def test_the_deadline_counts_from_the_first_fault_of_the_episode() -> None:
    rig = make_rig(OrchestratorDriven(recovery_timeout=10.0))
    rig.engine.report_fault(transient())
    rig.clock.advance(8.0)
    rig.engine.report_fault(dead_peer())
    assert rig.poll_after(2.0) is D


def test_dead_is_absorbing() -> None:
    rig = make_rig(OrchestratorDriven(recovery_timeout=1.0))
    rig.engine.report_fault(transient())
    assert rig.poll_after(1.0) is D
    calls = rig.backend.calls
    rig.engine.report_fault(dead_peer())
    rig.engine.poll()
    result = rig.engine.apply("retry", {}, "late")
    assert not result.success and "status is DEAD" in (result.reason or "")
    assert (rig.engine.phase, rig.backend.calls) == (D, calls)


def test_auto_recovery_retries_on_poll_not_in_the_reporting_thread() -> None:
    rig = make_rig(AutoRecovery())
    rig.engine.report_fault(transient())
    assert rig.backend.names() == ["quarantine"]
    rig.engine.poll()
    assert rig.phases() == [Q, T, H]
    assert rig.engine.status().last_ft_request_id is None


def test_a_delayed_retry_waits_for_its_time() -> None:
    rig = make_rig(AutoRecovery(retry_delay=2.0))
    rig.engine.report_fault(transient())
    assert rig.poll_after(1.9) is Q
    assert rig.poll_after(0.1) is H


def test_auto_recovery_scales_down_a_confirmed_dead_peer() -> None:
    rig = make_rig(AutoRecovery(), redundancy=RedundancyFacts(4, 3, 8))
    rig.engine.report_fault(dead_peer(2))
    rig.engine.poll()
    assert rig.phases() == [Q, S, H]
    assert rig.engine.removed_ranks == frozenset({2})


def test_auto_recovery_without_enough_redundancy_dies_with_the_reason() -> None:
    rig = make_rig(AutoRecovery(), redundancy=RedundancyFacts(4, 2, 8))
    rig.engine.report_fault(dead_peer(2))
    status = rig.engine.status()
    assert status.phase is D
    assert "no policy decision for a dead_peer fault" in (status.ft_error or "")


def test_a_failed_recovery_step_waits_for_the_next_command_then_the_retry_recovers() -> None:
    # vLLM keeps an engine whose command failed UNHEALTHY, with its ft_error
    rig = make_rig()
    rig.engine.report_fault(transient())
    rig.backend.fail_on("rebuild_groups", DeviceError("stream poisoned"))
    result = rig.engine.apply("retry", {}, "r1")
    assert not result.success
    assert "rebuild_groups failed (DeviceError: stream poisoned)" in (result.reason or "")
    status = rig.engine.status()
    assert status.phase is Q and "retrying failed at rebuild_groups" in (status.ft_error or "")
    assert rig.engine.apply("retry", {}, "r2").success
    assert rig.engine.status().phase is H


def test_a_failed_recovery_step_is_fatal_once_the_attempts_are_spent() -> None:
    rig = make_rig(OrchestratorDriven(recovery_timeout=10.0, max_attempts=1))
    rig.engine.report_fault(transient())
    rig.backend.fail_on("rebuild_groups", DeviceError("stream poisoned"))
    result = rig.engine.apply("retry", {}, "r1")
    assert not result.success
    assert "rebuild_groups failed (DeviceError: stream poisoned)" in (result.reason or "")
    assert "status is DEAD" in (result.reason or "")
    assert "run_dummy_batch" not in rig.backend.names()
    status = rig.engine.status()
    assert status.phase is D and "during retrying" in (status.ft_error or "")
    steps = status.timeline.steps  # type: ignore[union-attr]
    assert steps[-1].name == "comm_rebuild" and steps[-1].error == "DeviceError: stream poisoned"


def test_a_policy_may_keep_recovering_until_its_attempt_bound() -> None:
    rig = make_rig(MaxAttempts(2) | AutoRecovery(retry_during_recovery=True))
    rig.engine.report_fault(transient())
    rig.backend.fail_on("run_dummy_batch", nth=1)
    rig.backend.fail_on("run_dummy_batch", nth=2)
    rig.engine.poll()
    assert rig.phases() == [Q, T, Q]
    assert rig.backend.names().count("quarantine") == 2
    assert rig.engine.status().ft_error == "retrying failed at run_dummy_batch: " + (
        "BackendError: fake run_dummy_batch call #1 failed (armed by FakeBackend.fail_on)"
    )
    rig.engine.poll()
    status = rig.engine.status()
    assert (status.phase, status.attempts) == (D, 2)
    assert "MaxAttempts(2)" in (status.ft_error or "")


def test_a_failed_quarantine_is_fatal() -> None:
    rig = make_rig()
    rig.backend.fail_on("quarantine")
    rig.engine.report_fault(transient())
    assert rig.phases() == [Q, D]
    assert (rig.engine.status().ft_error or "").startswith("quarantine failed (BackendError")


def test_a_dead_worker_gives_up_at_once() -> None:
    rig = make_rig(AutoRecovery())
    rig.engine.report_fault(Fault(FaultKind.SELF_DEAD, rank=0, info="exit -9"))
    assert rig.phases() == [Q, D]


def test_a_raising_policy_kills_the_engine_with_its_error() -> None:
    def broken(ctx: object) -> None:
        raise KeyError("boom")

    rig = make_rig(broken)
    rig.engine.report_fault(transient())
    assert rig.engine.phase is D
    assert rig.engine.status().ft_error == "policy raised KeyError: 'boom'"


def test_an_impossible_policy_scale_down_kills_the_engine() -> None:
    rig = make_rig(lambda ctx: ScaleDown({0}))
    rig.engine.report_fault(transient())
    rig.engine.poll()
    assert rig.engine.phase is D
    assert "own rank 0" in (rig.engine.status().ft_error or "")
    assert rig.backend.names() == ["quarantine"]


def test_a_plain_function_policy_and_an_abstaining_one() -> None:
    rig = make_rig(lambda ctx: Retry(0.0) if ctx.fault.kind is FaultKind.TRANSIENT else None)
    rig.engine.report_fault(transient())
    rig.engine.poll()
    assert rig.engine.phase is H
    rig.engine.report_fault(dead_peer())
    assert rig.engine.phase is D


def test_a_new_episode_after_recovery_resets_attempts_and_errors() -> None:
    rig = make_rig(MaxAttempts(1) | AutoRecovery())
    rig.engine.report_fault(transient())
    rig.engine.poll()
    rig.engine.report_fault(transient())
    status = rig.engine.status()
    assert (status.phase, status.attempts, status.ft_error) == (Q, 0, None)
    assert status.timeline is not None and status.timeline.episode == 2


def test_listeners_see_every_change_and_a_broken_one_is_contained() -> None:
    rig = make_rig(lambda ctx: GiveUp("nothing to do"))

    def broken(change: object) -> None:
        raise RuntimeError("listener bug")

    rig.engine.subscribe(broken)
    extra: list[Phase] = []
    unsubscribe = rig.engine.subscribe(lambda change: extra.append(change.dest))
    unsubscribe()
    rig.engine.report_fault(transient())
    assert [(c.source, c.dest, c.trigger) for c in rig.changes] == [
        (Phase.RUNNING, Q, "fault"),
        (Q, D, "give_up"),
    ]
    assert rig.changes[-1].reason == "nothing to do" and extra == []


def test_the_timeline_times_every_step_on_the_engine_clock() -> None:
    rig = make_rig()
    rig.backend.on_call = lambda call: rig.clock.advance(1.0)
    rig.engine.report_fault(Fault(FaultKind.DEAD_PEER, rank=3, at=99.5))
    rig.engine.apply("scale_down", {"removed_dp_ranks": [3]}, "s")
    timeline = rig.engine.status().timeline
    assert timeline is not None
    names = [(s.name, s.attempt, s.start, s.end) for s in timeline.steps]
    assert names == [
        ("detect", 0, 99.5, 100.0),
        ("quarantine", 0, 100.0, 101.0),
        ("mask", 1, 101.0, 102.0),
        ("comm_rebuild", 1, 102.0, 103.0),
        ("expert_repair", 1, 103.0, 104.0),
        ("validate", 1, 104.0, 105.0),
    ]
    assert [(p, at) for p, at, _ in timeline.phases] == [(Q, 100.0), (S, 101.0), (H, 105.0)]
    assert (timeline.started, timeline.ended, timeline.step_seconds("validate")) == (
        99.5,
        105.0,
        1.0,
    )
    json.dumps(rig.engine.status().to_dict())
