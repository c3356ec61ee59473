"""The policy protocol and its algebra: ``a | b`` (first opinion wins) and ``a & b`` (all are
asked, the most escalated decision wins). Both flatten; plain callables are policies too.

A policy may also answer the admission question (``admit(AdmissionContext) -> ScaleUp |
None``: bring ready removed ranks back without a command). ``a | b`` asks in order and the
first opinion wins; ``a & b`` admits only what every member with an opinion admits. A
policy without ``admit`` abstains: the ranks wait for an orchestrator's ``scale_up``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from ftengine.context import AdmissionContext, RecoveryContext
from ftengine.errors import ConfigError
from ftengine.policies.decisions import DECISION_TYPES, Decision, GiveUp, ScaleUp, strictest

logger = logging.getLogger(__name__)


class Policy(Protocol):
    """Anything that maps a context to a decision, or to ``None`` to abstain."""

    def __call__(self, ctx: RecoveryContext, /) -> Decision | None: ...


class Admitter(Protocol):
    """A policy that decides about removed ranks that are ready to come back."""

    def admit(self, ctx: AdmissionContext, /) -> ScaleUp | None: ...


def ask_admit(policy: object, ctx: AdmissionContext) -> ScaleUp | None:
    """``policy.admit(ctx)`` if the policy has one, else ``None`` (it abstains)."""
    admit = getattr(policy, "admit", None)
    if not callable(admit):
        return None
    decision = admit(ctx)
    if decision is not None and not isinstance(decision, ScaleUp):
        raise TypeError(f"{policy!r}.admit returned {decision!r}; expected ScaleUp or None")
    return decision


class NotAPolicyError(ConfigError, TypeError):
    """Something that is not callable was used where a policy is expected."""


class Composable:
    """Mixin giving a policy the ``|`` and ``&`` operators."""

    __slots__ = ()

    if TYPE_CHECKING:
        # Every subclass is a policy; saying so here lets the operators pass ``self`` on.
        def __call__(self, ctx: RecoveryContext, /) -> Decision | None: ...

    def __or__(self, other: Policy) -> FirstOf:
        return FirstOf.of(self, other)

    def __ror__(self, other: Policy) -> FirstOf:
        return FirstOf.of(other, self)

    def __and__(self, other: Policy) -> AllOf:
        return AllOf.of(self, other)

    def __rand__(self, other: Policy) -> AllOf:
        return AllOf.of(other, self)


def _all_callable(
    instance: object, attribute: attrs.Attribute[Any], value: tuple[Any, ...]
) -> None:
    if not value:
        raise ConfigError(f"{type(instance).__name__} needs at least one policy")
    for policy in value:
        if not callable(policy):
            raise NotAPolicyError(
                f"{type(instance).__name__} expected policies (callables ctx -> Decision | None),"
                f" got {policy!r}"
            )


def _flatten(kind: type[Any], policies: tuple[Policy, ...]) -> tuple[Policy, ...]:
    flat: list[Policy] = []
    for policy in policies:
        flat.extend(policy.policies if isinstance(policy, kind) else (policy,))
    return tuple(flat)


@attrs.frozen
class FirstOf(Composable):
    """``a | b | ...``: ask in order; the first policy that does not abstain decides."""

    policies: tuple[Policy, ...] = attrs.field(validator=_all_callable)

    @classmethod
    def of(cls, *policies: Policy) -> FirstOf:
        """Build from ``policies``, splicing in the members of nested ``FirstOf`` instances."""
        return cls(_flatten(cls, policies))

    def __call__(self, ctx: RecoveryContext, /) -> Decision | None:
        for policy in self.policies:
            decision = policy(ctx)
            if decision is not None:
                return decision
        return None

    def admit(self, ctx: AdmissionContext, /) -> ScaleUp | None:
        """The first member's admission that is not an abstention."""
        for policy in self.policies:
            decision = ask_admit(policy, ctx)
            if decision is not None:
                return decision
        return None


@attrs.frozen
class AllOf(Composable):
    """``a & b & ...``: ask every policy; the most escalated decision wins (see ``merge``)."""

    policies: tuple[Policy, ...] = attrs.field(validator=_all_callable)

    @classmethod
    def of(cls, *policies: Policy) -> AllOf:
        """Build from ``policies``, splicing in the members of nested ``AllOf`` instances."""
        return cls(_flatten(cls, policies))

    def __call__(self, ctx: RecoveryContext, /) -> Decision | None:
        return strictest(policy(ctx) for policy in self.policies)

    def admit(self, ctx: AdmissionContext, /) -> ScaleUp | None:
        """What every member with an opinion admits (their intersection); None if none
        has one or they share no rank."""
        opinions = [d for d in (ask_admit(p, ctx) for p in self.policies) if d is not None]
        if not opinions:
            return None
        ranks = frozenset.intersection(*(d.ranks for d in opinions))
        return ScaleUp(ranks) if ranks else None


@attrs.frozen
class FromCallable(Composable):
    """A plain function lifted into a composable policy (``as_policy(fn) | other``)."""

    func: Policy = attrs.field()

    @func.validator
    def _check(self, attribute: attrs.Attribute[Any], value: object) -> None:
        _all_callable(self, attribute, (value,))

    def __call__(self, ctx: RecoveryContext, /) -> Decision | None:
        return self.func(ctx)

    def admit(self, ctx: AdmissionContext, /) -> ScaleUp | None:
        """The wrapped callable's ``admit``, if it has one."""
        return ask_admit(self.func, ctx)


def as_policy(policy: Policy) -> Composable:
    """``policy`` itself when it already composes, else wrapped in ``FromCallable``."""
    return policy if isinstance(policy, Composable) else FromCallable(policy)


def decide(policy: Policy, ctx: RecoveryContext) -> Decision:
    """Ask ``policy`` and always get a decision back.

    Abstention becomes ``GiveUp`` (nothing left to try). A policy that raises or returns a
    non-decision also becomes ``GiveUp`` with the error in the reason: the caller is a
    watchdog thread in the middle of a fault, where a policy bug must end the episode
    visibly (status ``dead`` with the reason) rather than escape into that thread.
    """
    try:
        decision = policy(ctx)
    except Exception as exc:
        logger.exception("policy %r raised while deciding on %r", policy, ctx.fault)
        return GiveUp(f"policy raised {type(exc).__name__}: {exc}")
    if decision is None:
        return GiveUp(
            f"no policy decision for a {ctx.fault.kind.value} fault in phase {ctx.phase.value}"
        )
    if not isinstance(decision, DECISION_TYPES):
        return GiveUp(f"policy returned {decision!r}; expected a Decision or None")
    return decision


def decide_admission(policy: object, ctx: AdmissionContext) -> ScaleUp | None:
    """Ask ``policy`` whether to admit ready removed ranks; ``None`` means wait for a
    command. Only ranks in ``ctx.ready_ranks`` are ever admitted (the rest of a decision
    is dropped). A policy that raises or answers something else is logged and abstains:
    a policy bug must not take a serving worker down."""
    try:
        decision = ask_admit(policy, ctx)
    except Exception:
        logger.exception("policy %r raised while deciding on ready ranks %s", policy, ctx)
        return None
    if decision is None:
        return None
    ranks = decision.ranks & ctx.ready_ranks & ctx.removed_ranks
    return ScaleUp(ranks) if ranks else None
