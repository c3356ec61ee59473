"""A cluster worker's lifecycle as the supervisor sees it: the one table of its states and of
the events that move them (ready, fenced, retired, exited, removed).

Every change of a ``WorkerHandle``'s state is a row of ``TABLE``; ``next_state`` is the only
way to move one, and a pair the table has no row for is a supervisor bug, refused loudly.
The table has no guards and no callbacks, so a dict over its rows is the whole machine
(``ftengine.fsm`` needs ``transitions`` for its guards and diagram; this one does not).
"""

from __future__ import annotations

import enum

import attrs

from ftengine.errors import TransitionError


class WorkerState(str, enum.Enum):
    """Where one worker process is, from spawn to being scaled away."""

    STARTING = "starting"  # spawned; loading and joining, no Ready yet
    SERVING = "serving"  # reported Ready: takes part in steps and commands
    FENCED = "fenced"  # SIGKILL sent because it hung: its exit is a (hung) peer fault
    RETIRING = "retiring"  # SIGKILL sent for a scale-down: its exit is expected, not news
    EXITED = "exited"  # the process is gone (its engine reads DEAD), not scaled away yet
    REMOVED = "removed"  # gone and scaled away by a successful scale-down (terminal)

    @property
    def alive(self) -> bool:
        """The process may still run: the rank takes part in steps and commands."""
        return self not in GONE

    @property
    def fenced(self) -> bool:
        """The supervisor sent it SIGKILL on purpose (and waits for its exit)."""
        return self in FENCED_STATES


class WorkerEvent(str, enum.Enum):
    """What happens to a worker, as the supervisor files it."""

    READY = "ready"  # the worker reported Ready (slots loaded, group joined)
    FENCE = "fence"  # the supervisor kills it as hung
    RETIRE = "retire"  # the supervisor kills it because a scale-down removes it
    EXIT = "exit"  # its process ended (seen by the exit watch, a retire or shutdown)
    REMOVE = "remove"  # every live engine scaled it away


GONE = frozenset({WorkerState.EXITED, WorkerState.REMOVED})
FENCED_STATES = frozenset({WorkerState.FENCED, WorkerState.RETIRING})


@attrs.frozen
class Row:
    """One transition: ``event`` moves a worker in ``source`` to ``dest``."""

    event: WorkerEvent
    source: WorkerState
    dest: WorkerState


_ST, _SV, _F, _RT, _X, _RM = (
    WorkerState.STARTING,
    WorkerState.SERVING,
    WorkerState.FENCED,
    WorkerState.RETIRING,
    WorkerState.EXITED,
    WorkerState.REMOVED,
)
_READY, _FENCE, _RETIRE, _EXIT, _REMOVE = (
    WorkerEvent.READY,
    WorkerEvent.FENCE,
    WorkerEvent.RETIRE,
    WorkerEvent.EXIT,
    WorkerEvent.REMOVE,
)

# Rows that loop on a state are events the supervisor files legitimately but that change
# nothing (news about a process that is already fenced or gone). Missing on purpose:
# fencing or retiring a worker before its Ready (a slow start is the start timeout's
# business, and no command or step reaches a rank that never served), and removing a
# worker whose process may still run (a scale-down retires it, and waits for its exit,
# first).
TABLE: tuple[Row, ...] = (
    Row(_READY, _ST, _SV),
    Row(_READY, _X, _X),  # its reader filed the Ready after the exit watch saw the end
    Row(_FENCE, _SV, _F),
    Row(_FENCE, _F, _F),
    Row(_FENCE, _RT, _RT),
    Row(_FENCE, _X, _X),
    Row(_FENCE, _RM, _RM),
    Row(_RETIRE, _SV, _RT),
    Row(_RETIRE, _F, _RT),  # hung, then named by a scale-down: its exit is no longer news
    Row(_RETIRE, _X, _X),
    Row(_RETIRE, _RM, _RM),
    Row(_EXIT, _ST, _X),
    Row(_EXIT, _SV, _X),
    Row(_EXIT, _F, _X),
    Row(_EXIT, _RT, _X),
    Row(_EXIT, _X, _X),
    Row(_EXIT, _RM, _RM),
    Row(_REMOVE, _X, _RM),
    Row(_REMOVE, _RM, _RM),  # a later scale-down names it again
)

INITIAL = WorkerState.STARTING

_NEXT: dict[tuple[WorkerState, WorkerEvent], WorkerState] = {
    (row.source, row.event): row.dest for row in TABLE
}


def events_from(state: WorkerState) -> frozenset[WorkerEvent]:
    """The events that have a row from ``state``."""
    return frozenset(row.event for row in TABLE if row.source is state)


def next_state(state: WorkerState, event: WorkerEvent, *, rank: int | None = None) -> WorkerState:
    """The state ``event`` moves a worker in ``state`` to (``rank`` only names it in errors).

    Raises ``TransitionError`` when ``TABLE`` has no row for the pair.
    """
    dest = _NEXT.get((state, event))
    if dest is None:
        who = "a worker" if rank is None else f"worker {rank}"
        raise TransitionError(
            f"event {event.value!r} is not allowed for {who} in state {state.value!r}; "
            f"allowed there: {sorted(e.value for e in events_from(state))}"
        )
    return dest
