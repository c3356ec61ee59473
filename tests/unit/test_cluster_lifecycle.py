"""The worker lifecycle table: every row, every pair it refuses, and the WorkerHandle intent
methods that move a worker through it (kill due once, exit news once, removal only when gone)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ftengine.errors import TransitionError
from ftengine.testbed.cluster.handles import WorkerHandle
from ftengine.testbed.cluster.lifecycle import (
    GONE,
    INITIAL,
    TABLE,
    Row,
    WorkerEvent,
    WorkerState,
    events_from,
    next_state,
)

S = WorkerState
E = WorkerEvent
PAIRS = {(row.source, row.event) for row in TABLE}
REFUSED = [(state, event) for state in S for event in E if (state, event) not in PAIRS]

# What the cluster needs the table to say, written out on its own so that an edited row shows.
EXPECTED = {
    (S.STARTING, E.READY): S.SERVING,
    (S.EXITED, E.READY): S.EXITED,
    (S.SERVING, E.FENCE): S.FENCED,
    (S.FENCED, E.FENCE): S.FENCED,
    (S.RETIRING, E.FENCE): S.RETIRING,
    (S.EXITED, E.FENCE): S.EXITED,
    (S.REMOVED, E.FENCE): S.REMOVED,
    (S.SERVING, E.RETIRE): S.RETIRING,
    (S.FENCED, E.RETIRE): S.RETIRING,
    (S.EXITED, E.RETIRE): S.EXITED,
    (S.REMOVED, E.RETIRE): S.REMOVED,
    (S.STARTING, E.EXIT): S.EXITED,
    (S.SERVING, E.EXIT): S.EXITED,
    (S.FENCED, E.EXIT): S.EXITED,
    (S.RETIRING, E.EXIT): S.EXITED,
    (S.EXITED, E.EXIT): S.EXITED,
    (S.REMOVED, E.EXIT): S.REMOVED,
    (S.EXITED, E.REMOVE): S.REMOVED,
    (S.REMOVED, E.REMOVE): S.REMOVED,
}


def test_the_table_is_what_the_cluster_needs_one_row_per_pair() -> None:
    assert len(PAIRS) == len(TABLE), "two rows for one (state, event) pair"
    assert {(row.source, row.event): row.dest for row in TABLE} == EXPECTED


@pytest.mark.parametrize("row", TABLE, ids=lambda r: f"{r.source.value}-{r.event.value}")
def test_every_row_moves_as_written(row: Row) -> None:
    assert next_state(row.source, row.event) is row.dest
    assert row.event in events_from(row.source)


@pytest.mark.parametrize("pair", REFUSED, ids=lambda p: f"{p[0].value}-{p[1].value}")
def test_every_pair_without_a_row_is_refused_naming_it(pair: tuple[S, E]) -> None:
    state, event = pair
    with pytest.raises(TransitionError) as caught:
        next_state(state, event, rank=3)
    text = str(caught.value)
    assert f"{event.value!r}" in text and f"{state.value!r}" in text and "worker 3" in text
    assert str(sorted(e.value for e in events_from(state))) in text


def test_the_refusals_are_the_ones_meant() -> None:
    # Killing a worker that never served, removing one that may still run, a second Ready.
    assert (S.STARTING, E.FENCE) in REFUSED and (S.STARTING, E.RETIRE) in REFUSED
    assert all((state, E.REMOVE) in REFUSED for state in S if state.alive)
    assert all((state, E.READY) in REFUSED for state in (S.SERVING, S.FENCED, S.RETIRING))


def test_gone_states_never_come_back_and_removed_is_terminal() -> None:
    for row in TABLE:
        if row.source in GONE:
            assert row.dest in GONE
        if row.source is S.REMOVED:
            assert row.dest is S.REMOVED
    assert INITIAL is S.STARTING and INITIAL.alive and not INITIAL.fenced
    assert {s for s in S if s.fenced} == {S.FENCED, S.RETIRING}
    assert {s for s in S if not s.alive} == {S.EXITED, S.REMOVED}


def test_every_state_is_reached_from_the_initial_one() -> None:
    reached, frontier = {INITIAL}, [INITIAL]
    while frontier:
        state = frontier.pop()
        for row in TABLE:
            if row.source is state and row.dest not in reached:
                reached.add(row.dest)
                frontier.append(row.dest)
    assert reached == set(S)


def handle(rank: int = 2) -> WorkerHandle:
    process: Any = SimpleNamespace(pid=None)
    return WorkerHandle(rank, process, conn=None)  # type: ignore[arg-type]


def test_a_hung_worker_is_killed_once_and_its_exit_is_news_once() -> None:
    worker = handle()
    worker.mark_ready(4242)
    assert (worker.state, worker.pid, worker.alive) == (S.SERVING, 4242, True)
    assert worker.fence("hung: no heartbeat") is True
    assert worker.fence("hung: no reply to step 3") is False  # the kill already went out
    assert worker.retire("removed by scale_down s1") is False  # and it is no longer news
    assert (worker.state, worker.fenced_for) == (S.RETIRING, "hung: no heartbeat")
    assert worker.exited("killed by SIGKILL") is S.RETIRING
    assert worker.exited("again") is S.EXITED  # already filed: the caller sees no news
    assert (worker.alive, worker.removed, worker.exit_info) == (False, False, "killed by SIGKILL")
    assert worker.remove() is True and worker.remove() is False
    assert (worker.state, worker.removed, worker.alive) == (S.REMOVED, True, False)


def test_a_serving_worker_is_retired_with_one_kill() -> None:
    worker = handle()
    worker.mark_ready(1)
    assert worker.retire("removed by scale_down s1") is True
    assert (worker.state, worker.fenced_for) == (S.RETIRING, "removed by scale_down s1")


def test_illegal_moves_raise_and_leave_the_handle_as_it_was() -> None:
    worker = handle(rank=5)
    with pytest.raises(TransitionError, match="worker 5 in state 'starting'"):
        worker.fence("hung")
    assert (worker.state, worker.fenced_for) == (S.STARTING, None)
    worker.mark_ready(9)
    with pytest.raises(TransitionError, match="'remove' is not allowed"):
        worker.remove()
    with pytest.raises(TransitionError, match="'ready' is not allowed"):
        worker.mark_ready(10)
    assert (worker.state, worker.pid) == (S.SERVING, 9)


def test_a_ready_filed_after_the_exit_keeps_the_worker_gone() -> None:
    worker = handle()
    worker.exited("exited with code 1")
    worker.mark_ready(77)
    assert (worker.state, worker.alive, worker.pid) == (S.EXITED, False, 77)
