"""The recovery state machine: the one transition table and its renderings.

Every phase change in ftengine is a row of ``TABLE``; ``RecoveryFSM`` fires those rows
through the ``transitions`` library and nothing else changes the phase.
"""

from __future__ import annotations

import enum
import re

import attrs
from transitions import Machine, MachineError
from transitions.extensions.diagrams import GraphMachine

from ftengine.errors import TransitionError
from ftengine.faults import Phase


class Trigger(str, enum.Enum):
    """The events that move the FSM."""

    FAULT = "fault"  # a fault was reported (guard: the policy's verdict while unhealthy)
    RETRY = "retry"  # start a retry recovery (command or policy)
    SCALE_DOWN = "scale_down"  # start a scale-down recovery (command or policy)
    RECOVERED = "recovered"  # every recovery step succeeded
    GIVE_UP = "give_up"  # the policy gave up or the orchestrator deadline passed
    SCALE_UP = "scale_up"  # admit removed ranks (command or policy; on the returning rank too)
    LOADED = "loaded"  # a returning rank loaded its weights and learnt the deployment's state


def policy_continues(*, continues: bool = False, **_: object) -> bool:
    """Guard: the policy chose to keep recovering (any decision but GiveUp)."""
    return continues


def policy_gives_up(*, continues: bool = False, **_: object) -> bool:
    """Guard: the policy gave up, so the engine is terminally dead."""
    return not continues


GUARDS = {guard.__name__: guard for guard in (policy_continues, policy_gives_up)}


@attrs.frozen
class Row:
    """One transition: ``trigger`` moves ``source`` to ``dest`` when ``guard`` holds."""

    trigger: Trigger
    source: Phase
    dest: Phase
    guard: str | None = None


_R, _Q, _T, _S, _H, _D = (
    Phase.RUNNING,
    Phase.QUARANTINED,
    Phase.RETRYING,
    Phase.SCALING_DOWN,
    Phase.HEALTHY,
    Phase.DEAD,
)
_U, _L, _Y, _J = Phase.SCALING_UP, Phase.LOADING, Phase.READY, Phase.JOINING

# Rows of one trigger and source are tried in order; the guards of a trigger's rows from
# one source are mutually exclusive, so the order never matters for the outcome.
TABLE: tuple[Row, ...] = (
    Row(Trigger.FAULT, _R, _Q),
    Row(Trigger.FAULT, _H, _Q),
    Row(Trigger.FAULT, _Q, _Q, "policy_continues"),
    Row(Trigger.FAULT, _Q, _D, "policy_gives_up"),
    Row(Trigger.FAULT, _T, _Q, "policy_continues"),
    Row(Trigger.FAULT, _T, _D, "policy_gives_up"),
    Row(Trigger.FAULT, _S, _Q, "policy_continues"),
    Row(Trigger.FAULT, _S, _D, "policy_gives_up"),
    Row(Trigger.RETRY, _Q, _T),
    Row(Trigger.SCALE_DOWN, _Q, _S),
    Row(Trigger.RECOVERED, _T, _H),
    Row(Trigger.RECOVERED, _S, _H),
    Row(Trigger.GIVE_UP, _Q, _D),
    # Admission on the survivors: healthy -> scaling_up -> healthy. A fault (or a failed
    # step) in scaling_up is a fault of a member: quarantined, where a retry or a scale-down
    # can be run and the scale-up sent again, never straight to dead.
    Row(Trigger.SCALE_UP, _H, _U),
    Row(Trigger.RECOVERED, _U, _H),
    Row(Trigger.FAULT, _U, _Q),
    # The returning rank: loading -> ready -> joining -> healthy. A failed admission sends
    # it back to ready (still loaded; it may be admitted again); a fault before that ends it.
    Row(Trigger.LOADED, _L, _Y),
    Row(Trigger.SCALE_UP, _Y, _J),
    Row(Trigger.RECOVERED, _J, _H),
    Row(Trigger.FAULT, _J, _Y),
    Row(Trigger.FAULT, _L, _D),
    Row(Trigger.FAULT, _Y, _D),
)

INITIAL = Phase.RUNNING
REJOIN_INITIAL = Phase.LOADING
"""Where a returning rank's engine starts (``RecoveryEngine(..., rejoining=True)``)."""
TERMINAL = frozenset({Phase.DEAD})


def successors(phase: Phase) -> frozenset[Phase]:
    """Every phase one row of the table can move ``phase`` to (itself included if a row loops)."""
    return frozenset(row.dest for row in TABLE if row.source is phase)


def triggers_from(phase: Phase) -> frozenset[Trigger]:
    """The triggers that have at least one row from ``phase``."""
    return frozenset(row.trigger for row in TABLE if row.source is phase)


def _machine_transitions() -> list[dict[str, object]]:
    return [
        {
            "trigger": row.trigger.value,
            "source": row.source,
            "dest": row.dest,
            "conditions": [GUARDS[row.guard]] if row.guard else [],
        }
        for row in TABLE
    ]


class _Model:
    """The object whose ``state`` attribute the ``transitions`` machine drives."""

    state: Phase


class RecoveryFSM:
    """The live state machine built from ``TABLE``. Not thread-safe: the engine locks it."""

    def __init__(self, initial: Phase = INITIAL) -> None:
        self._model = _Model()
        self._machine = Machine(
            model=self._model,
            states=Phase,
            transitions=_machine_transitions(),
            initial=initial,
            auto_transitions=False,
            queued=True,
            send_event=False,
        )

    @property
    def phase(self) -> Phase:
        """The current phase."""
        return self._model.state

    def fire(self, trigger: Trigger, *, continues: bool = False) -> Phase:
        """Fire ``trigger`` and return the new phase.

        ``continues`` is the policy's verdict read by the guards of ``fault`` rows.
        Raises ``TransitionError`` when no row allows ``trigger`` from the current phase.
        """
        source = self.phase
        try:
            fired = self._machine.events[trigger.value].trigger(self._model, continues=continues)
        except MachineError as exc:
            raise TransitionError(
                f"trigger {trigger.value!r} is not allowed from phase {source.value!r}; "
                f"allowed: {sorted(t.value for t in triggers_from(source))}"
            ) from exc
        if not fired:
            raise TransitionError(
                f"no guard of trigger {trigger.value!r} from {source.value!r} held "
                f"(continues={continues}); the table's guards must cover every verdict"
            )
        return self.phase


def render_table() -> str:
    """The transition table as aligned plain text, one row per line, with health per phase."""
    header = ("trigger", "source", "dest", "guard")
    rows = [(r.trigger.value, r.source.value, r.dest.value, r.guard or "-") for r in TABLE]
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in [header, *rows]
    ]
    health = ", ".join(f"{p.value}={p.health.name}" for p in Phase)
    return "\n".join([*lines, "", f"initial: {INITIAL.value}", f"health: {health}"])


def render_mermaid() -> str:
    """The transition table as a mermaid ``stateDiagram-v2`` (drawn in the initial phase)."""
    graph = GraphMachine(
        model=_Model(),
        states=Phase,
        transitions=_machine_transitions(),
        initial=INITIAL,
        auto_transitions=False,
        graph_engine="mermaid",
        show_conditions=True,
        title="ftengine recovery FSM",
    )
    text: str = graph.get_graph().draw(None)
    # The styling lines only highlight the machine's current phase, which means nothing in
    # a static diagram (and ties the text to that phase), so they are dropped.
    lines = [line.rstrip() for line in text.strip().splitlines()]
    return "\n".join(line for line in lines if not _STYLE_LINE.match(line))


_STYLE_LINE = re.compile(r"^\s*(classDef|Class)\s")
_EDGE_LINE = re.compile(r"^\s*(\w+) --> (\w+): (.+)$")
_LABEL = re.compile(r"^(\w+)(?: \[(\w+)\])?$")


def mermaid_rows(text: str) -> frozenset[Row]:
    """Parse the ``source --> dest: trigger [guard] | ...`` lines of a diagram back into rows.

    Raises ``ValueError`` on an edge line it cannot read, so a hand-edited diagram fails loudly.
    """
    rows: set[Row] = set()
    for line in text.splitlines():
        edge = _EDGE_LINE.match(line)
        if edge is None:
            continue
        source, dest = Phase[edge.group(1)], Phase[edge.group(2)]
        for label in edge.group(3).split(" | "):
            parsed = _LABEL.match(label.strip())
            if parsed is None:
                raise ValueError(f"cannot read edge label {label!r} in line {line!r}")
            rows.add(Row(Trigger(parsed.group(1)), source, dest, parsed.group(2)))
    return frozenset(rows)
