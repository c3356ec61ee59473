"""The supervisor's per-worker record: status as last reported, DEAD once the process is gone,
and a history of fault episodes so that a status poller (the metrics) never misses one that
started and ended between two of its polls."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry

from ftengine.faults import FaultKind, HealthStatus
from ftengine.sentinel import RankSentinel
from ftengine.testbed.cluster.handles import EPISODE_HISTORY, WorkerHandle
from ftengine.testbed.control.metrics import ControlMetrics
from ftengine.testbed.control.snapshot import ClusterView
from tests.unit.test_cluster_adapters import sentinel


def handle(rank: int = 1) -> WorkerHandle:
    process: Any = SimpleNamespace(pid=4242)
    return WorkerHandle(rank, process, conn=None)  # type: ignore[arg-type]


def two_episodes(engine: RankSentinel, worker: WorkerHandle) -> None:
    """A transient fault recovered by retry, then a dead peer scaled away; the worker reports
    its status after each step, as the cluster worker does."""
    engine.peer_fault(FaultKind.TRANSIENT, 1, "step 7 failed")
    worker.report(engine.status().to_dict())
    assert engine.run_command("retry", {}, "r1").success
    worker.report(engine.status().to_dict())
    engine.peer_fault(FaultKind.DEAD_PEER, 3, "rank 3 exited")
    worker.report(engine.status().to_dict())
    assert engine.run_command("scale_down", {"removed_dp_ranks": [3]}, "s1").success
    worker.report(engine.status().to_dict())


def test_status_keeps_every_episode_in_its_last_state() -> None:
    engine, worker = sentinel(rank=1), handle(rank=1)
    worker.report(engine.status().to_dict())
    quiet = worker.status_dict()
    assert (quiet["fault_episodes"], quiet["episodes"], quiet["timeline"]) == (0, [], None)

    two_episodes(engine, worker)
    status = worker.status_dict()
    assert status["fault_episodes"] == 2
    assert [e["episode"] for e in status["episodes"]] == [1, 2]
    first, second = status["episodes"]
    assert [p["phase"] for p in first["phases"]] == ["quarantined", "retrying", "healthy"]
    assert first["ended"] is not None and first["faults"][0]["kind"] == "transient"
    assert second == status["timeline"]  # the current episode is the last of the history
    assert (status["status"], status["pid"], status["alive"]) == (0, 4242, True)


def test_a_dead_worker_reads_dead_and_keeps_its_history() -> None:
    engine, worker = sentinel(rank=1), handle(rank=1)
    two_episodes(engine, worker)
    worker.exited("killed by SIGKILL")
    status = worker.status_dict()
    assert (status["status"], status["phase"]) == (int(HealthStatus.DEAD), "dead")
    assert status["ft_error"] == "worker process killed by SIGKILL"
    assert status["fault_episodes"] == 2 and len(status["episodes"]) == 2


def test_the_history_keeps_the_last_episodes_and_counts_them_all() -> None:
    worker = handle()
    for number in range(1, EPISODE_HISTORY + 11):
        worker.report({"id": 1, "status": 2, "timeline": {"episode": number, "ended": None}})
    status = worker.status_dict()
    assert status["fault_episodes"] == EPISODE_HISTORY + 10
    numbers = [e["episode"] for e in status["episodes"]]
    assert numbers == list(range(11, EPISODE_HISTORY + 11))


def test_metrics_count_episodes_that_began_and_ended_between_two_polls() -> None:
    engine, worker = sentinel(rank=1), handle(rank=1)
    worker.report(engine.status().to_dict())
    metrics = ControlMetrics(CollectorRegistry())

    def poll() -> None:
        status = {"schema_version": 1, "total_engines": 1, "engines": [worker.status_dict()]}
        metrics.observe(ClusterView.from_status(status))

    poll()
    two_episodes(engine, worker)  # nobody polls while both episodes run their course
    poll()
    poll()
    value = metrics.registry.get_sample_value
    assert value("ftengine_fault_episodes_total", {"engine": "1"}) == 2.0
    assert value("ftengine_faults_total", {"kind": "transient"}) == 1.0
    assert value("ftengine_faults_total", {"kind": "dead_peer"}) == 1.0
    assert value("ftengine_recoveries_total", {"kind": "retry", "outcome": "healthy"}) == 1.0
    assert value("ftengine_recoveries_total", {"kind": "scale_down", "outcome": "healthy"}) == 1.0
