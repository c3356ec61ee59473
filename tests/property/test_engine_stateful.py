"""Random interleavings of faults, commands (valid, invalid, replayed), backend failures and
clock advances, run against the engine and a small reference model side by side."""

from __future__ import annotations

from typing import Any

import attrs
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from ftengine.backends.fake import Call
from ftengine.context import AdmissionContext, RecoveryContext, RedundancyFacts
from ftengine.engine import CommandResult
from ftengine.faults import Fault, FaultKind, Phase
from ftengine.fsm import successors
from ftengine.policies import (
    AutoRecovery,
    Decision,
    ExponentialBackoff,
    FlapGuard,
    GiveUp,
    MaxAttempts,
    OrchestratorDriven,
    Policy,
    Retry,
    ScaleDown,
    decide_admission,
)
from ftengine.recovery import (
    STEP,
    STEPS,
    Deadline,
    Pending,
    PendingRetry,
    PendingScaleDown,
    sequence,
)
from tests.engine_support import Rig, make_rig

WORLD, RANK = 4, 0
REDUNDANCY = RedundancyFacts(ep_size=4, local_slots=4, num_logical=8)  # survives two dead ranks
# name -> (policy, the most recovery attempts one episode may start)
POLICIES: dict[str, tuple[Policy, int]] = {
    "orchestrator": (OrchestratorDriven(recovery_timeout=10.0), 3),
    "auto": (
        MaxAttempts(3)
        | (
            FlapGuard(k=3, window=20.0)
            & AutoRecovery(retry_during_recovery=True, max_attempts=10)
            & ExponentialBackoff(base=1.0, cap=4.0, seed=7)
        ),
        3,
    ),
}


@attrs.define
class Model:
    """The engine's rules in miniature; it asks the same policy the engine does."""

    policy: Policy
    now: float = 100.0
    phase: Phase = Phase.RUNNING
    removed: frozenset[int] = frozenset()
    epoch: int = 0
    attempts: int = 0
    episode_start: float = 0.0
    dead: set[int] = attrs.Factory(set)
    history: list[Fault] = attrs.Factory(list)
    pending: Pending | None = None
    armed: set[str] = attrs.Factory(set)
    ready: frozenset[int] = frozenset()

    def decide(self, fault: Fault, phase: Phase) -> Decision:
        ctx = RecoveryContext(
            fault=fault,
            phase=phase,
            now=self.now,
            episode_start=self.episode_start,
            attempts=self.attempts,
            faults=tuple(self.history),
            dead_ranks=frozenset(self.dead) - self.removed,
            removed_ranks=self.removed,
            rank=RANK,
            world_size=WORLD,
            epoch=self.epoch,
            redundancy=REDUNDANCY,
        )
        return self.policy(ctx) or GiveUp("abstained")

    def expire(self) -> None:
        """A passed orchestrator deadline takes effect before any later fault or command."""
        if isinstance(self.pending, Deadline) and self.now >= self.pending.due:
            self.enter(Phase.DEAD)

    def fault(self, fault: Fault) -> None:
        self.expire()
        if self.phase is Phase.DEAD:
            return
        source = self.phase
        if source.member:
            self.attempts, self.dead, self.episode_start = 0, set(), fault.at
        self.history.append(fault)
        if fault.kind is FaultKind.DEAD_PEER and fault.rank is not None:
            self.dead.add(fault.rank)
        if source.member:
            self.enter(Phase.QUARANTINED)
            if self.quarantine():
                self.act(self.decide(fault, source))
            return
        decision = self.decide(fault, source)
        if isinstance(decision, GiveUp):
            self.enter(Phase.DEAD)
            return
        self.enter(Phase.QUARANTINED)
        if not source.recovering or self.quarantine():
            self.act(decision)

    def enter(self, phase: Phase) -> None:
        self.phase = phase
        if phase is not Phase.QUARANTINED:
            self.pending = None

    def quarantine(self) -> bool:
        if "quarantine" in self.armed:
            self.armed.discard("quarantine")
            self.enter(Phase.DEAD)
            return False
        return True

    def act(self, decision: Decision) -> None:
        if isinstance(decision, GiveUp):
            self.enter(Phase.DEAD)
        elif isinstance(decision, Retry):
            self.pending = PendingRetry(self.now + decision.after)
        elif isinstance(decision, ScaleDown):
            self.pending = PendingScaleDown(self.now, decision.ranks)
        else:
            self.pending = Deadline(decision.deadline)

    def poll(self) -> None:
        if self.phase is Phase.HEALTHY and self.ready & self.removed:
            ctx = AdmissionContext(
                ready_ranks=self.ready & self.removed,
                removed_ranks=self.removed,
                now=self.now,
                rank=RANK,
                world_size=WORLD,
                epoch=self.epoch,
                redundancy=REDUNDANCY,
            )
            decision = decide_admission(self.policy, ctx)
            if decision is not None:
                self.admit(decision.ranks)
            return
        if self.phase is not Phase.QUARANTINED or self.pending is None:
            return
        pending = self.pending
        if self.now < pending.due:
            return
        if isinstance(pending, PendingRetry):
            self.run(True, self.removed)
        elif isinstance(pending, Deadline) or self.refuses(self.removed | pending.ranks):
            self.enter(Phase.DEAD)
        else:
            self.run(False, self.removed | pending.ranks)

    def refuses(self, removed: frozenset[int]) -> bool:
        everyone = frozenset(range(WORLD))
        return (
            not removed
            or not removed <= everyone
            or RANK in removed
            or not self.removed <= removed
            or removed <= self.removed
            or not REDUNDANCY.survives(removed)
        )

    def run(self, retry: bool, removed: frozenset[int]) -> bool:
        self.attempts += 1
        phase = Phase.RETRYING if retry else Phase.SCALING_DOWN
        self.enter(phase)
        for step in sequence(phase):
            if step.new_epoch:
                self.epoch += 1
            if step.action in self.armed:
                self.armed.discard(step.action)
                self.phase = phase
                self.fault(Fault(FaultKind.RECOVERY_ERROR, info=step.action, at=self.now))
                return False
        self.removed = frozenset(removed)
        self.enter(Phase.HEALTHY)
        return True

    def admit(self, added: frozenset[int]) -> bool:
        """The scale-up sequence; a failed step is a member's fault (a new episode)."""
        self.enter(Phase.SCALING_UP)
        for step in sequence(Phase.SCALING_UP):
            if step.new_epoch:
                self.epoch += 1
            if step.action in self.armed:
                self.armed.discard(step.action)
                self.ready -= added
                self.fault(Fault(FaultKind.RECOVERY_ERROR, info=step.action, at=self.now))
                return False
            if step.commits:
                self.removed -= added
                self.ready -= added
        self.enter(Phase.HEALTHY)
        return True

    def scale_up(self, params: Any) -> tuple[bool, str]:
        if self.phase is not Phase.HEALTHY:
            if self.phase is Phase.RUNNING and not self.removed:
                return False, "has removed no rank"
            return False, "only accepted while HEALTHY"
        keys = {"added_dp_ranks", "removed_dp_ranks", "epoch"}
        if not isinstance(params, dict):
            return False, "params must be a mapping"
        if "added_dp_ranks" not in params or set(params) - keys:
            return False, "scale_up takes params"
        added = params["added_dp_ranks"]
        if not isinstance(added, list) or any(
            not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in added
        ):
            return False, "added_dp_ranks"
        ranks = frozenset(added)
        if (
            not added
            or len(ranks) != len(added)
            or not ranks <= self.removed
            or not ranks <= self.ready
        ):
            return False, "scale_up rejected"
        return (True, "") if self.admit(ranks) else (False, "failed")

    def command(self, instruction: str, params: Any) -> tuple[bool, str]:
        """(success, a text the engine's reason must contain; "" for a success)."""
        self.expire()
        if instruction == "scale_up":
            return self.scale_up(params)
        if instruction not in ("retry", "scale_down"):
            return False, "unknown instruction"
        if self.phase is not Phase.QUARANTINED:
            return False, f"status is {self.phase.health.name}"
        if not isinstance(params, dict):
            return False, "params must be a mapping"
        if instruction == "retry":
            if params:
                return False, "retry takes no params"
            return (True, "") if self.run(True, self.removed) else (False, "failed")
        ranks = params.get("removed_dp_ranks")
        if not isinstance(ranks, list) or set(params) != {"removed_dp_ranks"}:
            return False, "scale_down takes params"
        if self.refuses(frozenset(ranks)):
            return False, "scale_down rejected"
        return (True, "") if self.run(False, frozenset(ranks)) else (False, "failed")


fault_kinds = st.sampled_from(
    [FaultKind.TRANSIENT, FaultKind.DEAD_PEER, FaultKind.DEVICE_ERROR, FaultKind.HUNG_PEER]
)
fault_ranks = st.sampled_from([None, 1, 2, 3, 0])
removed_lists = st.one_of(
    st.lists(st.integers(min_value=0, max_value=WORLD), max_size=3),
    st.integers(min_value=1, max_value=3).map(lambda r: [r]),
)
armable = st.sampled_from([step.action for step in STEPS])


class EngineMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.rig: Rig
        self.model: Model
        self.bound = 0
        self.results: dict[str, CommandResult] = {}
        self.misplaced: list[tuple[str, Phase]] = []
        self.checked_changes = 0
        self.counter = 0

    @initialize(name=st.sampled_from(sorted(POLICIES)))
    def start(self, name: str) -> None:
        policy, self.bound = POLICIES[name]
        self.rig = make_rig(policy, world_size=WORLD, rank=RANK, redundancy=REDUNDANCY)
        self.rig.backend.on_call = self.check_action
        self.model = Model(policy, now=self.rig.clock.now())

    def check_action(self, call: Call) -> None:
        phase = self.rig.engine.phase
        step = STEP.get(call.name)  # the engine only ever calls the step table's actions
        if step is None or phase not in step.runs_in:
            self.misplaced.append((call.name, phase))

    def snapshot(self) -> tuple[object, ...]:
        return (self.rig.engine.status(), self.rig.backend.calls)

    # -- rules ---------------------------------------------------------------------------

    @rule(kind=fault_kinds, rank=fault_ranks)
    def fault(self, kind: FaultKind, rank: int | None) -> None:
        fault = Fault(kind, rank=rank, info=kind.name)
        self.rig.engine.report_fault(fault)
        self.model.fault(attrs.evolve(fault, at=self.model.now))

    @rule(action=armable)
    def arm_backend_failure(self, action: str) -> None:
        self.rig.backend.fail_on(action)
        self.model.armed.add(action)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.0, 5.0, 15.0]))
    def tick(self, dt: float) -> None:
        self.rig.clock.advance(dt)
        self.model.now += dt
        self.rig.engine.poll()
        self.model.poll()

    @rule(dt=st.sampled_from([1.0, 15.0]))
    def stall(self, dt: float) -> None:
        """Time passes without a poll (the host loop is busy)."""
        self.rig.clock.advance(dt)
        self.model.now += dt

    @rule(target=requests)
    def retry(self) -> str:
        return self.command("retry", {})

    @rule(target=requests, removed=removed_lists)
    def scale_down(self, removed: list[int]) -> str:
        return self.command("scale_down", {"removed_dp_ranks": removed})

    @rule(ranks=st.sets(st.integers(min_value=0, max_value=WORLD - 1), max_size=2))
    def report_ready(self, ranks: set[int]) -> None:
        """The host's word on which returning ranks are loaded and wait."""
        self.rig.engine.note_ready(frozenset(ranks))
        self.model.ready = frozenset(ranks)

    @rule(target=requests, added=removed_lists)
    def scale_up(self, added: list[int]) -> str:
        return self.command("scale_up", {"added_dp_ranks": added})

    @rule(
        target=requests,
        instruction=st.sampled_from(["retry", "scale_down", "scale_up", "restart", ""]),
        params=st.sampled_from([{"x": 1}, {"removed_dp_ranks": "3"}, {}, [3]]),
    )
    def malformed(self, instruction: str, params: Any) -> str:
        return self.command(instruction, params)

    @rule(request_id=requests)
    def replay(self, request_id: str) -> None:
        before = self.snapshot()
        result = self.rig.engine.apply("retry", {}, request_id)
        assert result == self.results[request_id]
        assert self.snapshot() == before, "a replayed request acted again"

    def command(self, instruction: str, params: Any) -> str:
        self.counter += 1
        request_id = f"req-{self.counter}"
        ready = self.model.phase is Phase.HEALTHY and instruction == "scale_up"
        serving = self.model.phase is not Phase.QUARANTINED and not ready
        before = self.snapshot()
        result = self.rig.engine.apply(instruction, params, request_id)
        success, expected = self.model.command(instruction, params)
        assert (result.request_id, result.success) == (request_id, success), result
        assert expected in (result.reason or ""), (expected, result.reason)
        if serving:
            assert result.reason and self.snapshot() == before, "a rejection changed state"
        self.results[request_id] = result
        return request_id

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def engine_matches_model(self) -> None:
        status = self.rig.engine.status()
        model = self.model
        assert status.phase is model.phase, (status.phase, model.phase)
        assert (status.removed_ranks, status.epoch) == (model.removed, model.epoch)
        assert status.attempts == model.attempts <= self.bound
        assert status.status is status.phase.health
        assert (status.phase is Phase.DEAD) <= bool(status.ft_error)

    @invariant()
    def every_change_is_a_table_row(self) -> None:
        changes = self.rig.changes
        previous = changes[self.checked_changes - 1].dest if self.checked_changes else Phase.RUNNING
        for change in changes[self.checked_changes :]:
            assert change.source is previous and change.dest in successors(change.source)
            assert previous is not Phase.DEAD, "dead must absorb"
            previous = change.dest
        self.checked_changes = len(changes)

    @invariant()
    def backend_actions_only_run_where_allowed(self) -> None:
        assert not self.misplaced, self.misplaced

    def teardown(self) -> None:
        """Every episode ends, healthy or dead, within a bounded number of polls: each
        poll runs at most one recovery or admission, an episode starts at most ``bound``
        recoveries, and an admission that fails (each armed failure fires once) opens one
        more episode, so one episode's polls per armed failure, plus the admission's own."""
        if not hasattr(self, "rig"):
            return
        armed_at_most = len(STEPS)
        for _ in range((self.bound + 1) * (armed_at_most + 2)):
            self.rig.clock.advance(100.0)
            self.rig.engine.poll()
        phase = self.rig.engine.phase
        assert phase.serving or phase is Phase.DEAD, phase
        assert not self.misplaced, self.misplaced


# The dev profile keeps its own small budget; every other profile (ci included) runs 500.
_DEV = settings.get_current_profile_name() == "dev"
EngineMachine.TestCase.settings = settings(
    max_examples=settings().max_examples if _DEV else 500,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEngineStateful = EngineMachine.TestCase
