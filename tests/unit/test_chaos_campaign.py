"""The campaign driver's sequencing on a fake cluster and orchestrator (real signatures):
a SIGKILLed victim reads alive until the supervisor files its exit, after the survivors
quarantined; recovery is driven only once a fault shows, a fault injected during a
recovery that shows only after that recovery settled (faults 29, 30 and 36 of seed 19) is
waited for and recovered before it is judged, and a fault nobody planned is recovered
before the next planned one goes in."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from ftengine.testbed.chaos.campaign import Campaign
from ftengine.testbed.chaos.catalogue import ChaosKind, PlannedFault, When
from ftengine.testbed.chaos.cluster_options import ClusterCampaignOptions
from ftengine.testbed.chaos.cluster_target import ClusterTarget
from ftengine.testbed.chaos.recovery import During, Engines, Outcome
from ftengine.testbed.cluster import FaultSpec
from ftengine.testbed.cluster.protocol import PhaseEvent
from ftengine.weights.checkpoint_gen import make_checkpoint

EXIT_FILED_AFTER_S = 0.3  # how long after its SIGKILL the fake supervisor files an exit


class FakeCluster:
    """The parts of ``Cluster`` the campaign reads; a SIGKILLed rank reads alive (and
    healthy) until its exit is filed ``EXIT_FILED_AFTER_S`` later, as on the real one."""

    def __init__(self, checkpoint: Path, dp_size: int) -> None:
        self.config = type("Config", (), {"checkpoint": checkpoint})()
        self.ranks = set(range(dp_size))
        self.gone: set[int] = set()
        self.removed: set[int] = set()
        self.changes: dict[int, list[PhaseEvent]] = {r: [] for r in self.ranks}
        self.steps_run = 0
        self.broken: set[int] = set()  # ranks a fault nobody planned took down
        self.episodes = 0  # fault episodes every engine's status counts
        self.lock = threading.Lock()

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        assert sig == signal.SIGKILL
        with self.lock:
            for other in self.ranks - self.gone - {rank}:  # its sockets closed: quarantined
                self.changes[other].append(
                    PhaseEvent(other, "running", "quarantined", time.monotonic(), "dead_peer")
                )
        timer = threading.Timer(EXIT_FILED_AFTER_S, self._exit, args=(rank,))
        timer.daemon = True
        timer.start()

    def _exit(self, rank: int) -> None:
        with self.lock:
            self.gone.add(rank)

    def inject(self, spec: FaultSpec) -> bool:
        """An armed step exception: every rank quarantines at once (phase changes), and
        its status counts the new episode ``EXIT_FILED_AFTER_S`` later."""
        now = time.monotonic()
        with self.lock:
            for rank in self.ranks - self.gone:
                self.changes[rank].append(PhaseEvent(rank, "running", "quarantined", now, "raise"))
        timer = threading.Timer(EXIT_FILED_AFTER_S, self._count_episode)
        timer.daemon = True
        timer.start()
        return True

    def _count_episode(self) -> None:
        with self.lock:
            self.episodes += 1

    def live_ranks(self) -> frozenset[int]:
        with self.lock:
            return frozenset(self.ranks - self.gone - self.removed)

    @property
    def removed_ranks(self) -> frozenset[int]:
        return frozenset(self.removed)

    def phase_changes(self) -> dict[int, list[PhaseEvent]]:
        with self.lock:
            return {r: list(c) for r, c in self.changes.items()}

    def engines(self) -> tuple[dict[str, Any], ...]:
        with self.lock:
            return tuple(
                {
                    "id": r,
                    "alive": r not in self.gone,
                    "status": "dead" if r in self.gone else "healthy",
                    "phase": "dead" if r in self.gone else "running",
                    "fault_info": "killed by SIGKILL" if r in self.gone else None,
                    "removed_ranks": sorted(self.removed),
                    "fault_episodes": self.episodes,
                }
                if r not in self.broken
                else {"id": r, "alive": True, "status": "unhealthy", "phase": "quarantined"}
                for r in sorted(self.ranks)
            )

    def status(self) -> dict[str, Any]:
        return {"engines": list(self.engines())}


class FakeDeployment:
    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster

    def rss(self) -> dict[int, int]:
        return dict.fromkeys(self.cluster.live_ranks(), 1 << 20)


class FakeOrchestrator:
    """``recovery.Orchestrator``'s signatures; scales down past whatever reads dead now."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster
        self.calls: list[frozenset[int]] = []  # the ranks read dead at each call
        self.episodes_seen: list[int] = []  # the episodes the status counted at each call

    def recover(
        self,
        fault: int | None,
        deadline_s: float,
        *,
        may_die: Sequence[int] = (),
        during: During | None = None,
    ) -> Outcome:
        cluster = self.cluster
        with cluster.lock:
            self.calls.append(frozenset(cluster.gone))
            self.episodes_seen.append(cluster.episodes)
            cluster.removed |= cluster.gone
            cluster.broken.clear()
        if during is not None:
            during()  # the recovery-phase fault, right after the command was accepted
        return Outcome("settled", time.monotonic(), cluster.engines(), ("scale_down",))

    def read(self) -> Engines:
        return {e["id"]: e for e in self.cluster.engines()}

    def close(self) -> None:
        return None


@pytest.fixture
def campaign(tmp_path: Path) -> Campaign:
    checkpoint = make_checkpoint(tmp_path / "ckpt", layers=1, experts=4, hidden=16, intermediate=8)
    options = ClusterCampaignOptions(faults=2, seed=19, dp_size=4, op_timeout_s=2.0)
    target = ClusterTarget(options, checkpoint, progress=lambda line: None)
    return Campaign(target, progress=lambda line: None)


def _deployed(campaign: Campaign) -> tuple[FakeCluster, FakeOrchestrator]:
    """The campaign's cluster target serving on a fake cluster and orchestrator."""
    assert isinstance(campaign.target, ClusterTarget)
    cluster = FakeCluster(campaign.target.checkpoint, 4)
    orchestrator = FakeOrchestrator(cluster)
    campaign.target.deployment = FakeDeployment(cluster)  # type: ignore[assignment]
    campaign.target.orchestrator = orchestrator  # type: ignore[assignment]
    return cluster, orchestrator


def test_a_kill_during_recovery_that_shows_after_the_settle_is_recovered_before_judging(
    campaign: Campaign,
) -> None:
    campaign.plan = [
        PlannedFault(28, ChaosKind.TWO_RANKS, When.STEADY, delay_steps=0, pick=0),
        PlannedFault(29, ChaosKind.SIGKILL, When.RECOVERY, delay_steps=0, pick=0),
    ]
    cluster, orchestrator = _deployed(campaign)
    after = campaign._one(0)
    assert after == 2
    follow = campaign.found.results[1]
    assert follow.index == 29 and follow.victims == (2,)
    # Judged on the settle alone, victim 2 still read alive: "victims [2] are not dead".
    assert campaign.found.violations == [], [v.detail for v in campaign.found.violations]
    assert orchestrator.calls[-1] == {0, 1, 2}, "recovered again once its exit was filed"
    assert cluster.live_ranks() == {3}


def test_recovery_waits_until_the_victims_exit_is_filed(campaign: Campaign) -> None:
    campaign.plan = [PlannedFault(6, ChaosKind.TWO_RANKS, When.STEADY, delay_steps=0, pick=2)]
    _cluster, orchestrator = _deployed(campaign)
    campaign._one(0)
    # Driven at the survivors' quarantine, the recovery read victims 2 and 3 alive.
    assert campaign.found.violations == [], [v.detail for v in campaign.found.violations]
    assert orchestrator.calls == [{2, 3}]


def test_recovery_waits_until_the_status_counts_a_step_exceptions_episode(
    campaign: Campaign,
) -> None:
    campaign.plan = [PlannedFault(162, ChaosKind.STEP_RAISE, When.STEADY, delay_steps=0, pick=3)]
    _cluster, orchestrator = _deployed(campaign)
    campaign._one(0)
    # Driven at the phase change, the status still read every engine healthy: "settled",
    # and the quarantine it did not see was left for the next fault to land on.
    assert orchestrator.episodes_seen == [1]


def test_a_fault_nobody_planned_is_recovered_before_the_next_planned_one(
    campaign: Campaign,
) -> None:
    campaign.plan = [PlannedFault(30, ChaosKind.SIGKILL, When.STEADY, delay_steps=0, pick=1)]
    cluster, orchestrator = _deployed(campaign)
    cluster.broken = {0, 1, 2, 3}  # every engine already quarantined: fault 30 would not show
    campaign._one(0)
    assert campaign.unplanned == 1
    assert orchestrator.calls[0] == frozenset(), "the unplanned fault was recovered first"
    assert campaign.found.results[0].detect_s is not None and campaign.found.violations == []
