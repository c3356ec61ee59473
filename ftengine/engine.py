"""``RecoveryEngine``: sequences one worker's recovery through the FSM table, asking a policy
what to do and telling a backend to do it. It never decides and never touches a device itself.

Backend order, read from the step table ``ftengine.recovery.STEPS`` (ranks are original DP
ranks, ``epoch`` grows by one on every rebuild). An action the table does not allow in the
current phase is refused with ``TransitionError`` before the backend sees it (an engine bug:
the sequences are read from the same table):

- on a fault while serving: ``quarantine(fault)``, then the policy decides;
- retry: ``reset_device`` -> ``rebuild_groups(alive, epoch + 1)`` -> ``run_dummy_batch``;
- scale down: ``mask_ranks(dead)`` -> ``rebuild_groups(alive, epoch + 1)`` ->
  ``repair_experts(dead)`` -> ``run_dummy_batch`` (``dead`` cumulative).

Thread model: faults arrive from watchdog threads (``report_fault``), commands from the
control plane (``apply``), time from the host (``poll``). One lock guards the state
(``EngineState``). It is held through ``quarantine`` (which must not block on a peer) but
never across a recovery action, so a fault reported mid-recovery takes effect at once and
the recovery stops before its next action. No new recovery starts while the interrupted
one's action is still in the backend (a due retry waits; a command is rejected), so two
recoveries never drive the backend at once. No hidden threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

import attrs

from ftengine.backends.base import Backend, RepairReport
from ftengine.clock import Clock, MonotonicClock
from ftengine.commands import (
    Command,
    CommandLog,
    CommandResult,
    check_instruction,
    check_phase,
    parse_command,
    scale_down_problems,
)
from ftengine.context import RedundancyFacts
from ftengine.engine_state import EngineState, StartedAction
from ftengine.errors import CommandRejected, ConfigError
from ftengine.faults import Fault, HealthStatus, Phase, fault_text
from ftengine.fsm import Trigger
from ftengine.policies import Decision, GiveUp, Policy, decide, describe
from ftengine.recovery import (
    ALLOWED_ACTIONS,
    RETRY_ACTIONS,
    SCALE_DOWN_ACTIONS,
    Deadline,
    PendingRetry,
    PendingScaleDown,
    RecoveryPlan,
)
from ftengine.status import EngineStatus, Listener, PhaseChange

__all__ = [
    "ALLOWED_ACTIONS",
    "RETRY_ACTIONS",
    "SCALE_DOWN_ACTIONS",
    "CommandResult",
    "EngineStatus",
    "PhaseChange",
    "RecoveryEngine",
]

logger = logging.getLogger(__name__)


class RecoveryEngine:
    """One worker's recovery engine. See the module docstring for order and threading."""

    def __init__(
        self,
        policy: Policy,
        backend: Backend,
        *,
        rank: int = 0,
        world_size: int = 1,
        clock: Clock | None = None,
        redundancy: RedundancyFacts | None = None,
        history: int = 256,
    ) -> None:
        if not callable(policy):
            raise ConfigError(f"policy must be callable (ctx -> Decision | None), got {policy!r}")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.policy = policy
        self.backend = backend
        self.rank = rank
        self.world_size = world_size
        self.clock: Clock = clock or MonotonicClock()
        self.redundancy = redundancy
        self._lock = threading.RLock()
        self._commands = CommandLog(threading.Condition(self._lock))
        self._state = EngineState(rank, world_size, self.clock, history)

    # -- read-only views -------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        """The FSM phase now."""
        with self._lock:
            return self._state.phase

    @property
    def health(self) -> HealthStatus:
        """The vLLM health value of the current phase."""
        return self.phase.health

    @property
    def epoch(self) -> int:
        """The process-group epoch: how many rebuilds this engine has started."""
        with self._lock:
            return self._state.epoch

    @property
    def removed_ranks(self) -> frozenset[int]:
        """Original DP ranks removed by successful scale-downs (cumulative)."""
        with self._lock:
            return self._state.removed

    def status(self) -> EngineStatus:
        """A consistent snapshot of the engine."""
        with self._lock:
            return self._state.snapshot()

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` on every phase change (in order, on the changing thread, with the
        engine's lock held: keep it quick). Returns a function that unsubscribes it."""
        return self._state.listeners.subscribe(listener)

    # -- faults ----------------------------------------------------------------------------

    def report_fault(self, fault: Fault) -> None:
        """Take a fault from any thread. Serving: quarantine, then ask the policy. Already
        unhealthy (a recovery running included): the policy decides; by default dead.
        Never runs a recovery itself: ``poll`` or ``apply`` does."""
        with self._lock:
            self._expire_deadline()
            phase = self._state.phase
            if phase is Phase.DEAD:
                logger.info("ignoring %s: engine %d is dead", fault_text(fault), self.rank)
                return
            now = self.clock.now()
            if not 0 < fault.at <= now:
                fault = attrs.evolve(fault, at=now)
            self._state.note_fault(fault, phase, now)
            if phase.serving:
                self._fault_while_serving(fault, phase, now)
            else:
                self._fault_while_unhealthy(fault, phase, now)

    def _fault_while_serving(self, fault: Fault, phase: Phase, now: float) -> None:
        self._state.fire(Trigger.FAULT, fault_text(fault))
        if not self._quarantine(fault):
            return
        decision = self._ask(fault, phase, now)
        if isinstance(decision, GiveUp):
            self._state.fire(Trigger.GIVE_UP, decision.reason)
        else:
            self._state.schedule(decision, now)

    def _fault_while_unhealthy(self, fault: Fault, phase: Phase, now: float) -> None:
        decision = self._ask(fault, phase, now)
        continues = not isinstance(decision, GiveUp)
        reason = decision.reason if isinstance(decision, GiveUp) else fault_text(fault)
        self._state.fire(Trigger.FAULT, reason, continues=continues)
        if not continues:
            return
        if phase.recovering and not self._quarantine(fault):
            return
        self._state.schedule(decision, now)

    def _ask(self, fault: Fault, phase: Phase, now: float) -> Decision:
        state = self._state
        episode = state.current()
        ctx = episode.context(
            fault,
            phase,
            now,
            state.history,
            state.removed,
            rank=self.rank,
            world_size=self.world_size,
            epoch=state.epoch,
            redundancy=self.redundancy,
        )
        decision = decide(self.policy, ctx)
        episode.log.add_decision(now, describe(decision))
        logger.info("engine %d: policy decided to %s", self.rank, describe(decision))
        return decision

    def _quarantine(self, fault: Fault) -> bool:
        """Run ``backend.quarantine`` (in ``quarantined``); on failure give up. Lock held."""
        started = self._state.quarantine_started(fault)
        try:
            started.step.call(self.backend, started.args)
        except Exception as exc:
            logger.exception("engine %d: quarantine failed", self.rank)
            error = f"{type(exc).__name__}: {exc}"
            self._state.action_finished(started, error=error)
            self._state.fire(Trigger.GIVE_UP, f"quarantine failed ({error})")
            return False
        self._state.action_finished(started)
        return True

    # -- time ------------------------------------------------------------------------------

    def poll(self) -> None:
        """Run what is due: a policy's retry or scale-down, or an expired orchestrator
        deadline (-> dead). Call it periodically (e.g. every 50 ms) from the host loop; a
        recovery it starts runs to the end in the calling thread."""
        with self._lock:
            if self._expire_deadline():
                return
            pending = self._state.take_due()
            if pending is None:
                return
            plan = self._policy_plan(pending)
        if plan is not None:
            self._run(plan)

    def _expire_deadline(self) -> bool:
        """Die if the orchestrator deadline has passed; True if it did. Every entry point
        runs this first, so an expired deadline wins over whatever comes after it, polled
        or not. Lock held."""
        pending = self._state.pending  # only ever set in quarantined
        if not isinstance(pending, Deadline) or self.clock.now() < pending.due:
            return False
        reason = f"no recovery command before the orchestrator deadline t={pending.due:g}s"
        self._state.fire(Trigger.GIVE_UP, reason)
        return True

    def _policy_plan(self, pending: PendingRetry | PendingScaleDown) -> RecoveryPlan | None:
        if isinstance(pending, PendingRetry):
            return self._start(Command("retry"), "policy retry")
        removed = self._state.removed | pending.ranks
        problems = self._scale_down_problems(removed)
        if problems:
            reason = f"policy scale-down not possible: {'; '.join(problems)}"
            self._state.fire(Trigger.GIVE_UP, reason)
            return None
        return self._start(Command("scale_down", removed), "policy scale-down")

    # -- commands --------------------------------------------------------------------------

    def apply(
        self, instruction: str, params: Mapping[str, object], request_id: str
    ) -> CommandResult:
        """Run an orchestrator command to its end (vLLM's ``retry`` / ``scale_down`` with
        ``{"removed_dp_ranks": [...]}``, original DP ranks, cumulative). Invalid or
        out-of-phase commands are rejected with a reason and change nothing; a replayed
        ``request_id`` returns the recorded result without acting again."""
        if not isinstance(request_id, str) or not request_id:
            rejected = f"request_id must be a non-empty string, got {request_id!r}"
            return CommandResult(str(request_id), False, rejected)
        with self._lock:
            recorded = self._commands.recorded(request_id)
            if recorded is not None:
                logger.info("engine %d: replayed request %s", self.rank, request_id)
                return recorded
            self._expire_deadline()
            try:
                command = self._validate(instruction, params)
            except CommandRejected as exc:
                return self._commands.record(CommandResult(request_id, False, exc.reason))
            self._commands.start(request_id)
            self._state.command_accepted(request_id)
            plan = self._start(command, f"command {request_id}")
        result = CommandResult(request_id, False, "the recovery was interrupted")
        try:
            ok, reason = self._run(plan)
            result = CommandResult(request_id, ok, reason)
        finally:
            with self._lock:
                self._commands.record(result)
        return result

    def _validate(self, instruction: object, params: object) -> Command:
        # Phase before params: a dead or serving engine answers with its status, whatever
        # the params were.
        state = self._state
        check_phase(state.phase, check_instruction(instruction), self.rank, state.in_flight)
        command = parse_command(instruction, params)
        if command.instruction == "scale_down":
            problems = self._scale_down_problems(command.removed)
            if problems:
                raise CommandRejected("scale_down rejected: " + "; ".join(problems))
        return command

    def _scale_down_problems(self, removed: frozenset[int]) -> list[str]:
        return scale_down_problems(
            removed,
            rank=self.rank,
            world_size=self.world_size,
            already_removed=self._state.removed,
            redundancy=self.redundancy,
        )

    # -- recovery --------------------------------------------------------------------------

    def _start(self, command: Command, origin: str) -> RecoveryPlan:
        """Enter ``retrying`` / ``scaling_down`` and plan the run. Lock held."""
        if command.instruction == "retry":
            return self._state.begin(Trigger.RETRY, self._state.removed, origin)
        return self._state.begin(Trigger.SCALE_DOWN, command.removed, origin)

    def _run(self, plan: RecoveryPlan) -> tuple[bool, str | None]:
        """Run ``plan``'s steps outside the lock, checking before each that the engine still
        belongs to it. Returns (success, reason)."""
        state = self._state
        for step in plan.steps:
            with self._lock:
                if not state.owns(plan):
                    return False, self._interrupted()
                started = state.action_started(plan, step)
            try:
                report = self._invoke(started)
            except Exception as exc:
                with self._lock:
                    return False, self._action_failed(plan, started, exc)
            with self._lock:
                state.action_finished(started, report)
        with self._lock:
            if not state.owns(plan):
                return False, self._interrupted()
            state.complete(plan)
            return True, None

    def _invoke(self, started: StartedAction) -> RepairReport | None:
        """One backend action, outside the lock; no recovery may start until it is over."""
        try:
            return started.step.call(self.backend, started.args)
        finally:
            with self._lock:
                self._state.action_returned()

    def _interrupted(self) -> str:
        return "recovery interrupted by a fault; " + self._health_text()

    def _health_text(self) -> str:
        """``engine 0 status is DEAD (phase dead): <why>`` (the why only once dead)."""
        phase, error = self._state.phase, self._state.ft_error
        why = f": {error}" if phase is Phase.DEAD and error else ""
        return f"engine {self.rank} status is {phase.health.name} (phase {phase.value}){why}"

    def _action_failed(self, plan: RecoveryPlan, started: StartedAction, exc: Exception) -> str:
        """A recovery action raised: record it and treat it as a fault in the recovery."""
        action, error = started.step.action, f"{type(exc).__name__}: {exc}"
        self._state.action_finished(started, error=error)
        logger.warning("engine %d: %s failed: %s", self.rank, action, error, exc_info=exc)
        if not self._state.owns(plan):
            return self._interrupted()
        fault = self._state.fail(plan, started.step, error)
        self._fault_while_unhealthy(fault, plan.phase, fault.at)
        return f"{action} failed ({error}); " + self._health_text()
