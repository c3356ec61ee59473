"""The built-in policies. Each is a frozen value with one ``__call__(ctx) -> Decision | None``;
``None`` abstains, so limits compose in front: ``MaxAttempts(3) | AutoRecovery()``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable

import attrs

from ftengine.context import AdmissionContext, RecoveryContext
from ftengine.errors import ConfigError
from ftengine.faults import FaultKind, fault_text
from ftengine.policies.algebra import Composable
from ftengine.policies.decisions import (
    Decision,
    GiveUp,
    Retry,
    ScaleDown,
    ScaleUp,
    WaitForOrchestrator,
)
from ftengine.validators import finite_float, fraction, int_at_least, seconds

DEFAULT_RETRY_KINDS = frozenset({FaultKind.TRANSIENT, FaultKind.HUNG_PEER, FaultKind.DEVICE_ERROR})


def _fault_kinds(kinds: Iterable[FaultKind]) -> frozenset[FaultKind]:
    try:
        return frozenset(FaultKind(kind) for kind in kinds)
    except (TypeError, ValueError) as exc:
        known = [k.value for k in FaultKind]
        raise ConfigError(f"retry_kinds must be fault kinds from {known}, got {kinds!r}") from exc


def _recovery_fault(ctx: RecoveryContext) -> GiveUp:
    return GiveUp(
        f"{fault_text(ctx.fault)} during {ctx.phase.value}: a fault during recovery is fatal "
        "(retry_during_recovery=False)"
    )


def _recovery_attempts_spent(ctx: RecoveryContext, max_attempts: int) -> GiveUp:
    return GiveUp(
        f"{fault_text(ctx.fault)} during {ctx.phase.value}, after {ctx.attempts} recovery "
        f"attempts (max_attempts={max_attempts})"
    )


@attrs.frozen
class OrchestratorDriven(Composable):
    """vLLM's behaviour: wait up to ``recovery_timeout`` s from the first fault for a command.

    A fault during a recovery (a step that failed, a peer lost during the rebuild) waits for
    the next command too, as vLLM keeps an engine whose command failed UNHEALTHY with its
    ``ft_error``: the orchestrator may retry or scale down again, up to ``max_attempts``
    recoveries in one episode; after that, or on this worker's own death, it gives up.
    """

    recovery_timeout: float = attrs.field(default=120.0, validator=seconds(positive=True))
    max_attempts: int = attrs.field(default=3, validator=int_at_least(1))

    def __call__(self, ctx: RecoveryContext, /) -> Decision | None:
        if ctx.fault.kind is FaultKind.SELF_DEAD:
            return GiveUp(f"{fault_text(ctx.fault)}: this worker's process is gone")
        if ctx.in_recovery and ctx.attempts >= self.max_attempts:
            return _recovery_attempts_spent(ctx, self.max_attempts)
        return WaitForOrchestrator(ctx.episode_start + self.recovery_timeout)


@attrs.frozen
class AutoRecovery(Composable):
    """Recover without an orchestrator.

    Confirmed dead peers (``ctx.dead_ranks``) are scaled down when redundancy allows (or
    is unknown); faults of ``retry_kinds`` are retried after ``retry_delay`` s, and so is a
    fault during a recovery (a failed step: the recovery runs again, bounded). Gives up
    after ``max_attempts`` recoveries in one episode and, with
    ``retry_during_recovery=False``, on any fault during a recovery. Abstains when it cannot
    act (dead peers the survivors cannot absorb, unknown dead ranks), so
    ``AutoRecovery() | OrchestratorDriven()`` hands those cases to the orchestrator.

    With ``admit_ready`` (the default) it also admits every removed rank that reported
    ready (``admit``), so a repaired rank comes back without a ``scale_up`` command.
    """

    max_attempts: int = attrs.field(default=3, validator=int_at_least(1))
    retry_delay: float = attrs.field(default=0.0, validator=seconds())
    retry_during_recovery: bool = True
    retry_kinds: frozenset[FaultKind] = attrs.field(
        default=DEFAULT_RETRY_KINDS, converter=_fault_kinds
    )
    admit_ready: bool = True

    def admit(self, ctx: AdmissionContext, /) -> ScaleUp | None:
        """Admit every ready removed rank (``admit_ready``); else abstain."""
        ready = ctx.ready_ranks & ctx.removed_ranks
        return ScaleUp(ready) if self.admit_ready and ready else None

    def __call__(self, ctx: RecoveryContext, /) -> Decision | None:
        kind = ctx.fault.kind
        if kind is FaultKind.SELF_DEAD or ctx.rank in ctx.dead_ranks:
            return GiveUp(f"{fault_text(ctx.fault)}: this worker's rank {ctx.rank} is dead")
        if ctx.in_recovery and not self.retry_during_recovery:
            return _recovery_fault(ctx)
        if ctx.attempts >= self.max_attempts:
            return GiveUp(f"{fault_text(ctx.fault)} after {ctx.attempts} recovery attempts")
        if ctx.dead_ranks:
            if ctx.redundancy_allows(ctx.removed_ranks | ctx.dead_ranks):
                return ScaleDown(ctx.dead_ranks)
            return None
        if kind in self.retry_kinds or kind is FaultKind.RECOVERY_ERROR:
            return Retry(self.retry_delay)
        return None


@attrs.frozen
class MaxAttempts(Composable):
    """Give up once ``attempts`` recoveries have been started in this episode; else abstain."""

    attempts: int = attrs.field(validator=int_at_least(1))

    def __call__(self, ctx: RecoveryContext, /) -> Decision | None:
        if ctx.attempts >= self.attempts:
            return GiveUp(
                f"{fault_text(ctx.fault)} after {ctx.attempts} recovery attempts "
                f"(MaxAttempts({self.attempts}))"
            )
        return None


@attrs.frozen
class RecoveryDeadline(Composable):
    """Give up when the episode has lasted ``seconds`` or more; else abstain."""

    seconds: float = attrs.field(validator=seconds(positive=True))

    def __call__(self, ctx: RecoveryContext, /) -> Decision | None:
        if ctx.elapsed >= self.seconds:
            return GiveUp(
                f"{fault_text(ctx.fault)} {ctx.elapsed:g}s into the episode "
                f"(RecoveryDeadline({self.seconds:g}))"
            )
        return None


@attrs.frozen
class ExponentialBackoff(Composable):
    """Always ``Retry(after)`` with ``after = min(cap, base * factor**attempts)`` shrunk by
    a jitter of up to ``jitter`` (a fraction) that depends only on ``(seed, attempts)``.

    Meant for ``&``: ``AutoRecovery() & ExponentialBackoff()`` delays AutoRecovery's
    retries; a more escalated decision from the other side still wins.
    """

    base: float = attrs.field(default=0.5, validator=seconds(positive=True))
    factor: float = attrs.field(default=2.0, validator=finite_float())
    cap: float = attrs.field(default=30.0, validator=seconds(positive=True))
    jitter: float = attrs.field(default=0.1, validator=fraction())
    seed: int = attrs.field(default=0, validator=int_at_least(0))

    def __attrs_post_init__(self) -> None:
        if self.factor < 1:
            raise ConfigError(f"ExponentialBackoff.factor must be >= 1, got {self.factor!r}")
        if self.cap < self.base:
            raise ConfigError(
                f"ExponentialBackoff.cap ({self.cap!r}) must be >= base ({self.base!r})"
            )

    def delay(self, attempt: int) -> float:
        """The un-jittered delay in seconds before retry number ``attempt`` (0-based)."""
        if attempt <= 0 or self.factor == 1:
            return self.base
        # Compare exponents rather than computing factor**attempt, which overflows.
        if attempt * math.log(self.factor) >= math.log(self.cap / self.base):
            return self.cap
        return min(self.cap, self.base * self.factor**attempt)

    def jittered(self, attempt: int) -> float:
        """``delay(attempt) * (1 - jitter * u)`` with ``u`` in [0, 1) drawn from (seed, attempt)."""
        draw = random.Random(f"{self.seed}:{attempt}").random()
        return self.delay(attempt) * (1.0 - self.jitter * draw)

    def __call__(self, ctx: RecoveryContext, /) -> Decision | None:
        return Retry(self.jittered(ctx.attempts))


@attrs.frozen
class FlapGuard(Composable):
    """A rank that faulted ``k`` times within ``window`` s is treated as dead: scale it
    down (or give up if redundancy cannot absorb it, if it is this worker, or if this
    worker is itself confirmed dead); else abstain.
    """

    k: int = attrs.field(validator=int_at_least(1))
    window: float = attrs.field(validator=seconds(positive=True))

    def __call__(self, ctx: RecoveryContext, /) -> Decision | None:
        rank = ctx.fault.rank
        if rank is None or rank in ctx.removed_ranks:
            return None
        count = len(ctx.faults_of(rank, since=ctx.now - self.window))
        if count < self.k:
            return None
        flapping = f"rank {rank} faulted {count} times within {self.window:g}s"
        if rank == ctx.rank:
            return GiveUp(f"{flapping}: this worker flaps")
        if ctx.rank in ctx.dead_ranks:  # a scale-down may never name this worker
            return GiveUp(f"{flapping}, but this worker's rank {ctx.rank} is dead")
        dead = ctx.dead_ranks | {rank}
        if not ctx.redundancy_allows(ctx.removed_ranks | dead):
            return GiveUp(f"{flapping}, but the survivors cannot host every expert without it")
        return ScaleDown(dead)
