"""Recovery the way an orchestrator drives it, on any target: read every engine's status,
ask the target's rules what to do (wait, send a command to some ranks, fence hung ones,
or done), do it through the target's channel, until the engines settle, one ends dead,
or the deadline passes (``stuck``). The campaign's recovery-phase fault goes in right
after the first command (or, when the rules only watch, once a recovery runs)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import attrs

Engines = Mapping[int, Mapping[str, Any]]
"""Every engine's ``/fault_tolerance/status`` entry, by rank."""


@attrs.frozen
class Outcome:
    """How a recovery ended: ``settled`` (every live engine healthy, the dead removed),
    ``dead`` (some live engine's engine is DEAD: terminal), or ``stuck`` (neither before
    the deadline); the engines as last seen and the commands sent."""

    state: str  # settled | dead | stuck
    at: float
    engines: tuple[dict[str, Any], ...]
    commands: tuple[str, ...]


@attrs.frozen
class Decision:
    """What the orchestrator does now: ``wait``, ``watch`` (wait: a recovery it did not
    command runs), ``command`` (``instruction``, ``params`` to ``targets``; none: the one
    endpoint), ``fence`` (kill the ``targets``' workers) or ``done`` (``state``: settled |
    dead)."""

    action: str
    targets: tuple[int, ...] = ()
    instruction: str = ""
    params: dict[str, Any] = attrs.field(factory=dict)
    state: str = ""


class Rules(Protocol):
    """A target's recovery rules for one recovery (they may keep what they saw)."""

    def __call__(self, engines: Engines, may_die: Sequence[int], now: float) -> Decision:
        """The next step given ``engines``, where only ``may_die`` may end dead."""


Handle = TypeVar("Handle")


class Channel(Protocol[Handle]):
    """How commands reach a target's engines and how their ends are seen."""

    poll_s: float
    """How often the status is read."""

    def read(self) -> Engines:
        """Every engine's status now."""

    def send(self, fault: int | None, decision: Decision, engines: Engines) -> Handle:
        """Send ``decision``'s command; a handle for :meth:`finish`."""

    def finish(self, fault: int | None, handle: Handle, until: float) -> str:
        """Wait (until monotonic ``until``) for the command sent to end; a line about it."""

    def fence(self, fault: int | None, ranks: Sequence[int]) -> None:
        """Kill the workers of ``ranks`` (hung: only their death frees their peers)."""

    def close(self) -> None:
        """Release its connections."""


During = Callable[[], Sequence[int]]
"""Injects the fault planned to land during a recovery; returns the ranks it hit."""


class Orchestrator(Generic[Handle]):
    """Drives one deployment's recoveries through ``channel``, with a fresh set of the
    target's ``rules()`` for each."""

    def __init__(self, channel: Channel[Handle], rules: Callable[[], Rules]) -> None:
        self.channel = channel
        self.rules = rules

    def read(self) -> Engines:
        """Every engine's status now."""
        return self.channel.read()

    def close(self) -> None:
        self.channel.close()

    def recover(
        self,
        fault: int | None,
        deadline_s: float,
        *,
        may_die: Sequence[int] = (),
        during: During | None = None,
    ) -> Outcome:
        """Drive recovery of ``fault`` until it settles, ends dead or ``deadline_s``
        passes; only ``may_die`` may end dead, and ``during`` runs once, right after the
        first command was sent (or once the rules watch a recovery they did not command):
        the ranks it hits may end dead too."""
        return _drive(self.channel, self.rules(), fault, deadline_s, may_die, during)


def _drive(
    channel: Channel[Handle],
    rules: Rules,
    fault: int | None,
    deadline_s: float,
    may_die: Sequence[int],
    during: During | None,
) -> Outcome:
    deadline, commands = time.monotonic() + deadline_s, list[str]()
    dying, hooks = list(may_die), [] if during is None else [during]  # popped: fires once
    while True:
        engines = channel.read()
        now = time.monotonic()
        decision = rules(engines, dying, now)
        if decision.action == "done":
            return Outcome(decision.state, now, _seen(engines), tuple(commands))
        if now > deadline:
            return Outcome("stuck", now, _seen(engines), tuple(commands))
        if decision.action == "watch" and hooks:
            dying += hooks.pop()()
        elif decision.action == "fence":
            channel.fence(fault, decision.targets)
            dying += decision.targets
        elif decision.action == "command":
            handle = channel.send(fault, decision, engines)
            if hooks:
                dying += hooks.pop()()
            commands.append(channel.finish(fault, handle, deadline))
        time.sleep(channel.poll_s)


def _seen(engines: Engines) -> tuple[dict[str, Any], ...]:
    return tuple(dict(e) for e in engines.values())
