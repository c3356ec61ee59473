"""The built-in policies, one behaviour per test."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from ftengine.context import RecoveryContext, RedundancyFacts
from ftengine.errors import ConfigError
from ftengine.faults import Fault, FaultKind, Phase
from ftengine.policies import (
    AutoRecovery,
    ExponentialBackoff,
    FlapGuard,
    GiveUp,
    MaxAttempts,
    OrchestratorDriven,
    RecoveryDeadline,
    Retry,
    ScaleDown,
    WaitForOrchestrator,
)

ENOUGH = RedundancyFacts(ep_size=4, local_slots=3, num_logical=8)  # survives one dead rank


def ctx(
    kind: FaultKind = FaultKind.TRANSIENT, rank: int | None = 1, **changes: Any
) -> RecoveryContext:
    fault = Fault(kind, rank=rank, info="X", at=50.0)
    base = RecoveryContext(
        fault=fault,
        phase=Phase.RUNNING,
        now=50.0,
        episode_start=40.0,
        faults=(fault,),
        world_size=4,
    )
    return attrs.evolve(base, **changes)


def _reason(decision: object) -> str:
    assert isinstance(decision, GiveUp), decision
    return decision.reason


class TestOrchestratorDriven:
    def test_waits_until_the_episode_start_plus_the_timeout(self) -> None:
        assert OrchestratorDriven(30.0)(ctx()) == WaitForOrchestrator(70.0)
        assert OrchestratorDriven()(ctx(phase=Phase.QUARANTINED)) == WaitForOrchestrator(160.0)

    @pytest.mark.parametrize("phase", [Phase.RETRYING, Phase.SCALING_DOWN])
    def test_a_fault_during_recovery_waits_for_the_next_command_bounded(self, phase: Phase) -> None:
        # vLLM keeps an engine whose command failed UNHEALTHY: the orchestrator may try again
        failed = ctx(FaultKind.RECOVERY_ERROR, None, phase=phase, attempts=1)
        assert OrchestratorDriven(30.0)(failed) == WaitForOrchestrator(70.0)
        spent = attrs.evolve(failed, attempts=3)
        reason = _reason(OrchestratorDriven()(spent))
        assert reason == f"recovery_error fault (X) during {phase.value}, after 3 recovery " + (
            "attempts (max_attempts=3)"
        )
        assert OrchestratorDriven(max_attempts=4)(spent) == WaitForOrchestrator(160.0)

    def test_a_dead_worker_gives_up(self) -> None:
        assert "process is gone" in _reason(OrchestratorDriven()(ctx(FaultKind.SELF_DEAD)))

    @pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), "120"])
    def test_the_timeout_must_be_positive_seconds(self, timeout: object) -> None:
        with pytest.raises(ConfigError, match="recovery_timeout must be finite seconds > 0"):
            OrchestratorDriven(timeout)  # type: ignore[arg-type]


class TestAutoRecovery:
    @pytest.mark.parametrize(
        "kind", [FaultKind.TRANSIENT, FaultKind.HUNG_PEER, FaultKind.DEVICE_ERROR]
    )
    def test_retries_retryable_faults(self, kind: FaultKind) -> None:
        assert AutoRecovery(retry_delay=0.5)(ctx(kind)) == Retry(0.5)

    def test_scales_down_confirmed_dead_ranks_when_redundancy_allows(self) -> None:
        decide = AutoRecovery()
        dead = ctx(FaultKind.DEAD_PEER, 2, dead_ranks={2}, redundancy=ENOUGH)
        assert decide(dead) == ScaleDown({2})
        unknown = attrs.evolve(dead, redundancy=None)
        assert decide(unknown) == ScaleDown({2})

    def test_abstains_when_survivors_cannot_absorb_the_dead(self) -> None:
        two_dead = ctx(FaultKind.DEAD_PEER, 2, dead_ranks={2, 3}, redundancy=ENOUGH)
        assert AutoRecovery()(two_dead) is None
        after_removal = ctx(FaultKind.DEAD_PEER, 2, dead_ranks={2}, removed_ranks={3})
        assert AutoRecovery()(attrs.evolve(after_removal, redundancy=ENOUGH)) is None

    def test_abstains_on_a_dead_peer_of_unknown_rank(self) -> None:
        assert AutoRecovery()(ctx(FaultKind.DEAD_PEER, None)) is None

    def test_gives_up_when_this_rank_is_dead(self) -> None:
        assert "rank 0 is dead" in _reason(
            AutoRecovery()(ctx(FaultKind.DEAD_PEER, 0, dead_ranks={0}))
        )
        assert "rank 0 is dead" in _reason(AutoRecovery()(ctx(FaultKind.SELF_DEAD, 0)))

    def test_gives_up_after_max_attempts(self) -> None:
        assert AutoRecovery(max_attempts=2)(ctx(attempts=1)) == Retry(0.0)
        assert "after 2 recovery attempts" in _reason(AutoRecovery(max_attempts=2)(ctx(attempts=2)))

    def test_a_fault_during_recovery_is_retried_unless_told_not_to(self) -> None:
        during = ctx(FaultKind.RECOVERY_ERROR, None, phase=Phase.RETRYING, attempts=1)
        assert AutoRecovery()(during) == Retry(0.0)
        assert "after 3 recovery attempts" in _reason(
            AutoRecovery()(attrs.evolve(during, attempts=3))
        )
        assert "during retrying" in _reason(AutoRecovery(retry_during_recovery=False)(during))

    def test_retry_kinds_are_configurable(self) -> None:
        only_transient = AutoRecovery(retry_kinds=[FaultKind.TRANSIENT])
        assert only_transient(ctx(FaultKind.HUNG_PEER)) is None
        assert only_transient.retry_kinds == frozenset({FaultKind.TRANSIENT})

    def test_invalid_parameters_fail_at_construction(self) -> None:
        with pytest.raises(ConfigError, match="max_attempts must be an int >= 1, got 0"):
            AutoRecovery(max_attempts=0)
        with pytest.raises(ConfigError, match="retry_delay"):
            AutoRecovery(retry_delay=-1)


class TestLimits:
    def test_max_attempts(self) -> None:
        assert MaxAttempts(3)(ctx(attempts=2)) is None
        assert "MaxAttempts(3)" in _reason(MaxAttempts(3)(ctx(attempts=3)))
        with pytest.raises(ConfigError, match=r"MaxAttempts\.attempts must be an int >= 1"):
            MaxAttempts(0)

    def test_recovery_deadline(self) -> None:
        assert RecoveryDeadline(10.5)(ctx()) is None
        assert "10s into the episode (RecoveryDeadline(10))" in _reason(RecoveryDeadline(10)(ctx()))
        with pytest.raises(ConfigError, match=r"RecoveryDeadline\.seconds"):
            RecoveryDeadline(0)


class TestExponentialBackoff:
    def test_delays_double_up_to_the_cap(self) -> None:
        backoff = ExponentialBackoff(base=0.5, factor=2.0, cap=3.0, jitter=0.0)
        assert [backoff.delay(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
        assert backoff(ctx(attempts=2)) == Retry(2.0)

    def test_huge_attempt_numbers_do_not_overflow(self) -> None:
        assert ExponentialBackoff(cap=30.0).delay(10**6) == 30.0
        assert ExponentialBackoff(factor=1.0).delay(10**6) == 0.5

    def test_jitter_is_seeded_and_shrinks_the_delay(self) -> None:
        one, same, other = (ExponentialBackoff(jitter=0.5, seed=s) for s in (1, 1, 2))
        draws = [one.jittered(n) for n in range(6)]
        assert draws == [same.jittered(n) for n in range(6)]
        assert draws != [other.jittered(n) for n in range(6)]
        for n, draw in enumerate(draws):
            assert 0.5 * one.delay(n) <= draw <= one.delay(n)

    @pytest.mark.parametrize(
        ("params", "message"),
        [
            ({"factor": 0.5}, "factor must be >= 1"),
            ({"base": 2.0, "cap": 1.0}, "cap \\(1.0\\) must be >= base \\(2.0\\)"),
            ({"jitter": 1.5}, "jitter must be in \\[0, 1\\]"),
            ({"seed": -1}, "seed must be an int >= 0"),
            ({"base": 0}, "base must be finite seconds > 0"),
        ],
    )
    def test_invalid_parameters(self, params: dict[str, Any], message: str) -> None:
        with pytest.raises(ConfigError, match=message):
            ExponentialBackoff(**params)


class TestFlapGuard:
    def history(self, rank: int, times: list[float]) -> tuple[Fault, ...]:
        return tuple(Fault(FaultKind.TRANSIENT, rank=rank, at=t) for t in times)

    def test_a_rank_faulting_k_times_in_the_window_is_scaled_down(self) -> None:
        guard = FlapGuard(k=3, window=10.0)
        assert guard(ctx(rank=2, faults=self.history(2, [41.0, 45.0]))) is None
        flapping = ctx(rank=2, faults=self.history(2, [41.0, 45.0, 50.0]), redundancy=ENOUGH)
        assert guard(flapping) == ScaleDown({2})

    def test_faults_outside_the_window_or_of_other_ranks_do_not_count(self) -> None:
        guard = FlapGuard(k=2, window=5.0)
        old = ctx(rank=2, faults=(*self.history(2, [40.0]), *self.history(3, [49.0, 50.0])))
        assert guard(old) is None

    def test_this_rank_flapping_gives_up(self) -> None:
        mine = ctx(rank=0, faults=self.history(0, [49.0, 50.0]))
        assert "this worker flaps" in _reason(FlapGuard(2, 5.0)(mine))

    def test_a_flapping_peer_while_this_worker_is_confirmed_dead_gives_up(self) -> None:
        # ctx's own rank is 0; a scale-down may never name it.
        flapping = ctx(rank=2, faults=self.history(2, [49.0, 50.0]), dead_ranks={0})
        assert "this worker's rank 0 is dead" in _reason(FlapGuard(2, 5.0)(flapping))

    def test_a_flapping_rank_the_survivors_cannot_lose_gives_up(self) -> None:
        flapping = ctx(rank=2, faults=self.history(2, [49.0, 50.0]), removed_ranks={3})
        reason = _reason(FlapGuard(2, 5.0)(attrs.evolve(flapping, redundancy=ENOUGH)))
        assert "cannot host every expert" in reason

    def test_removed_or_unknown_ranks_are_ignored(self) -> None:
        assert FlapGuard(1, 5.0)(ctx(rank=None)) is None
        assert FlapGuard(1, 5.0)(ctx(rank=3, removed_ranks={3})) is None
