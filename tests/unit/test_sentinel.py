"""RankSentinel: faults from exceptions, host hooks in the recovery order, command relay
(the classifier itself is tested in test_collective_errors.py)."""

from __future__ import annotations

import pytest

from ftengine.backends.base import Backend
from ftengine.backends.fake import FakeBackend
from ftengine.clock import ManualClock
from ftengine.context import RedundancyFacts
from ftengine.errors import (
    CollectiveTimeout,
    ConfigError,
    PeerDead,
)
from ftengine.faults import FaultKind, HealthStatus, Phase
from ftengine.policies import OrchestratorDriven, Policy
from ftengine.sentinel import HostedBackend, RankSentinel
from ftengine.status import PhaseChange
from ftengine.testbed.cluster.policies import build_policy


class RecordingHost:
    """A host worker that records what the sentinel asked of it (and the backend's calls)."""

    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend
        self.log: list[str] = []

    def clean_state(self) -> None:
        self.log.append("clean_state")

    def run_dummy_batch(self) -> None:
        # The dummy batch must run on the rebuilt groups: record what the backend had seen.
        self.log.append(f"dummy_batch@epoch{self.backend.epoch}")

    def expert_layers(self) -> tuple[object, ...]:
        return ("layer0", "layer1")


def make(
    policy: Policy | None = None, *, rank: int = 2
) -> tuple[RankSentinel, FakeBackend, RecordingHost]:
    backend = FakeBackend(rank=rank)
    host = RecordingHost(backend)
    chosen: Policy = OrchestratorDriven(recovery_timeout=10.0) if policy is None else policy
    sentinel = RankSentinel(
        chosen,
        HostedBackend(backend, host),
        rank=rank,
        world_size=4,
        clock=ManualClock(50.0),
        redundancy=RedundancyFacts(ep_size=4, local_slots=4, num_logical=8),
    )
    return sentinel, backend, host


def test_hosted_backend_is_a_backend_named_after_the_device() -> None:
    backend = FakeBackend()
    hosted = HostedBackend(backend, RecordingHost(backend))
    assert isinstance(hosted, Backend)
    assert hosted.name == "fake"


def test_local_fault_carries_own_rank_and_quarantines_with_clean_state() -> None:
    sentinel, backend, host = make()
    fault = sentinel.report_fault(RuntimeError("boom"), step=7)
    assert (fault.kind, fault.rank, fault.step, fault.info) == (
        FaultKind.TRANSIENT,
        2,
        7,
        "RuntimeError",
    )
    assert fault.at == 50.0
    assert sentinel.phase is Phase.QUARANTINED and sentinel.health is HealthStatus.UNHEALTHY
    assert not sentinel.serving
    assert backend.names() == ["quarantine"] and host.log == ["clean_state"]
    assert sentinel.status().fault_info == "RuntimeError"


def test_peer_fault_from_an_exception_has_no_rank() -> None:
    sentinel, _, _ = make()
    fault = sentinel.report_fault(PeerDead("gone"))
    assert (fault.kind, fault.rank) == (FaultKind.DEAD_PEER, None)


def test_retry_command_runs_the_host_dummy_batch_after_the_rebuild() -> None:
    sentinel, backend, host = make()
    sentinel.report_fault(CollectiveTimeout("hung"), step=3)
    result = sentinel.run_command("retry", {}, "req-1")
    assert result.success, result.reason
    assert backend.names() == ["quarantine", "reset_device", "rebuild_groups"]
    assert host.log == ["clean_state", "dummy_batch@epoch1"]
    assert sentinel.phase is Phase.HEALTHY and sentinel.serving


def test_scale_down_command_masks_rebuilds_repairs_then_runs_host_dummy_batch() -> None:
    sentinel, backend, host = make()
    sentinel.peer_fault(FaultKind.DEAD_PEER, 3, "killed by SIGKILL")
    result = sentinel.run_command("scale_down", {"removed_dp_ranks": [3]}, "req-2")
    assert result.success, result.reason
    assert backend.names() == ["quarantine", "mask_ranks", "rebuild_groups", "repair_experts"]
    assert backend.alive == frozenset({0, 1, 2})
    assert host.log[-1] == "dummy_batch@epoch1"
    assert sentinel.engine.removed_ranks == frozenset({3})


def test_a_command_while_healthy_is_rejected_with_the_status() -> None:
    sentinel, _, _ = make()
    result = sentinel.run_command("retry", {}, "req-3")
    assert not result.success
    assert result.reason is not None and "HEALTHY" in result.reason


def test_cluster_auto_policy_waits_for_the_dead_rank_then_scales_down_on_poll() -> None:
    sentinel, backend, host = make(build_policy("auto", 10.0))
    sentinel.report_fault(PeerDead("connection reset"))
    sentinel.poll()
    assert sentinel.phase is Phase.QUARANTINED  # no rank yet: wait for the supervisor
    sentinel.peer_fault(FaultKind.DEAD_PEER, 0, "killed by SIGKILL")
    sentinel.poll()
    assert sentinel.status().phase is Phase.HEALTHY
    assert backend.masked == frozenset({0})
    assert host.log[-1] == "dummy_batch@epoch1"


def test_subscribers_see_phase_changes() -> None:
    sentinel, _, _ = make()
    seen: list[PhaseChange] = []
    sentinel.subscribe(seen.append)
    sentinel.report_fault(RuntimeError("x"))
    assert [(c.source, c.dest) for c in seen] == [(Phase.RUNNING, Phase.QUARANTINED)]


def test_cluster_auto_policy_without_a_verdict_dies_at_the_deadline() -> None:
    sentinel, _, _ = make(build_policy("auto", 10.0))
    sentinel.report_fault(PeerDead("connection reset"))
    clock = sentinel.clock
    assert isinstance(clock, ManualClock)
    clock.advance(10.5)
    sentinel.poll()
    assert sentinel.phase is Phase.DEAD


def test_unknown_cluster_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="orchestrator"):
        build_policy("eager", 1.0)


def test_cluster_auto_policy_retries_a_hung_peer_only_on_the_transient_verdict() -> None:
    sentinel, backend, _ = make(build_policy("auto", 10.0))
    sentinel.report_fault(CollectiveTimeout("no answer"))
    sentinel.poll()
    assert sentinel.phase is Phase.QUARANTINED  # a rank-less timeout: wait for the verdict
    sentinel.peer_fault(FaultKind.TRANSIENT, 1, "step failed and every rank is alive")
    sentinel.poll()
    assert sentinel.status().phase is Phase.HEALTHY
    assert backend.names() == ["quarantine", "reset_device", "rebuild_groups"]
    assert backend.alive == frozenset(range(4))
