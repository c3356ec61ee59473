"""The recovery engine's books: phase, fault episode, epoch, removed ranks, the pending
time-driven decision and the status fields, plus the one place a phase change is made.

Not locked itself: ``RecoveryEngine`` holds its lock around every use.
"""

from __future__ import annotations

import logging
from collections import deque

from ftengine.clock import Clock
from ftengine.episode import Episode
from ftengine.errors import TransitionError
from ftengine.faults import Fault, Phase
from ftengine.fsm import RecoveryFSM, Trigger
from ftengine.policies import Decision, GiveUp, Retry, ScaleDown
from ftengine.recovery import Pending, fault_text
from ftengine.status import EngineStatus, Listeners, PhaseChange

logger = logging.getLogger(__name__)

SERVING = frozenset({Phase.RUNNING, Phase.HEALTHY})


class EngineState:
    """What one engine knows; the engine decides and acts, this only records.

    ``token`` grows with every recovery started: a run owns the engine while its token is
    current. ``in_flight`` names the backend action a run has outside the lock, if any.
    """

    def __init__(self, rank: int, clock: Clock, history: int) -> None:
        self.rank = rank
        self.clock = clock
        self.fsm = RecoveryFSM()
        self.listeners = Listeners()
        self.history: deque[Fault] = deque(maxlen=history)
        self.epoch = 0
        self.removed: frozenset[int] = frozenset()
        self.episodes = 0
        self.episode: Episode | None = None
        self.pending: Pending | None = None
        self.token = 0
        self.in_flight: str | None = None
        self.fault_info: str | None = None
        self.ft_error: str | None = None
        self.last_request_id: str | None = None

    @property
    def phase(self) -> Phase:
        return self.fsm.phase

    def snapshot(self) -> EngineStatus:
        """The status fields as one consistent value."""
        episode = self.episode
        return EngineStatus(
            id=self.rank,
            status=self.phase.health,
            phase=self.phase,
            fault_info=self.fault_info,
            last_ft_request_id=self.last_request_id,
            ft_error=self.ft_error,
            removed_ranks=self.removed,
            epoch=self.epoch,
            attempts=0 if episode is None else episode.attempts,
            timeline=None if episode is None else episode.log.snapshot(),
        )

    def current(self) -> Episode:
        """The fault episode under way (there is one in every unhealthy phase)."""
        if self.episode is None:
            raise TransitionError("recovery work outside a fault episode (an engine bug)")
        return self.episode

    def note_fault(self, fault: Fault, phase: Phase, now: float) -> None:
        """Record ``fault``, which arrived in ``phase``: a fault while serving opens an episode."""
        if phase in SERVING:
            self.episodes += 1
            self.episode = Episode(self.episodes, fault, now)
            self.ft_error = None
        else:
            self.current().add_fault(fault)
        self.history.append(fault)
        self.fault_info = fault.info or fault.kind.value
        logger.warning(
            "engine %d: %s in phase %s (step %s, epoch %d)",
            *(self.rank, fault_text(fault), phase.value, fault.step, self.epoch),
            extra={"rank": self.rank, "phase": phase.value, "epoch": self.epoch},
        )

    def schedule(self, decision: Decision, now: float) -> None:
        """Keep a policy's decision for ``poll`` (``GiveUp`` is acted on at once, never kept)."""
        if isinstance(decision, Retry):
            self.pending = Pending("retry", now + decision.after)
        elif isinstance(decision, ScaleDown):
            self.pending = Pending("scale_down", now, decision.ranks)
        elif not isinstance(decision, GiveUp):
            self.pending = Pending("deadline", decision.deadline)

    def fire(self, trigger: Trigger, reason: str, *, continues: bool = False) -> Phase:
        """Fire ``trigger`` (``continues``: the policy's verdict for a fault) and record the
        change: timeline, listeners, ``ft_error`` on death; a pending decision only survives
        in ``quarantined``."""
        source = self.phase
        dest = self.fsm.fire(trigger, continues=continues)
        now = self.clock.now()
        if dest is not Phase.QUARANTINED:
            self.pending = None
        if dest is Phase.DEAD:
            self.ft_error = reason
            logger.error("engine %d is dead: %s", self.rank, reason)
        if dest is source:
            return dest
        if self.episode is not None:
            self.episode.log.add_phase(dest, now, reason)
        self.listeners.notify(PhaseChange(source, dest, now, reason, trigger.value, self.epoch))
        return dest

    def begin_step(self, name: str, attempt: int) -> int:
        """Open timeline step ``name`` now; returns its index for ``end_step``."""
        return self.current().log.begin_step(name, attempt, self.clock.now())

    def end_step(self, index: int, error: str | None = None) -> None:
        """Close timeline step ``index`` now, failed with ``error`` if given."""
        self.current().log.end_step(index, self.clock.now(), error)
