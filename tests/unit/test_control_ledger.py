"""The command ledger: one command at a time, replays answered from the record."""

from __future__ import annotations

import pytest

from ftengine.errors import BackendError
from ftengine.testbed.control.ledger import CommandConflict, CommandLedger
from ftengine.testbed.control.messages import Command, FaultToleranceResult
from tests.unit.control_standin import Jobs


class Recorder:
    def __init__(self, fail: Exception | None = None) -> None:
        self.executed: list[Command] = []
        self.done: list[tuple[Command, FaultToleranceResult]] = []
        self.fail = fail

    def __call__(self, command: Command) -> FaultToleranceResult:
        self.executed.append(command)
        if self.fail is not None:
            raise self.fail
        return FaultToleranceResult(request_id=command.request_id, success=True)


def _ledger(execute: Recorder, jobs: Jobs, capacity: int = 1024) -> CommandLedger:
    return CommandLedger(
        execute,
        spawn=jobs,
        capacity=capacity,
        on_done=lambda c, r: execute.done.append((c, r)),
    )


RETRY = Command("retry", "r1")
SCALE = Command("scale_down", "s1", (3,))


def test_submit_runs_in_background_and_records_the_result() -> None:
    jobs, execute = Jobs(), Recorder()
    ledger = _ledger(execute, jobs)
    first = ledger.submit(RETRY)
    assert not first.done and not first.replayed
    assert ledger.running == "r1" and execute.executed == []
    assert [name for name, _ in jobs.queue] == ["ftengine-apply-r1"]
    jobs.run_all()
    assert execute.executed == [RETRY]
    assert ledger.running is None
    recorded = ledger.lookup("r1")
    assert recorded is not None and recorded.result is not None and recorded.result.success
    assert execute.done == [(RETRY, recorded.result)]


def test_replay_returns_the_record_without_a_second_action() -> None:
    jobs, execute = Jobs(), Recorder()
    ledger = _ledger(execute, jobs)
    ledger.submit(RETRY)
    while_running = ledger.submit(RETRY)
    assert while_running.replayed and not while_running.done
    jobs.run_all()
    after = ledger.submit(RETRY)
    assert after.replayed and after.done
    assert execute.executed == [RETRY]
    assert jobs.queue == []


def test_reused_request_id_with_another_command_is_a_conflict() -> None:
    jobs, execute = Jobs(), Recorder()
    ledger = _ledger(execute, jobs)
    ledger.submit(RETRY)
    jobs.run_all()
    with pytest.raises(CommandConflict, match="already used for retry"):
        ledger.submit(Command("scale_down", "r1", (3,)))
    assert execute.executed == [RETRY]


def test_second_command_while_one_runs_is_refused_and_not_started() -> None:
    jobs, execute = Jobs(), Recorder()
    ledger = _ledger(execute, jobs)
    ledger.submit(RETRY)
    with pytest.raises(CommandConflict, match="'r1' is still running"):
        ledger.submit(SCALE)
    assert ledger.lookup("s1") is None
    jobs.run_all()
    assert execute.executed == [RETRY]
    ledger.submit(SCALE)
    jobs.run_all()
    assert execute.executed == [RETRY, SCALE]


def test_an_ftengine_error_becomes_a_failed_result() -> None:
    jobs, execute = Jobs(), Recorder(fail=BackendError("rebuild failed"))
    ledger = _ledger(execute, jobs)
    ledger.submit(SCALE)
    jobs.run_all()
    recorded = ledger.lookup("s1")
    assert recorded is not None and recorded.result is not None
    assert not recorded.result.success
    assert recorded.result.reason == "BackendError: rebuild failed"
    assert ledger.running is None


def test_an_unexpected_error_is_recorded_and_still_raised() -> None:
    jobs, execute = Jobs(), Recorder(fail=ZeroDivisionError("bug"))
    ledger = _ledger(execute, jobs)
    ledger.submit(SCALE)
    with pytest.raises(ZeroDivisionError):
        jobs.run_all()
    recorded = ledger.lookup("s1")
    assert recorded is not None and recorded.result is not None
    assert not recorded.result.success and "unexpected error" in (recorded.result.reason or "")
    assert ledger.running is None


def test_capacity_forgets_the_oldest_finished_commands() -> None:
    jobs, execute = Jobs(), Recorder()
    ledger = _ledger(execute, jobs, capacity=2)
    for index in range(3):
        ledger.submit(Command("retry", f"r{index}"))
        jobs.run_all()
    assert ledger.lookup("r0") is None
    assert ledger.lookup("r1") is not None and ledger.lookup("r2") is not None


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        CommandLedger(Recorder(), capacity=0)
