"""``RecoveryEngine``: sequences one worker's recovery through the FSM table, asking a policy
what to do and telling a backend to do it. It never decides and never touches a device itself.

Backend order, read from the step table ``ftengine.recovery.STEPS`` (ranks are original DP
ranks, ``epoch`` grows by one on every rebuild). An action the table does not allow in the
current phase is refused with ``TransitionError`` before the backend sees it (an engine bug:
the sequences are read from the same table):

- on a fault while serving: ``quarantine(fault)``, then the policy decides;
- retry: ``reset_device`` -> ``rebuild_groups(alive, epoch + 1)`` -> ``run_dummy_batch``;
- scale down: ``mask_ranks(dead)`` -> ``rebuild_groups(alive, epoch + 1)`` ->
  ``repair_experts(dead)`` -> ``run_dummy_batch`` (``dead`` cumulative);
- scale up (a ``scale_up`` command, or the policy's ``admit`` at ``poll`` once the host
  reported ranks ready with ``note_ready``), on every survivor (healthy -> scaling_up) and
  on the returning rank (ready -> joining) alike: ``rebuild_groups(alive + added, epoch +
  1)`` -> ``admit_ranks(added, removed - added)`` (commits the removed set) ->
  ``run_dummy_batch``. A returning rank's engine is built with ``rejoining=True`` (phase
  loading) and told ``loaded(...)`` once its weights are in (phase ready).

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
from ftengine.backends.delegating import can_admit
from ftengine.clock import Clock, MonotonicClock
from ftengine.commands import (
    Command,
    CommandLog,
    CommandResult,
    check_instruction,
    check_phase,
    check_scale_up_phase,
    join_problems,
    parse_command,
    scale_down_problems,
    scale_up_problems,
)
from ftengine.context import AdmissionContext, RedundancyFacts
from ftengine.engine_state import EngineState, StartedAction
from ftengine.errors import CommandRejected, ConfigError
from ftengine.faults import Fault, HealthStatus, Phase, fault_text
from ftengine.fsm import Trigger
from ftengine.policies import Decision, GiveUp, Policy, decide, decide_admission, describe
from ftengine.recovery import (
    ALLOWED_ACTIONS,
    RETRY_ACTIONS,
    SCALE_DOWN_ACTIONS,
    SCALE_UP_ACTIONS,
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
    "SCALE_UP_ACTIONS",
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
        rejoining: bool = False,
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
        initial = Phase.LOADING if rejoining else Phase.RUNNING
        self._state = EngineState(rank, world_size, self.clock, history, initial)

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

    @property
    def ready_ranks(self) -> frozenset[int]:
        """Removed ranks the host reported ready to be admitted (``note_ready``)."""
        with self._lock:
            return self._state.ready & self._state.removed

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
            if phase.rejoining:
                self._fault_while_rejoining(fault)
                return
            self._state.note_fault(fault, phase, now)
            if phase.member:
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

    def _fault_while_rejoining(self, fault: Fault, *, why: str | None = None) -> None:
        """A returning rank is no member yet: no episode, no policy. Joining goes back to
        ready (it may be admitted again); loading or ready ends it (the operator restarts
        it). Lock held."""
        self._state.history.append(fault)
        self._state.fault_info = fault.info or fault.kind.value
        dest = self._state.fire(Trigger.FAULT, why or fault_text(fault))
        if dest is Phase.READY:
            self._state.ft_error = why or f"admission interrupted: {fault_text(fault)}"

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
            plan = self._admission_plan() if pending is None else self._policy_plan(pending)
        if plan is not None:
            self._run(plan)

    # -- rejoin ----------------------------------------------------------------------------

    def note_ready(self, ranks: frozenset[int]) -> None:
        """The host's word on which removed ranks have a returning worker that loaded its
        weights and waits to be admitted (the whole set, replacing the last one). A
        ``scale_up`` is accepted only for these; the policy's ``admit`` sees them at ``poll``,
        which the host must call at a step boundary (an admission rebuilds the groups)."""
        with self._lock:
            self._state.ready = frozenset(ranks)

    def loaded(self, removed: frozenset[int] | None = None, epoch: int | None = None) -> None:
        """A returning rank (built with ``rejoining=True``) loaded its weights: loading ->
        ready. ``removed`` / ``epoch``, when the host knows them, are the deployment's
        removed set and epoch (read from a survivor's status); a ``scale_up`` to this rank
        must otherwise carry them in its params."""
        with self._lock:
            if removed is not None and epoch is not None:
                self._state.admission = (frozenset(removed), epoch)
            self._state.fire(Trigger.LOADED, "weights loaded; waiting to be admitted")

    def _admission_plan(self) -> RecoveryPlan | None:
        """If healthy with ready removed ranks, ask the policy's ``admit``. Lock held."""
        state = self._state
        ready = state.ready & state.removed
        if state.phase is not Phase.HEALTHY or not ready or state.in_flight is not None:
            return None
        if not can_admit(self.backend):
            return None
        ctx = AdmissionContext(
            ready_ranks=ready,
            removed_ranks=state.removed,
            now=self.clock.now(),
            rank=self.rank,
            world_size=self.world_size,
            epoch=state.epoch,
            redundancy=self.redundancy,
        )
        decision = decide_admission(self.policy, ctx)
        if decision is None:
            return None
        logger.info("engine %d: policy decided to %s", self.rank, describe(decision))
        command = Command("scale_up", added=tuple(sorted(decision.ranks)))
        return self._start(command, f"policy {describe(decision)}")

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
        checked = check_instruction(instruction)
        if checked == "scale_up":
            return self._validate_scale_up(params)
        check_phase(state.phase, checked, self.rank, state.in_flight)
        command = parse_command(instruction, params)
        if command.instruction == "scale_down":
            problems = self._scale_down_problems(command.removed)
            if problems:
                raise CommandRejected("scale_down rejected: " + "; ".join(problems))
        return command

    def _validate_scale_up(self, params: object) -> Command:
        state = self._state
        check_scale_up_phase(state.phase, self.rank, state.removed)
        command = parse_command("scale_up", params)
        if state.phase is Phase.READY:
            if state.admission is not None and command.known_removed is None:
                command = attrs.evolve(command, known_removed=state.admission[0])
            if state.admission is not None and command.epoch is None:
                command = attrs.evolve(command, epoch=state.admission[1])
            problems = join_problems(command, rank=self.rank, world_size=self.world_size)
        else:
            problems = scale_up_problems(
                command,
                rank=self.rank,
                world_size=self.world_size,
                removed=state.removed,
                ready=state.ready,
                epoch=state.epoch,
            )
        if not can_admit(self.backend):
            problems.append(f"backend {self.backend.name!r} cannot admit ranks")
        if problems:
            raise CommandRejected("scale_up rejected: " + "; ".join(problems))
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
        """Enter ``retrying`` / ``scaling_down`` / ``scaling_up`` / ``joining`` and plan the
        run. Lock held."""
        state = self._state
        if command.instruction == "scale_up":
            added = frozenset(command.added)
            if state.phase is Phase.READY:  # the returning rank: the deployment's books
                known = command.known_removed if command.known_removed is not None else added
                epoch = command.epoch if command.epoch is not None else state.epoch
                return state.begin_admission(added, known - added, epoch, origin)
            return state.begin_admission(added, state.removed - added, state.epoch, origin)
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
                if started.step.commits and state.owns(plan):
                    state.commit(plan)
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
        if plan.fault is None:  # an admission: a member's fault, or back to ready
            fault = self._state.admission_failed(plan, started.step, error)
            if plan.phase is Phase.JOINING:
                self._fault_while_rejoining(fault, why=self._state.ft_error)
            else:
                self._state.note_fault(fault, plan.phase, fault.at)
                self._fault_while_serving(fault, plan.phase, fault.at)
            return f"{action} failed ({error}); " + self._health_text()
        fault = self._state.fail(plan, started.step, error)
        self._fault_while_unhealthy(fault, plan.phase, fault.at)
        return f"{action} failed ({error}); " + self._health_text()
