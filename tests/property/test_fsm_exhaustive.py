"""Exhaustive exploration of the live FSM: every trigger (with each guard verdict) from every
phase, along every path of depth 6 from ``running`` (a member) and from ``loading`` (a
returning rank)."""

from __future__ import annotations

import pytest

from ftengine.errors import TransitionError
from ftengine.faults import Phase
from ftengine.fsm import INITIAL, REJOIN_INITIAL, TABLE, RecoveryFSM, Row, Trigger, successors

DEPTH = 6
MOVES = [(trigger, continues) for trigger in Trigger for continues in (False, True)]


def _step(phase: Phase, trigger: Trigger, continues: bool) -> Phase | None:
    """Fire one move on a fresh machine standing in ``phase``; None when refused."""
    fsm = RecoveryFSM(phase)
    try:
        return fsm.fire(trigger, continues=continues)
    except TransitionError:
        assert fsm.phase is phase, "a refused trigger must not move the machine"
        return None


def _observed() -> dict[Phase, dict[tuple[Trigger, bool], Phase]]:
    graph: dict[Phase, dict[tuple[Trigger, bool], Phase]] = {}
    for phase in Phase:
        moves = {(t, c): _step(phase, t, c) for t, c in MOVES}
        graph[phase] = {move: dest for move, dest in moves.items() if dest is not None}
    return graph


GRAPH = _observed()


def test_the_machine_does_exactly_what_the_table_says() -> None:
    seen = {(t, source, dest) for source, moves in GRAPH.items() for (t, _), dest in moves.items()}
    assert seen == {(row.trigger, row.source, row.dest) for row in TABLE}
    for phase in Phase:
        assert {dest for dest in GRAPH[phase].values()} == successors(phase)


def _replay(path: tuple[tuple[Trigger, bool], ...], start: Phase = INITIAL) -> RecoveryFSM:
    fsm = RecoveryFSM(start)
    for trigger, continues in path:
        fsm.fire(trigger, continues=continues)
    return fsm


def _walk(start: Phase) -> tuple[set[Phase], int]:
    """Each path is replayed on a fresh live machine from ``start``, then every move is
    tried at its end; the walk follows every move that fires. Returns (reached, ends)."""
    allowed = {(row.source, row.dest) for row in TABLE}
    reached, ends = {start}, 0
    stack: list[tuple[tuple[Trigger, bool], ...]] = [()]
    while stack:
        path = stack.pop()
        phase = _replay(path, start).phase
        if len(path) == DEPTH:
            ends += 1
            continue
        fired = 0
        for trigger, continues in MOVES:
            fsm = _replay(path, start)
            try:
                dest = fsm.fire(trigger, continues=continues)
            except TransitionError:
                assert fsm.phase is phase, "a refused trigger must not move the machine"
                continue
            assert (phase, dest) in allowed
            reached.add(dest)
            stack.append((*path, (trigger, continues)))
            fired += 1
        if not fired:
            assert phase is Phase.DEAD, f"{phase.value} is a dead end"
            ends += 1
    return reached, ends


def test_every_move_along_every_path_of_depth_six_stays_inside_the_table() -> None:
    reached, ends = _walk(INITIAL)
    # A member never becomes a returning rank: those phases start only in a new process.
    assert reached == set(Phase) - {Phase.LOADING, Phase.READY, Phase.JOINING}
    assert ends > 1000  # the walk really branched: every (trigger, verdict) was followed


@pytest.mark.timeout(60)
def test_every_path_of_a_returning_rank_stays_inside_the_table() -> None:
    reached, ends = _walk(REJOIN_INITIAL)
    # Admitted, a returning rank is a member like any other: it reaches every member phase.
    assert reached == set(Phase) - {Phase.RUNNING}
    assert ends > 100


def test_only_dead_is_a_dead_end_and_it_absorbs() -> None:
    for phase in Phase:
        assert bool(GRAPH[phase]) == (phase is not Phase.DEAD)


def test_every_phase_can_still_end_an_episode() -> None:
    def reachable(start: Phase) -> set[Phase]:
        seen, todo = {start}, [start]
        while todo:
            for dest in GRAPH[todo.pop()].values():
                if dest not in seen:
                    seen.add(dest)
                    todo.append(dest)
        return seen

    for phase in Phase:
        if phase is not Phase.DEAD:
            assert Phase.DEAD in reachable(phase)
        if phase not in (Phase.DEAD, Phase.RUNNING):
            assert Phase.HEALTHY in reachable(phase)


def test_a_failed_admission_can_be_retried_never_dead_at_once() -> None:
    # Survivors: a fault in scaling_up quarantines (retry / scale_down / scale_up again).
    assert GRAPH[Phase.SCALING_UP][(Trigger.FAULT, False)] is Phase.QUARANTINED
    assert GRAPH[Phase.SCALING_UP][(Trigger.FAULT, True)] is Phase.QUARANTINED
    # The returning rank goes back to ready, still loaded, and may be admitted again.
    assert GRAPH[Phase.JOINING][(Trigger.FAULT, False)] is Phase.READY
    assert GRAPH[Phase.READY][(Trigger.SCALE_UP, False)] is Phase.JOINING
    # scale_up leaves healthy (and only healthy) among the member phases.
    members = {p for p in Phase if p.member or p.health.name == "UNHEALTHY"} - {
        Phase.LOADING,
        Phase.READY,
        Phase.JOINING,
    }
    assert {p for p in members if (Trigger.SCALE_UP, False) in GRAPH[p]} == {Phase.HEALTHY}


def test_fault_verdicts_are_exclusive_and_complete_while_unhealthy() -> None:
    for phase in (Phase.QUARANTINED, Phase.RETRYING, Phase.SCALING_DOWN):
        assert GRAPH[phase][(Trigger.FAULT, True)] is Phase.QUARANTINED
        assert GRAPH[phase][(Trigger.FAULT, False)] is Phase.DEAD
    rows = [r for r in TABLE if r.trigger is Trigger.FAULT and r.guard]
    assert all(isinstance(r, Row) and r.source is not Phase.RUNNING for r in rows)
