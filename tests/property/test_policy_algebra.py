"""Properties of the policy algebra and the built-in policies."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ftengine.context import RecoveryContext
from ftengine.faults import FaultKind
from ftengine.policies import (
    AllOf,
    AutoRecovery,
    Decision,
    ExponentialBackoff,
    FirstOf,
    FlapGuard,
    GiveUp,
    MaxAttempts,
    OrchestratorDriven,
    RecoveryDeadline,
    ScaleDown,
    escalation,
    merge,
)
from tests.strategies import Constant, constant_policies, contexts, decisions

policy_lists = st.lists(constant_policies, min_size=1, max_size=6)


@given(constant_policies, constant_policies, constant_policies)
def test_or_and_and_flatten_whatever_the_grouping(a: Constant, b: Constant, c: Constant) -> None:
    assert (a | b) | c == a | (b | c) == FirstOf((a, b, c))
    assert (a & b) & c == a & (b & c) == AllOf((a, b, c))


@given(policy_lists, contexts())
def test_or_returns_the_first_opinion(policies: list[Constant], ctx: RecoveryContext) -> None:
    opinions = [p.decision for p in policies if p.decision is not None]
    assert FirstOf.of(*policies)(ctx) == (opinions[0] if opinions else None)


@given(policy_lists, contexts())
def test_and_returns_the_most_escalated_opinion(
    policies: list[Constant], ctx: RecoveryContext
) -> None:
    opinions = [p.decision for p in policies if p.decision is not None]
    result = AllOf.of(*policies)(ctx)
    if not opinions:
        assert result is None
        return
    assert result is not None
    assert escalation(result) == max(escalation(d) for d in opinions)
    if any(isinstance(d, GiveUp) for d in opinions):
        assert result == next(d for d in opinions if isinstance(d, GiveUp))


@given(decisions, decisions)
def test_merge_is_commutative_up_to_give_up_reasons(a: Decision, b: Decision) -> None:
    if isinstance(a, GiveUp) and isinstance(b, GiveUp):
        assert merge(a, b) == a and merge(b, a) == b
    else:
        assert merge(a, b) == merge(b, a)


@given(decisions, decisions, decisions)
def test_merge_is_associative(a: Decision, b: Decision, c: Decision) -> None:
    assert merge(merge(a, b), c) == merge(a, merge(b, c))


@given(constant_policies, contexts())
def test_an_abstaining_policy_is_neutral(policy: Constant, ctx: RecoveryContext) -> None:
    abstain = Constant(None)
    for combined in (policy | abstain, abstain | policy, policy & abstain, abstain & policy):
        assert combined(ctx) == policy(ctx)


@given(
    st.floats(min_value=1e-3, max_value=10.0),
    st.floats(min_value=1.0, max_value=10.0),
    st.floats(min_value=0.0, max_value=1e3),
    st.floats(min_value=0.0, max_value=1.0),
    st.integers(min_value=0, max_value=2**32),
    st.integers(min_value=0, max_value=10_000),
)
def test_backoff_is_non_decreasing_capped_and_jitter_stays_in_bounds(
    base: float, factor: float, extra: float, jitter: float, seed: int, attempt: int
) -> None:
    backoff = ExponentialBackoff(
        base=base, factor=factor, cap=base + extra, jitter=jitter, seed=seed
    )
    delay, following = backoff.delay(attempt), backoff.delay(attempt + 1)
    assert base <= delay <= following <= backoff.cap
    drawn = backoff.jittered(attempt)
    assert delay * (1 - jitter) - 1e-12 <= drawn <= delay
    assert drawn == backoff.jittered(attempt)


@given(st.integers(min_value=1, max_value=10), contexts())
def test_max_attempts_gives_up_exactly_at_the_bound(bound: int, ctx: RecoveryContext) -> None:
    decision = MaxAttempts(bound)(ctx)
    assert isinstance(decision, GiveUp) == (ctx.attempts >= bound)
    assert decision is None or isinstance(decision, GiveUp)


BUILT_INS = [
    OrchestratorDriven(),
    AutoRecovery(),
    AutoRecovery(retry_during_recovery=True, max_attempts=5),
    MaxAttempts(2),
    RecoveryDeadline(30.0),
    ExponentialBackoff(),
    FlapGuard(2, 60.0),
]


@given(contexts())
def test_built_ins_decide_any_context_without_raising(ctx: RecoveryContext) -> None:
    for policy in BUILT_INS:
        decision = policy(ctx)
        if isinstance(decision, ScaleDown):
            assert ctx.rank not in decision.ranks
            assert ctx.redundancy_allows(ctx.removed_ranks | decision.ranks)


@given(contexts())
def test_faults_during_recovery_are_fatal_only_once_the_attempts_are_spent(
    ctx: RecoveryContext,
) -> None:
    for policy in (OrchestratorDriven(), AutoRecovery()):
        if ctx.in_recovery and ctx.fault.kind is not FaultKind.SELF_DEAD:
            spent = ctx.attempts >= 3
            dead_self = ctx.rank in ctx.dead_ranks and isinstance(policy, AutoRecovery)
            assert isinstance(policy(ctx), GiveUp) == (spent or dead_self), (policy, ctx)
    told = AutoRecovery(retry_during_recovery=False)
    assert isinstance(told(ctx), GiveUp) or not ctx.in_recovery
    once = OrchestratorDriven(max_attempts=1)
    assert isinstance(once(ctx), GiveUp) or not ctx.in_recovery or ctx.attempts < 1
