"""The recovery engine's books: phase, fault episode, epoch, removed ranks, the pending
time-driven decision and the status fields. The engine changes them only through intent
methods (a fault noted, a decision kept, a plan begun, an action started / finished, a plan
completed or failed); ``fire`` is the one place a phase change is made.

Not locked itself: ``RecoveryEngine`` holds its lock around every use.
"""

from __future__ import annotations

import logging
from collections import deque

import attrs

from ftengine.backends.base import RepairReport
from ftengine.clock import Clock
from ftengine.episode import Episode
from ftengine.errors import TransitionError
from ftengine.faults import Fault, FaultKind, Phase, fault_text
from ftengine.fsm import RecoveryFSM, Trigger
from ftengine.policies import Decision, GiveUp, Retry, ScaleDown
from ftengine.recovery import (
    QUARANTINE,
    Deadline,
    Pending,
    PendingRetry,
    PendingScaleDown,
    RecoveryPlan,
    Step,
    StepArgs,
    check_allowed,
    sequence,
)
from ftengine.status import EngineStatus, Listeners, PhaseChange

logger = logging.getLogger(__name__)


@attrs.frozen
class StartedAction:
    """A backend action under way: its step, the call's arguments and its timeline index."""

    step: Step
    args: StepArgs
    index: int


class EngineState:
    """What one engine knows; the engine decides and acts, this only records.

    ``token`` grows with every recovery started: a run owns the engine while its token is
    current. ``in_flight`` names the backend action a run has outside the lock, if any.
    """

    __slots__ = (
        "admission",
        "admitted",
        "clock",
        "episode",
        "episodes",
        "epoch",
        "everyone",
        "fault_info",
        "fsm",
        "ft_error",
        "history",
        "in_flight",
        "last_request_id",
        "listeners",
        "pending",
        "rank",
        "ready",
        "removed",
        "token",
    )

    def __init__(
        self,
        rank: int,
        world_size: int,
        clock: Clock,
        history: int,
        initial: Phase = Phase.RUNNING,
    ) -> None:
        self.rank = rank
        self.everyone = frozenset(range(world_size))
        self.clock = clock
        self.fsm = RecoveryFSM(initial)
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
        # Removed ranks whose returning worker reported ready (the host says so).
        self.ready: frozenset[int] = frozenset()
        # A returning rank: the deployment's (removed, epoch) before its admission, as the
        # host learnt them at ``loaded`` (a scale_up's params may give newer ones).
        self.admission: tuple[frozenset[int], int] | None = None
        # The last admission this engine took part in (status ``last_admission``).
        self.admitted: dict[str, object] | None = None

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
            ready_ranks=self.ready & self.removed,
            last_admission=self.admitted,
            epoch=self.epoch,
            attempts=0 if episode is None else episode.attempts,
            timeline=None if episode is None else episode.log.snapshot(),
        )

    def current(self) -> Episode:
        """The fault episode under way (there is one in every unhealthy phase)."""
        if self.episode is None:
            raise TransitionError("recovery work outside a fault episode (an engine bug)")
        return self.episode

    def owns(self, plan: RecoveryPlan) -> bool:
        """Whether ``plan``'s run still owns the engine (no fault has taken it over)."""
        return self.token == plan.token and self.phase is plan.phase

    # -- faults and decisions ----------------------------------------------------------------

    def note_fault(self, fault: Fault, phase: Phase, now: float) -> None:
        """Record ``fault``, which arrived in ``phase``: a fault of a member (serving, or
        admitting a rank) opens an episode."""
        if phase.member:
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
            self.pending = PendingRetry(now + decision.after)
        elif isinstance(decision, ScaleDown):
            self.pending = PendingScaleDown(now, decision.ranks)
        elif not isinstance(decision, GiveUp):
            self.pending = Deadline(decision.deadline)

    def take_due(self) -> PendingRetry | PendingScaleDown | None:
        """The kept retry or scale-down, taken, once due and no interrupted run's action is
        still in the backend (a deadline is never taken: it only expires)."""
        pending = self.pending
        if pending is None or isinstance(pending, Deadline) or self.clock.now() < pending.due:
            return None
        if self.in_flight is not None:
            return None  # an interrupted run's action is still in the backend: a later poll
        self.pending = None
        return pending

    def command_accepted(self, request_id: str) -> None:
        """An orchestrator command passed validation and is about to run."""
        self.last_request_id = request_id

    def fire(self, trigger: Trigger, reason: str, *, continues: bool = False) -> Phase:
        """Fire ``trigger`` (``continues``: the policy's verdict for a fault) and record the
        change: timeline, listeners, ``ft_error`` on death; a pending decision only survives
        in ``quarantined``."""
        source = self.phase
        dest = self.fsm.fire(trigger, continues=continues)
        now = self.clock.now()
        if source in (Phase.SCALING_UP, Phase.JOINING) and dest is not Phase.HEALTHY:
            self._end_admission(False)  # interrupted by a fault
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

    # -- recovery runs -----------------------------------------------------------------------

    def begin(self, trigger: Trigger, removed: frozenset[int], origin: str) -> RecoveryPlan:
        """Start a recovery run towards ``removed`` (cumulative): count the attempt, take a
        new token, fire ``trigger`` (retry / scale_down) and return the run's plan."""
        episode = self.current()
        attempt = episode.start_attempt()
        self.token += 1
        phase = self.fire(trigger, origin)
        return RecoveryPlan(
            token=self.token,
            phase=phase,
            attempt=attempt,
            removed=removed,
            alive=self.everyone - removed,
            fault=episode.last,
            steps=sequence(phase),
        )

    def begin_admission(
        self, added: frozenset[int], removed: frozenset[int], epoch: int, origin: str
    ) -> RecoveryPlan:
        """Start admitting ``added`` (``removed`` is the cumulative set after it; ``epoch``
        the deployment's epoch before it, which a returning rank adopts): take a new token,
        fire ``scale_up`` (healthy -> scaling_up, or ready -> joining) and return the plan.
        An admission answers no fault and counts no recovery attempt; its steps are written
        to the last fault episode's timeline when there is one."""
        self.token += 1
        self.epoch = epoch
        phase = self.fire(Trigger.SCALE_UP, origin)
        self.admitted = {
            "added": sorted(added),
            "started": self.clock.now(),
            "seconds": None,
            "ok": None,
            "reloads": 0,
            "bytes_reloaded": 0,
        }
        return RecoveryPlan(
            token=self.token,
            phase=phase,
            attempt=0,
            removed=removed,
            alive=self.everyone - removed,
            fault=None,
            steps=sequence(phase),
            added=added,
        )

    def quarantine_started(self, fault: Fault) -> StartedAction:
        """Start quarantining ``fault``. It runs with the lock held, so it is
        never ``in_flight``: that names an interrupted run's action, which it may overlap."""
        check_allowed(QUARANTINE, self.phase)
        args = StepArgs(fault, self.removed, self.everyone - self.removed, self.epoch)
        return self._record(QUARANTINE, args, self.current().attempts)

    def action_started(self, plan: RecoveryPlan, step: Step) -> StartedAction:
        """Start ``plan``'s ``step`` (a new epoch first if it opens one); it is ``in_flight``
        until ``action_returned``."""
        check_allowed(step, self.phase)
        if step.new_epoch:
            self.epoch += 1
        started = self._record(step, plan.args(self.epoch), plan.attempt)
        self.in_flight = step.action
        return started

    def _record(self, step: Step, args: StepArgs, attempt: int) -> StartedAction:
        if self.episode is None or args.fault is None:
            # An admission answers no fault: its steps go to ``admission``, not to the
            # last fault episode's timeline.
            return StartedAction(step, args, -1)
        index = self.episode.log.begin_step(step.timeline, attempt, self.clock.now())
        return StartedAction(step, args, index)

    def action_returned(self) -> None:
        """The backend call is over (returned or raised): a new recovery may start."""
        self.in_flight = None

    def action_finished(
        self, started: StartedAction, report: RepairReport | None = None, error: str | None = None
    ) -> None:
        """Close ``started``'s timeline step now (failed with ``error``; ``report`` kept)."""
        if started.args.fault is None and self.admitted is not None:
            self._note_admission_step(report, error)
        if started.index < 0 or self.episode is None:
            return
        episode = self.episode
        episode.log.end_step(started.index, self.clock.now(), error)
        if report is not None:
            episode.log.set_repair(report)

    def _note_admission_step(self, report: RepairReport | None, error: str | None) -> None:
        admitted = self.admitted
        assert admitted is not None
        if report is not None:
            admitted["reloads"] = report.reloads
            admitted["bytes_reloaded"] = report.bytes_reloaded
        if error is not None:
            admitted["ok"] = False
            admitted["error"] = error

    def _end_admission(self, ok: bool) -> None:
        if self.admitted is not None and self.admitted["ok"] is None:
            started = self.admitted["started"]
            assert isinstance(started, float)
            self.admitted["ok"] = ok
            self.admitted["seconds"] = self.clock.now() - started

    def commit(self, plan: RecoveryPlan) -> None:
        """``plan``'s committing step returned: the backend now serves its removed set."""
        self.removed = plan.removed
        self.ready -= plan.added

    def complete(self, plan: RecoveryPlan) -> None:
        """Every step of ``plan`` succeeded: its removed set holds and the engine serves."""
        self.commit(plan)
        if plan.fault is None:
            self._end_admission(True)
            what = f"ranks {sorted(plan.added)} admitted"
            self.fire(Trigger.RECOVERED, f"{plan.phase.value} succeeded: {what}")
            self.ft_error = None
        else:
            self.fire(Trigger.RECOVERED, f"{plan.phase.value} succeeded (attempt {plan.attempt})")
        self.fault_info = None

    def admission_failed(self, plan: RecoveryPlan, step: Step, error: str) -> Fault:
        """``plan`` (an admission) failed at ``step``: its ranks must report ready again.
        Returns the failure as a fault (the engine handles it as a member's or a returning
        rank's fault)."""
        self.ready -= plan.added
        self._end_admission(False)
        self.ft_error = f"{plan.phase.value} failed at {step.action}: {error}"
        return Fault(FaultKind.RECOVERY_ERROR, info=f"{step.action}: {error}", at=self.clock.now())

    def fail(self, plan: RecoveryPlan, step: Step, error: str) -> Fault:
        """``plan``'s ``step`` raised ``error``: record it as a fault of the run's episode and
        return that fault (the engine asks the policy what next)."""
        now = self.clock.now()
        fault = Fault(FaultKind.RECOVERY_ERROR, info=f"{step.action}: {error}", at=now)
        self.ft_error = f"{plan.phase.value} failed at {step.action}: {error}"
        self.note_fault(fault, plan.phase, now)
        return fault
