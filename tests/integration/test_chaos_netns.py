"""Hosts in network namespaces: a DP=3 cluster whose workers each run in their own network
namespace, serving through a cut of one rank's link. The cut kills nothing; the cut rank
sees its peers fail and its peers see it fail (every engine quarantined by a collective
timeout), the supervisor fences the cut rank for its network silence and says why, the
survivors scale down past it and serve the reference tokens; the cut side never serves
again. Afterwards no namespace, bridge or veth of the run is left (we run as root here)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil
import pytest

from ftengine.testbed.cluster import Cluster, ClusterConfig, reference_generate
from ftengine.testbed.cluster.netns import Hosts
from ftengine.weights.checkpoint_gen import make_checkpoint

pytestmark = pytest.mark.integration

PROMPT = [1, 2, 3, 4]
UNHEALTHY, DEAD = 2, 1


def _leftovers(tag: str) -> list[str]:
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line for line in (links + spaces).splitlines() if tag in line]


@pytest.mark.timeout(300)
def test_a_cut_rank_is_fenced_and_only_the_supervisor_side_serves(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(
        tmp_path / "model", layers=2, experts=6, hidden=64, intermediate=32
    )
    [want] = [list(g.token_ids) for g in reference_generate(checkpoint, [PROMPT], 6)]
    hosts = Hosts(3)
    with hosts:
        config = ClusterConfig(
            checkpoint, dp_size=3, op_timeout_s=2.0, heartbeat_misses=12, host=hosts.host,
            worker_netns=hosts.namespaces,
        )  # fmt: skip
        with Cluster.launch(config) as cluster:
            assert cluster.generate(PROMPT, 6) == want
            pid = cluster.pids()[2]
            assert pid is not None
            cut_at = time.monotonic()
            hosts.cut(2)
            assert psutil.pid_exists(pid)  # a cut kills nothing
            with pytest.raises(Exception, match="CollectiveTimeout"):
                cluster.generate(PROMPT, 6)
            waited = cluster.wait_for(lambda s: s["engines"][2]["status"] == DEAD, 15.0)
            assert waited is not None, cluster.status()
            changes = cluster.phase_changes()
            # Both sides saw the other fail: every engine went quarantined after the cut.
            for rank in (0, 1, 2):
                assert any(c.at > cut_at and c.dest == "quarantined" for c in changes[rank])
            fences = [e for e in cluster.events() if e.kind == "fence" and e.rank == 2]
            assert fences and "cut off the network" in fences[0].detail, cluster.events()
            assert "supervisor's side keeps serving" in fences[0].detail
            result = cluster.apply("scale_down", {"removed_dp_ranks": [2]}, "cut-1")
            assert result.success, result
            assert cluster.generate(PROMPT, 6) == want
            # The cut side never served again: no healthy phase on rank 2 after the cut.
            assert not [
                c for c in cluster.phase_changes()[2] if c.at > cut_at and c.dest == "healthy"
            ]
    assert _leftovers(hosts.tag) == []
