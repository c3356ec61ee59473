"""A short chaos campaign (``ftengine chaos``) as ``make test`` runs it: at least 20 faults,
every kind at least once (the network cut too: each worker in its own network namespace; we
run as root here, which namespaces need), on DP=3 under six concurrent streaming clients,
with every invariant holding: no hang, nothing stuck unhealthy, no split brain, no wrong
token, no gap or repeat, no lost request, no orphan process, port, namespace or link; every
rank removed by a scale-down restarted and admitted back (``scale_up``), no fault ending
with the deployment DEAD. The campaign runs in a child process (the CLI, as an operator runs
it) under a hard timeout, stopped by pid if it overruns."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from ftengine.testbed.chaos.catalogue import ChaosKind
from ftengine.testbed.chaos.cluster_options import PROCESS_KINDS
from tests.campaign_support import network_names, run_campaign

pytestmark = pytest.mark.integration

FAULTS = 20
CAMPAIGN_TIMEOUT_S = 900


@pytest.mark.timeout(CAMPAIGN_TIMEOUT_S + 60)
def test_a_short_campaign_holds_every_invariant() -> None:
    # Not tmp_path: pytest keeps only the last 3 base temp dirs of this user, and other
    # sessions on a shared machine can rotate a long campaign's checkpoint away under it.
    with tempfile.TemporaryDirectory(prefix="ftengine-chaos-test-") as scratch:
        _campaign(Path(scratch))


def _campaign(tmp_path: Path) -> None:
    before = network_names()
    command = [sys.executable, "-m", "ftengine", "chaos", "--faults", str(FAULTS), "--seed", "3"]
    # DP=3 keeps each rebuild (the campaign's slowest part) short on this 2-core machine.
    command += ["--netns", "--dp-size", "3", "--json", "--checkpoint", str(tmp_path / "ckpt")]
    command += ["--plot", str(tmp_path / "campaign.png")]  # throughput and faults over time
    ran = run_campaign(command, CAMPAIGN_TIMEOUT_S, tmp_path / "progress.log")
    report, log = ran.report, ran.log
    assert report["faults_injected"] >= FAULTS, log
    kinds = {k.value for k in (*PROCESS_KINDS, ChaosKind.NET_CUT)}  # the cluster's, cut too
    assert set(report["by_kind"]) == kinds, report["by_kind"]
    for key in ("hangs", "stuck_unhealthy", "split_brain", "wrong_tokens"):
        assert report[key] == 0, (key, report["violations"], log)
    assert report["stream_gaps_or_repeats"] == 0 and report["requests_lost"] == 0, report
    assert report["orphans"] == 0, report["orphan_detail"]
    assert report["requests_completed"] > 0
    # Removed ranks come back (restart + scale_up): the cluster keeps its size, no rebuild.
    assert report["rejoin"] and report["rejoins"] >= 1, report["rejoins"]
    assert report["outcomes"].get("dead", 0) == 0, report["outcomes"]
    assert report["violations"] == [], report["violations"]
    assert ran.returncode == 0, log
    assert (tmp_path / "campaign.png").read_bytes().startswith(b"\x89PNG"), log
    # Every namespace, bridge and veth the run made is gone.
    assert network_names() <= before, "the campaign left links or namespaces"
