"""The roster's acts on workers: fence and retire kill only the worker named (once), exits
are filed once with what the exit watch needs, removals are adopted only when every live
engine agrees, and shutdown files every worker as gone."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from ftengine.testbed.cluster.handles import WorkerHandle
from ftengine.testbed.cluster.lifecycle import WorkerState
from ftengine.testbed.cluster.roster import ClusterError, Exit, Roster

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


class Child:
    """A real child process behind the part of ``BaseProcess`` the roster uses."""

    def __init__(self) -> None:
        self.popen = subprocess.Popen(SLEEPER)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()  # negative for a signal, as multiprocessing reports it

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return


class Pipe:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:  # only the processes this test started
        if child.is_alive():
            child.popen.kill()
        child.popen.wait(10)


def roster_of(children: list[Child], size: int) -> Roster:
    """A roster of ``size`` serving workers, each a real sleeping child process."""
    roster = Roster()
    for rank in range(size):
        child = Child()
        children.append(child)
        process: Any = child
        worker = WorkerHandle(rank, process, Pipe())  # type: ignore[arg-type]
        worker.mark_ready(child.pid)
        roster.add(worker)
    return roster


def kinds(roster: Roster) -> list[tuple[str, int | None]]:
    return [(event.kind, event.rank) for event in roster.events()]


def test_a_hung_worker_is_fenced_once_and_its_exit_names_the_survivors(
    children: list[Child],
) -> None:
    roster = roster_of(children, 3)
    roster.fence(1, "hung: no heartbeat for 2.10s")
    roster.fence(1, "hung: no reply to step 4")  # already fenced: no second kill, no event
    hung = roster.worker(1)
    exit_ = roster.file_exit(hung)
    assert exit_ == Exit(
        "killed by SIGKILL (fenced: hung: no heartbeat for 2.10s)",
        fenced=True,
        expected=False,
        survivors=(roster.worker(0), roster.worker(2)),
    )
    assert roster.file_exit(hung) is None  # filed once
    assert kinds(roster) == [("fence", 1), ("exit", 1)]
    assert [c.is_alive() for c in children] == [True, False, True]


def test_a_retired_worker_exits_as_expected(children: list[Child]) -> None:
    roster = roster_of(children, 2)
    roster.retire(0, "removed by scale_down s1")
    worker = roster.worker(0)
    assert (worker.state, worker.exit_info) == (
        WorkerState.EXITED,
        "killed by SIGKILL (fenced: removed by scale_down s1)",
    )
    assert kinds(roster) == [("fence", 0), ("exit", 0)]
    roster.retire(0, "removed by scale_down s2")  # gone already: nothing happens
    assert kinds(roster) == [("fence", 0), ("exit", 0)] and children[1].is_alive()


def test_an_exit_after_shutdown_began_is_expected(children: list[Child]) -> None:
    roster = roster_of(children, 2)
    roster.stopping.set()
    children[0].popen.kill()
    exit_ = roster.file_exit(roster.worker(0))
    assert exit_ is not None and exit_.expected and not exit_.fenced
    assert exit_.info == "killed by SIGKILL" and exit_.survivors == (roster.worker(1),)


def status(removed: list[int]) -> dict[str, Any]:
    return {"id": 0, "status": 0, "phase": "healthy", "removed_ranks": removed}


def test_removals_are_adopted_only_when_every_live_engine_agrees() -> None:
    roster = Roster()
    for rank in range(3):
        process: Any = SimpleNamespace(pid=None)
        roster.add(WorkerHandle(rank, process, conn=None))  # type: ignore[arg-type]
    gone, first, second = roster.workers()[2], *roster.workers()[:2]
    gone.exited("killed by SIGKILL")
    first.report(status([2]))
    second.report(status([]))
    roster.adopt_removals()
    assert not gone.removed and roster.events() == []
    second.report(status([2]))
    roster.adopt_removals()
    roster.adopt_removals()  # once removed, not again
    assert gone.removed and kinds(roster) == [("removed", 2)]


def test_ranks_are_checked_and_enrolled_in_order() -> None:
    roster = Roster()
    process: Any = SimpleNamespace(pid=None)
    with pytest.raises(ClusterError, match="expected rank 0, found 1"):
        roster.add(WorkerHandle(1, process, conn=None))  # type: ignore[arg-type]
    roster.add(WorkerHandle(0, process, conn=None))  # type: ignore[arg-type]
    with pytest.raises(ClusterError, match=r"rank must be in \[0, 1\), found 4"):
        roster.worker(4)


def test_shutdown_files_every_worker_as_gone_and_closes_its_pipe() -> None:
    roster = Roster()
    pipes = [Pipe(), Pipe()]
    for rank, pipe in enumerate(pipes):
        process: Any = SimpleNamespace(pid=None)
        roster.add(WorkerHandle(rank, process, pipe))  # type: ignore[arg-type]
    roster.worker(1).exited("exited with code 0")
    roster.file_shutdown()
    assert [w.state for w in roster.workers()] == [WorkerState.EXITED] * 2
    assert [w.exit_info for w in roster.workers()] == [None, "exited with code 0"]
    assert all(pipe.closed for pipe in pipes)
