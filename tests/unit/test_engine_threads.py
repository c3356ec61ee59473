"""RecoveryEngine across threads: a fault while a recovery action hangs, concurrent commands,
replays of a running request, no second recovery beside an interrupted action, and a storm
of faults and commands."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ftengine.engine import CommandResult
from ftengine.faults import Phase
from ftengine.fsm import successors
from ftengine.policies import AutoRecovery, OrchestratorDriven
from tests.engine_support import dead_peer, make_rig, transient

JOIN_S = 10.0


def _in_thread(target: Callable[[], CommandResult]) -> tuple[threading.Thread, list[CommandResult]]:
    results: list[CommandResult] = []
    thread = threading.Thread(target=lambda: results.append(target()), daemon=True)
    thread.start()
    return thread, results


def test_a_fault_while_an_action_hangs_ends_the_recovery_at_once() -> None:
    rig = make_rig(OrchestratorDriven(recovery_timeout=10.0, max_attempts=1))
    rig.engine.report_fault(transient())
    hang = rig.backend.hang_on("rebuild_groups", timeout=JOIN_S)
    thread, results = _in_thread(lambda: rig.engine.apply("retry", {}, "r"))
    assert hang.entered.wait(JOIN_S)
    rig.engine.report_fault(dead_peer(2))
    assert rig.engine.phase is Phase.DEAD  # without waiting for the hung action
    hang.release()
    thread.join(JOIN_S)
    assert not thread.is_alive()
    assert not results[0].success
    assert "recovery interrupted by a fault; engine 0 status is DEAD" in (results[0].reason or "")
    assert "during retrying" in (results[0].reason or "")
    assert rig.backend.names()[-1] == "rebuild_groups"  # no action after the interruption


def test_a_tolerated_fault_mid_recovery_requarantines_and_the_old_run_stops() -> None:
    rig = make_rig(AutoRecovery(retry_during_recovery=True, retry_delay=5.0))
    rig.engine.report_fault(transient())
    rig.clock.advance(5.0)
    hang = rig.backend.hang_on("reset_device", timeout=JOIN_S)
    poller = threading.Thread(target=rig.engine.poll, daemon=True)
    poller.start()
    assert hang.entered.wait(JOIN_S)
    rig.engine.report_fault(transient())
    assert rig.engine.phase is Phase.QUARANTINED
    hang.release()
    poller.join(JOIN_S)
    assert rig.backend.names() == ["quarantine", "reset_device", "quarantine"]
    assert rig.poll_after(5.0) is Phase.HEALTHY
    status = rig.engine.status()
    assert (status.phase, status.attempts) == (Phase.HEALTHY, 2)


def test_a_command_while_recovering_is_rejected() -> None:
    rig = make_rig()
    rig.engine.report_fault(transient())
    hang = rig.backend.hang_on("run_dummy_batch", timeout=JOIN_S)
    thread, results = _in_thread(lambda: rig.engine.apply("retry", {}, "first"))
    assert hang.entered.wait(JOIN_S)
    second = rig.engine.apply("scale_down", {"removed_dp_ranks": [3]}, "second")
    assert not second.success
    assert "already recovering (phase retrying)" in (second.reason or "")
    hang.release()
    thread.join(JOIN_S)
    assert results[0].success and rig.engine.phase is Phase.HEALTHY


def test_a_replay_of_a_running_request_waits_for_its_result() -> None:
    rig = make_rig()
    rig.engine.report_fault(transient())
    hang = rig.backend.hang_on("rebuild_groups", timeout=JOIN_S)
    first, first_result = _in_thread(lambda: rig.engine.apply("retry", {}, "same"))
    assert hang.entered.wait(JOIN_S)
    replay, replay_result = _in_thread(lambda: rig.engine.apply("retry", {}, "same"))
    replay.join(0.05)
    assert replay.is_alive()  # blocked on the first run, not rejected
    hang.release()
    first.join(JOIN_S)
    replay.join(JOIN_S)
    assert first_result == replay_result and first_result[0].success
    assert rig.backend.names().count("reset_device") == 1


def test_a_storm_of_faults_and_commands_keeps_the_fsm_consistent() -> None:
    rig = make_rig(AutoRecovery(max_attempts=50, retry_during_recovery=True))
    barrier = threading.Barrier(4)

    def faults() -> None:
        barrier.wait()
        for _ in range(200):
            rig.engine.report_fault(transient(rank=1))

    def commands(name: str) -> None:
        barrier.wait()
        for i in range(200):
            rig.engine.apply("retry", {}, f"{name}-{i}")

    def polls() -> None:
        barrier.wait()
        for _ in range(200):
            rig.engine.poll()

    workers = [
        threading.Thread(target=faults),
        threading.Thread(target=commands, args=("a",)),
        threading.Thread(target=commands, args=("b",)),
        threading.Thread(target=polls),
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(JOIN_S * 3)
    assert not any(worker.is_alive() for worker in workers)
    previous = Phase.RUNNING
    for change in rig.changes:
        assert change.source is previous and change.dest in successors(change.source)
        previous = change.dest
    assert rig.engine.phase is previous


def test_no_recovery_starts_while_an_interrupted_action_still_runs() -> None:
    # A tolerated fault re-quarantines while reset_device hangs in the poller's run: neither
    # a due retry nor a command may drive the backend beside that call.
    rig = make_rig(AutoRecovery(retry_during_recovery=True))
    rig.engine.report_fault(transient())
    hang = rig.backend.hang_on("reset_device", timeout=JOIN_S)
    poller = threading.Thread(target=rig.engine.poll, daemon=True)
    poller.start()
    assert hang.entered.wait(JOIN_S)
    rig.engine.report_fault(transient())
    rig.engine.poll()
    rejected = rig.engine.apply("retry", {}, "early")
    assert rig.backend.names() == ["quarantine", "reset_device", "quarantine"]
    assert not rejected.success
    assert "still finishing reset_device" in (rejected.reason or "")
    assert rig.engine.phase is Phase.QUARANTINED
    hang.release()
    poller.join(JOIN_S)
    assert not poller.is_alive()
    assert rig.poll_after(0.0) is Phase.HEALTHY  # the deferred retry runs now
    assert rig.backend.names()[3:] == ["reset_device", "rebuild_groups", "run_dummy_batch"]
