"""Decisions and the policy algebra (the name registry: ``test_policies_registry``)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from ftengine.context import RecoveryContext
from ftengine.errors import ConfigError
from ftengine.faults import Fault, FaultKind, Phase
from ftengine.policies import (
    AllOf,
    Decision,
    FirstOf,
    FromCallable,
    GiveUp,
    MaxAttempts,
    NotAPolicyError,
    Retry,
    ScaleDown,
    WaitForOrchestrator,
    as_policy,
    decide,
    describe,
    merge,
)
from tests.strategies import Constant


def ctx(**changes: Any) -> RecoveryContext:
    base = RecoveryContext(
        fault=Fault(FaultKind.TRANSIENT, rank=1, at=10.0),
        phase=Phase.RUNNING,
        now=10.0,
        episode_start=10.0,
        world_size=4,
    )
    return attrs.evolve(base, **changes)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Retry(-1.0), "Retry.after must be finite seconds >= 0"),
        (lambda: Retry(float("nan")), "Retry.after"),
        (lambda: ScaleDown(frozenset()), "ScaleDown.ranks must name at least one rank"),
        (lambda: ScaleDown(3), "expected an iterable of DP ranks"),
        (lambda: ScaleDown({-2}), "ScaleDown.ranks must hold DP ranks"),
        (lambda: WaitForOrchestrator(float("inf")), "must be a finite number"),
        (lambda: GiveUp(" "), "GiveUp.reason must be a non-empty string"),
    ],
)
def test_invalid_decisions_fail_at_construction(build: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", "\\(")):
        build()  # type: ignore[operator]


def test_decision_reprs_are_valid_python() -> None:
    for decision in (Retry(1.5), ScaleDown([2, 3]), WaitForOrchestrator(7.0), GiveUp("x")):
        assert eval(repr(decision)) == decision


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        (Retry(1.0), Retry(3.0), Retry(3.0)),
        (Retry(9.0), ScaleDown({1}), ScaleDown({1})),
        (ScaleDown({1}), ScaleDown({2}), ScaleDown({1, 2})),
        (ScaleDown({1}), WaitForOrchestrator(5.0), WaitForOrchestrator(5.0)),
        (WaitForOrchestrator(5.0), WaitForOrchestrator(3.0), WaitForOrchestrator(3.0)),
        (WaitForOrchestrator(5.0), GiveUp("b"), GiveUp("b")),
        (GiveUp("a"), GiveUp("b"), GiveUp("a")),
    ],
)
def test_merge_takes_the_more_escalated_decision(
    first: Decision, second: Decision, expected: Decision
) -> None:
    assert merge(first, second) == expected


def test_or_asks_in_order_and_the_first_opinion_wins() -> None:
    policy = Constant(None) | Constant(Retry(1.0)) | Constant(GiveUp("late"))
    assert isinstance(policy, FirstOf) and len(policy.policies) == 3
    assert policy(ctx()) == Retry(1.0)


def test_and_asks_everyone_and_escalates() -> None:
    policy = Constant(Retry(1.0)) & Constant(None) & Constant(Retry(2.0))
    assert isinstance(policy, AllOf) and len(policy.policies) == 3
    assert policy(ctx()) == Retry(2.0)
    assert (policy & Constant(GiveUp("stop")))(ctx()) == GiveUp("stop")


def test_mixed_operators_keep_their_grouping() -> None:
    a, b, c = Constant(None), Constant(Retry(1.0)), Constant(GiveUp("c"))
    policy = a | (b & c)
    assert policy == FirstOf((a, AllOf((b, c))))
    assert policy(ctx()) == GiveUp("c")


def test_plain_callables_compose_on_either_side() -> None:
    def retry_now(context: RecoveryContext) -> Decision | None:
        return Retry(0.0)

    left = retry_now | MaxAttempts(1)
    right = MaxAttempts(1) | retry_now
    assert left == FirstOf((retry_now, MaxAttempts(1)))
    assert right == FirstOf((MaxAttempts(1), retry_now))
    assert right(ctx(attempts=1)) == GiveUp(right(ctx(attempts=1)).reason)  # type: ignore[union-attr]
    assert right(ctx(attempts=0)) == Retry(0.0)
    lifted = as_policy(retry_now)
    assert isinstance(lifted, FromCallable) and (lifted & Constant(None))(ctx()) == Retry(0.0)
    assert as_policy(left) is left


def test_non_callables_are_not_policies() -> None:
    with pytest.raises(NotAPolicyError, match="got 'auto'"):
        MaxAttempts(1) | "auto"  # type: ignore[operator]
    with pytest.raises(TypeError):
        FirstOf((MaxAttempts(1), 3))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="at least one policy"):
        AllOf(())


def test_decide_never_returns_nothing() -> None:
    assert decide(Constant(None), ctx()) == GiveUp(
        "no policy decision for a transient fault in phase running"
    )
    assert decide(lambda c: "retry", ctx()) == GiveUp(  # type: ignore[arg-type]
        "policy returned 'retry'; expected a Decision or None"
    )
    assert decide(Constant(Retry(1.0)), ctx()) == Retry(1.0)


def test_describe_is_short_text() -> None:
    assert describe(Retry(0.5)) == "retry after 0.5s"
    assert describe(ScaleDown({3, 1})) == "scale down ranks [1, 3]"
    assert describe(GiveUp("why")) == "give up: why"
