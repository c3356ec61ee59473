"""The fault-tolerance-off baseline (``ClusterConfig(fault_tolerance=False)``) on a real DP=4
cluster: it serves the reference's outputs, refuses commands, tells nobody about a dead
peer, and a step error takes every worker down, as in a cluster without ftengine."""

from __future__ import annotations

import signal
import time

import pytest

from ftengine.testbed.cluster import Cluster, FaultSpec, Generation, RequestAborted
from ftengine.testbed.cluster.supervisor import FT_OFF_REASON
from tests.integration.conftest import Launcher
from tests.integration.test_cluster_e2e import (
    DEAD,
    HEALTHY,
    Traffic,
    assert_matches,
    engines,
    wait_statuses,
)

pytestmark = pytest.mark.integration


def verdicts(cluster: Cluster) -> list[str]:
    """The supervisor's fault verdicts so far (none may exist with fault tolerance off)."""
    return [e.kind for e in cluster.events() if e.kind in ("peer_fault", "fence", "removed")]


@pytest.mark.timeout(120)
def test_ft_off_serves_refuses_commands_and_tells_nobody_of_a_dead_peer(
    launch: Launcher, reference: list[Generation]
) -> None:
    cluster = launch(fault_tolerance=False)
    assert_matches(cluster, reference)
    refused = cluster.apply("retry", {}, "off-retry")
    assert (refused.success, refused.reason) == (False, FT_OFF_REASON)

    cluster.kill(3, signal.SIGKILL)
    wait_statuses(cluster, {3: DEAD}, 10.0)
    # Past the FT-on heartbeat bound (2 s): with no verdicts the survivors never learn it.
    time.sleep(2.5)
    state = engines(cluster)
    assert [state[r]["status"] for r in (0, 1, 2)] == [HEALTHY] * 3
    assert [state[r]["phase"] for r in (0, 1, 2)] == ["running"] * 3
    assert verdicts(cluster) == []
    with pytest.raises(RequestAborted, match="engine 3 status is DEAD"):
        cluster.generate([1, 2, 3], 2)


@pytest.mark.timeout(120)
def test_ft_off_a_step_error_takes_every_worker_down(launch: Launcher) -> None:
    cluster = launch(
        fault_tolerance=False, inject_fault=FaultSpec.parse("rank=3,step=4,kind=raise")
    )
    traffic = Traffic(cluster)
    error = traffic.stopped()
    assert isinstance(error, RequestAborted)
    assert "InjectedFault" in str(error)
    # Rank 3 dies of its error; its peers' collectives then fail, and they die too.
    wait_statuses(cluster, dict.fromkeys(range(4), DEAD), 30.0)
    assert cluster.live_ranks() == frozenset()
    assert verdicts(cluster) == []
    assert all(e["phase"] == "dead" and e["epoch"] == 0 for e in engines(cluster).values())
