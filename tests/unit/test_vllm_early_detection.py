"""The agent's early word on a SIGKILLed worker: its engine publishes ``dead`` as soon as the
worker's process is a zombie (before the kernel closes its sockets), and a survivor reports
``unhealthy`` as soon as it reads that, ahead of vLLM's own ``on_fault``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from ftengine.integrations.vllm.engine_core import worker_exit
from ftengine.integrations.vllm.engine_core.dp_board import KEY
from ftengine.integrations.vllm.engine_core.worker_exit import worker_dying
from tests.unit.test_vllm_engine_agent import Sentinel, Status, agent_for, markers


class PushingSentinel(Sentinel):
    """The stand-in with vLLM's ``_push_status()`` (no arguments), recording each push as
    the agent's fields would be pushed."""

    def __init__(self, rank: int = 0) -> None:
        super().__init__(rank=rank)
        self.pushed: list[dict[str, object]] = []
        self.agent: Any = None
        self.engine_index = rank  # vLLM's attributes
        self.parallel_config = self.engine.vllm_config.parallel_config

    def _push_status(self) -> None:
        self.pushed.append(self.agent.status_fields())


def executor(*pids: int, shutting_down: bool = False) -> SimpleNamespace:
    workers = [SimpleNamespace(proc=SimpleNamespace(pid=pid)) for pid in pids]
    return SimpleNamespace(workers=workers, shutting_down=shutting_down, is_failed=False)


@pytest.fixture
def zombie() -> Any:
    """A child that has exited and that nobody has reaped yet."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.01)
    yield child.pid
    child.wait()


def command_waits_for_on_fault(agent: Any) -> None:
    """A command on vLLM's input thread waits until vLLM's on_fault ran and the patched
    on_fault pushed its last status, then goes on."""
    waiter = threading.Thread(target=agent.await_fault)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "the command did not wait for on_fault"
    agent.fault_handled()
    waiter.join(0.3)
    assert waiter.is_alive(), "released before the patched on_fault's last status push"
    agent.release_commands()
    waiter.join(5.0)
    assert not waiter.is_alive()


def test_a_zombie_or_vanished_worker_is_dying_a_live_one_is_not(zombie: int) -> None:
    assert worker_dying(executor(zombie))
    assert not worker_dying(executor(os.getpid()))
    assert not worker_dying(executor(zombie, shutting_down=True))  # stopping on purpose
    assert not worker_dying(SimpleNamespace())  # an executor without worker processes
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: no such process any more
    assert worker_dying(executor(gone.pid))


def test_a_leader_that_has_begun_to_exit_counts_as_dying(monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader thread that unmaps a big process's memory is no zombie yet, but carries
    PF_EXITING from the start of its exit."""
    running = ["R", "1", "1", "1", "0", "-1", str(0x400000)]
    monkeypatch.setattr(worker_exit, "_proc_stat", lambda pid: running)
    assert not worker_exit.exiting(1)
    running[6] = str(0x400000 | worker_exit.PF_EXITING)
    assert worker_exit.exiting(1)


def test_a_worker_holding_a_sigkill_counts_as_dying_before_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``kill -9`` marks SIGKILL pending on the leader at once; a loaded machine may not run
    it for a while (no PF_EXITING, no zombie yet)."""
    fields = ["S", "1", "1", "1", "0", "-1", str(0x400000), *["0"] * 21, "0", "0"]
    monkeypatch.setattr(worker_exit, "_proc_stat", lambda pid: fields)
    assert not worker_exit.exiting(1)
    fields[worker_exit.PENDING] = str(worker_exit.SIGKILL_PENDING | 1 << (signal.SIGTERM - 1))
    assert worker_exit.exiting(1)
    fields[worker_exit.PENDING] = str(1 << (signal.SIGTERM - 1))  # catchable: not doomed
    assert not worker_exit.exiting(1)


def test_the_proc_entry_is_kept_open_and_closed_once_the_process_is_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        fields = worker_exit._proc_stat(child.pid)
        assert fields is not None and len(fields) > worker_exit.PENDING
        assert fields[0] in ("R", "S", "D") and child.pid in worker_exit._open
        assert not worker_exit.exiting(child.pid)
    finally:
        child.kill()
        child.wait()  # reaped: its pid may be reused, the descriptor still names it
    assert worker_exit.exiting(child.pid) and child.pid not in worker_exit._open


def test_an_engine_whose_worker_is_dying_publishes_dead_at_once(zombie: int) -> None:
    sentinel = PushingSentinel(rank=1)
    agent = agent_for(sentinel)
    sentinel.agent = agent
    sentinel.engine.model_executor = executor(zombie)
    agent._watch_peers()
    assert json.loads(sentinel.engine.dp_store.data[KEY.format(rank=1)])["status"] == "dead"
    assert [p.get("status") for p in sentinel.pushed] == ["dead"]
    agent._watch_peers()
    assert len(sentinel.pushed) == 1  # reported once
    sentinel.engine.dp_store.peer(0, "unhealthy")  # a survivor faulted on our news
    agent._watch_peers()
    assert markers(sentinel) == []  # this engine goes DEAD by vLLM's monitor, not UNHEALTHY
    command_waits_for_on_fault(agent)  # a retry to this engine: vLLM's own DEAD first


def test_an_unhealthy_engine_whose_worker_dies_reports_dead(zombie: int) -> None:
    """The vLLM campaign: a worker SIGKILLed during a retry left its engine ``unhealthy``
    (vLLM marks DEAD only at the busy loop's next fault, and a recovering engine is parked),
    so the orchestrator retried it forever instead of scaling it down."""
    sentinel = PushingSentinel(rank=1)
    agent = agent_for(sentinel)
    sentinel.agent = agent
    sentinel.status_type = Status.UNHEALTHY
    assert "status" not in agent.status_fields()  # recovering, its worker alive: vLLM's
    sentinel.engine.model_executor = executor(zombie)
    agent._watch_peers()
    (pushed,) = sentinel.pushed
    assert pushed["status"] == "dead" and "worker process died" in str(pushed["fault_info"])


def test_a_survivor_reports_unhealthy_before_vllms_on_fault_runs() -> None:
    sentinel = PushingSentinel()
    agent = agent_for(sentinel)
    sentinel.agent = agent
    sentinel.engine.dp_store.peer(1, "dead")
    agent._watch_peers()
    assert len(markers(sentinel)) == 1  # vLLM's own fault path still runs
    (early,) = sentinel.pushed
    assert (early["status"], early["fault_info"]) == ("unhealthy", "PeerDead")
    agent.fault_handled()  # vLLM's on_fault ran: its own status says it from now on
    assert "status" not in agent.status_fields()


def test_a_command_after_the_early_report_waits_for_vllms_on_fault() -> None:
    sentinel = PushingSentinel()
    agent = agent_for(sentinel)
    sentinel.agent = agent
    sentinel.engine.dp_store.peer(1, "dead")
    agent._watch_peers()
    command_waits_for_on_fault(agent)


def test_an_unhealthy_peer_gets_no_early_report_and_commands_do_not_wait() -> None:
    sentinel = PushingSentinel()
    agent = agent_for(sentinel)
    sentinel.agent = agent
    sentinel.engine.dp_store.peer(1, "unhealthy")  # alive: a retry may include it
    agent._watch_peers()
    assert len(markers(sentinel)) == 1 and sentinel.pushed == []
    start = time.monotonic()
    agent.await_fault()
    assert time.monotonic() - start < 0.1


def late_death_sentinel(
    monkeypatch: pytest.MonkeyPatch, rank: int = 1
) -> tuple[PushingSentinel, Any, list[str]]:
    """A recovering (UNHEALTHY, parked) engine of a DP=2 deployment; what ``went_dead``
    hands to ``release_dead`` is recorded."""
    from ftengine.integrations.vllm.engine_core import reinference

    released: list[str] = []
    monkeypatch.setattr(reinference, "release_dead", lambda s, why: released.append(why))
    sentinel = PushingSentinel(rank=rank)
    agent = agent_for(sentinel)
    sentinel.agent = agent
    sentinel.status_type = Status.UNHEALTHY
    return sentinel, agent, released


def test_a_worker_that_dies_while_its_engine_recovers_leaves_it_dead_its_requests_handed_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 30's chaos campaign: a worker SIGKILLed during a retry left its engine parked
    UNHEALTHY (vLLM makes DEAD only at the busy loop's next fault), holding two streams until
    its server was restarted under them. Now it goes DEAD as on_fault would: once the
    executor reads failed, its held requests to ``release_dead`` (a survivor), once."""
    sentinel, agent, released = late_death_sentinel(monkeypatch)
    assert agent.settle_late_death() is False and released == []  # its worker lives
    sentinel.engine.model_executor.is_failed = True
    agent.command_started()  # a retry under way on vLLM's input thread: it settles it
    assert agent.settle_late_death() is False and sentinel.status_type == Status.UNHEALTHY
    agent.command_ended()
    assert sentinel.status_type == Status.DEAD
    assert released == ["engine 1's worker process died while the engine was recovering"]
    assert sentinel.fault_info == released[0]
    assert sentinel.pushed[-1]["phase"] == "dead"  # pushed (vLLM puts "status": "dead")
    assert agent.settle_late_death() is False and len(released) == 1  # once


def test_the_agents_tick_settles_a_late_death_but_not_while_on_fault_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sentinel, agent, released = late_death_sentinel(monkeypatch)
    sentinel.engine.model_executor.is_failed = True
    agent.note_fault(RuntimeError("peer died"))  # vLLM's on_fault under way: not ours yet
    agent._tick()
    assert released == [] and sentinel.status_type == Status.UNHEALTHY
    agent.release_commands()
    agent._tick()
    assert sentinel.status_type == Status.DEAD and len(released) == 1


def test_a_healthy_engine_whose_worker_dies_is_left_to_vllms_on_fault(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sentinel, agent, released = late_death_sentinel(monkeypatch)
    sentinel.status_type = Status.HEALTHY  # its busy loop's next step faults: vLLM's DEAD
    sentinel.engine.model_executor.is_failed = True
    assert agent.settle_late_death() is False and released == []
