"""Rejoin on a real DP=4 CPU cluster: a removed rank's worker restarted with its original
spec comes back (``scale_up``) while the others keep serving; in-flight requests finish
without loss or repetition; rank 0 included; cycles leak no threads, fds or memory."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from ftengine.testbed.bench.rejoin import RejoinSetup, run_target
from ftengine.testbed.cluster import Cluster, Generation, compare_outputs
from tests.integration.conftest import MAX_TOKENS, PROMPTS, Launcher

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def engines(cluster: Cluster) -> dict[int, dict[str, Any]]:
    return {e["id"]: e for e in cluster.status()["engines"]}


def kill_and_scale_down(cluster: Cluster, rank: int, tag: str) -> None:
    cluster.kill(rank, signal.SIGKILL)
    waited = cluster.wait_for(
        lambda s: all(e["status"] == 2 for e in s["engines"] if e["id"] != rank and e["alive"]),
        30.0,
    )
    assert waited is not None, engines(cluster)
    result = cluster.apply("scale_down", {"removed_dp_ranks": [rank]}, f"{tag}-down")
    assert result.success, result.reason
    assert cluster.removed_ranks == frozenset({rank})


def rejoin(cluster: Cluster, rank: int, tag: str, *, command: bool = True) -> None:
    loaded_s = cluster.restart(rank)
    assert loaded_s > 0
    assert engines(cluster)[rank]["phase"] == "ready"
    announced = cluster.announce_ready(f"{tag}-ready")
    assert announced.success, announced.reason
    if command:
        members = [e for r, e in engines(cluster).items() if r != rank]
        assert all(e["ready_ranks"] == [rank] for e in members), members
        result = cluster.apply("scale_up", {"added_dp_ranks": [rank]}, f"{tag}-up")
        assert result.success, result.reason
    status = engines(cluster)
    assert all(e["phase"] == "healthy" for e in status.values()), status
    assert all(e["removed_ranks"] == [] for e in status.values()), status
    assert cluster.removed_ranks == frozenset() and cluster.joining_ranks() == frozenset()


def assert_outputs(cluster: Cluster, reference: list[Generation]) -> None:
    check = compare_outputs(cluster.generate_batch(PROMPTS, MAX_TOKENS), reference)
    assert check.match, check


def test_a_removed_rank_rejoins_and_every_rank_serves_again(
    launch: Launcher, reference: list[Generation]
) -> None:
    cluster = launch()
    kill_and_scale_down(cluster, 2, "r2")
    bad = cluster.apply("scale_up", {"added_dp_ranks": [2]}, "too-early")
    assert not bad.success and "not ready" in (bad.reason or "")
    wrong = cluster.apply("scale_up", {"added_dp_ranks": [1]}, "wrong")
    assert not wrong.success and "were not removed" in (wrong.reason or "")
    rejoin(cluster, 2, "r2")
    status = engines(cluster)
    assert len({e["epoch"] for e in status.values()}) == 1  # one fresh epoch for all
    assert_outputs(cluster, reference)
    served = cluster.serving_ranks()
    assert 2 in served  # new requests reach the returned rank


def test_rank_0_rejoins_under_the_auto_policy_without_a_command(
    launch: Launcher, reference: list[Generation]
) -> None:
    cluster = launch(policy="auto")
    cluster.kill(0, signal.SIGKILL)
    waited = cluster.wait_for(lambda s: cluster.removed_ranks == frozenset({0}), 30.0)
    assert waited is not None, engines(cluster)
    assert (
        cluster.wait_for(
            lambda s: all(e["phase"] == "healthy" for e in s["engines"] if e["id"] != 0), 30.0
        )
        is not None
    )
    rejoin(cluster, 0, "r0", command=False)
    assert_outputs(cluster, reference)


def _generate_into(cluster: Cluster, out: list[list[Generation]]) -> None:
    out.append(cluster.generate_batch(PROMPTS, MAX_TOKENS))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return threading.active_count()


def test_three_kill_scale_down_rejoin_cycles_under_traffic_leak_nothing(
    launch: Launcher, reference: list[Generation]
) -> None:
    cluster = launch()
    me = psutil.Process()
    assert_outputs(cluster, reference)
    before = {"fds": _fds(), "threads": _threads(), "rss": me.memory_info().rss}
    survivors_rss: list[dict[int, int]] = []
    survivors_fds: list[dict[int, int]] = []
    for cycle in range(3):
        kill_and_scale_down(cluster, 3, f"c{cycle}")
        assert_outputs(cluster, reference)  # the survivors serve
        # The survivors keep serving while rank 3 loads (a batch runs during the restart).
        during: list[list[Generation]] = []
        runner = threading.Thread(target=_generate_into, args=(cluster, during))
        runner.start()
        rejoin(cluster, 3, f"c{cycle}")
        runner.join(60)
        assert during and compare_outputs(during[0], reference).match
        assert_outputs(cluster, reference)
        pids = {r: p for r, p in cluster.pids().items() if r != 3 and p is not None}
        survivors_rss.append({r: psutil.Process(p).memory_info().rss for r, p in pids.items()})
        survivors_fds.append({r: psutil.Process(p).num_fds() for r, p in pids.items()})
    time.sleep(1.0)  # group teardown threads finish off the caller's thread
    after = {"fds": _fds(), "threads": _threads(), "rss": me.memory_info().rss}
    assert after["fds"] <= before["fds"] + 2, (before, after)
    assert after["threads"] <= before["threads"] + 1, (before, after)
    for rank in survivors_rss[0]:
        first, last = survivors_rss[0][rank], survivors_rss[-1][rank]
        assert last <= first * 1.10, (rank, survivors_rss)
        # Each admission builds a new gloo group and tears the old one down: no fd piles up.
        assert survivors_fds[-1][rank] <= survivors_fds[0][rank] + 2, (rank, survivors_fds)


def test_streams_in_flight_through_a_rejoin_end_whole_and_the_bench_reports_it(
    checkpoint: Path,
) -> None:
    # The bench's own run (a fresh cluster behind its serving loop): streams started on
    # the survivors run through the restart and the admission; none lost, none repeated
    # (each is the reference token for token), no survivor reloads. Speed is not judged.
    result = run_target(
        "cluster",
        RejoinSetup(streams=4, stream_tokens=240, trials=1, batch_requests=4, batch_tokens=8),
        {"checkpoint": checkpoint},
    )
    assert result["streams_in_flight_at_admission"] == 4
    assert result["requests_lost"] == 0 and result["outputs_match"] is True
    assert result["survivor_reloads"] == 0 and result["returning_rank_reloads_at_admission"] == 0
    assert result["all_healthy"] is True and result["removed_ranks_after"] == []
    assert set(result) >= {
        "rejoin_pause_s",
        "rejoin_total_s",
        "throughput_after_over_before",
        "requests_lost",
        "outputs_match",
        "survivor_reloads",
    }
