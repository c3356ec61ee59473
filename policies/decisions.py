"""The four decisions a policy can return about a fault, and how ``&`` merges them
(escalation order); and ``ScaleUp``, the one decision about a removed rank that is ready
to come back (asked through a policy's ``admit``, never about a fault).

Escalation, least to most: ``Retry`` < ``ScaleDown`` < ``WaitForOrchestrator`` < ``GiveUp``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeAlias

import attrs

from ftengine.errors import ConfigError
from ftengine.validators import finite_float, rank_set, seconds, to_ranks


@attrs.frozen
class Retry:
    """Retry the same topology ``after`` seconds from now (clean, reset, rebuild, validate)."""

    after: float = attrs.field(default=0.0, validator=seconds())


@attrs.frozen
class ScaleDown:
    """Remove ``ranks`` (original DP ranks; unioned with those already removed) and go on."""

    ranks: frozenset[int] = attrs.field(converter=to_ranks, validator=rank_set(non_empty=True))


@attrs.frozen
class WaitForOrchestrator:
    """Wait for an orchestrator command until ``deadline`` (engine clock, monotonic s), then die."""

    deadline: float = attrs.field(validator=finite_float())


def _reason(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"GiveUp.reason must be a non-empty string, got {value!r}")


@attrs.frozen
class GiveUp:
    """Stop recovering: the engine goes to ``dead`` and records ``reason``."""

    reason: str = attrs.field(validator=_reason)


@attrs.frozen
class ScaleUp:
    """Admit ``ranks`` (removed original DP ranks that reported ready) back, now."""

    ranks: frozenset[int] = attrs.field(converter=to_ranks, validator=rank_set(non_empty=True))


Decision: TypeAlias = Retry | ScaleDown | WaitForOrchestrator | GiveUp
DECISION_TYPES = (Retry, ScaleDown, WaitForOrchestrator, GiveUp)


def escalation(decision: Decision) -> int:
    """The decision's rank in the escalation order (0 = ``Retry`` .. 3 = ``GiveUp``)."""
    return DECISION_TYPES.index(type(decision))


def merge(first: Decision, second: Decision) -> Decision:
    """Combine two decisions as ``&`` does: the more escalated wins; equals merge.

    Equal kinds merge to the strictest common value: ``Retry`` waits the longer delay,
    ``ScaleDown`` removes the union, ``WaitForOrchestrator`` keeps the earlier deadline,
    ``GiveUp`` keeps the first reason.
    """
    if escalation(first) != escalation(second):
        return first if escalation(first) > escalation(second) else second
    if isinstance(first, Retry) and isinstance(second, Retry):
        return Retry(max(first.after, second.after))
    if isinstance(first, ScaleDown) and isinstance(second, ScaleDown):
        return ScaleDown(first.ranks | second.ranks)
    if isinstance(first, WaitForOrchestrator) and isinstance(second, WaitForOrchestrator):
        return WaitForOrchestrator(min(first.deadline, second.deadline))
    return first


def strictest(decisions: Iterable[Decision | None]) -> Decision | None:
    """Merge every non-``None`` decision (see ``merge``); ``None`` when all abstained."""
    result: Decision | None = None
    for decision in decisions:
        if decision is not None:
            result = decision if result is None else merge(result, decision)
    return result


def describe(decision: Decision | ScaleUp) -> str:
    """A short human text for logs and timelines, e.g. ``retry after 0.5s``."""
    if isinstance(decision, ScaleUp):
        return f"scale up ranks {sorted(decision.ranks)}"
    if isinstance(decision, Retry):
        return f"retry after {decision.after:g}s"
    if isinstance(decision, ScaleDown):
        return f"scale down ranks {sorted(decision.ranks)}"
    if isinstance(decision, WaitForOrchestrator):
        return f"wait for the orchestrator until t={decision.deadline:g}s"
    return f"give up: {decision.reason}"
