"""/metrics over a stand-in cluster: phases, faults by kind, recovery durations by kind and
step, reloads and command counts move with what the cluster did, and only once per event."""

from __future__ import annotations

import attrs
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from ftengine.faults import HealthStatus
from ftengine.testbed.control.app import create_app
from ftengine.testbed.control.metrics import ControlMetrics
from ftengine.testbed.control.openai_routes import Completions
from ftengine.testbed.control.snapshot import ClusterView, EngineView, Episode, PhaseMark, StepMark
from tests.unit.control_standin import POISON, Jobs, StandInCluster, StandInService, standin_model


def _samples(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    answer = client.get("/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
    }


def _value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def setup() -> tuple[StandInCluster, Jobs, TestClient]:
    cluster, jobs = StandInCluster(), Jobs()
    completions = Completions(StandInService(cluster), standin_model())
    return cluster, jobs, TestClient(create_app(cluster, completions=completions, spawn=jobs))


def test_kill_and_scale_down_move_every_counter_once(
    setup: tuple[StandInCluster, Jobs, TestClient],
) -> None:
    cluster, jobs, client = setup
    quiet = _samples(client)
    assert _value(quiet, "ftengine_engine_phase", engine="3", phase="running") == 1.0
    assert _value(quiet, "ftengine_faults_total", kind="dead_peer") == 0.0

    cluster.kill(3)
    killed = _samples(client)
    assert _value(killed, "ftengine_faults_total", kind="dead_peer") == 3.0
    assert _value(killed, "ftengine_engine_phase", engine="3", phase="dead") == 1.0
    assert _value(killed, "ftengine_engine_phase", engine="3", phase="running") == 0.0
    assert _value(killed, "ftengine_engine_health", engine="0") == float(HealthStatus.UNHEALTHY)
    assert _value(killed, "ftengine_recoveries_total", kind="none", outcome="healthy") == 0.0

    for request_id, params in (("r", {}), ("s", {"removed_dp_ranks": [3]})):
        instruction = "retry" if request_id == "r" else "scale_down"
        body = {"instruction": instruction, "params": params, "request_id": request_id}
        client.post("/fault_tolerance/apply", json=body)
        jobs.run_all()
    done = _samples(client)
    hist = "ftengine_recovery_duration_seconds"
    assert _value(done, "ftengine_recoveries_total", kind="scale_down", outcome="healthy") == 3
    # The stand-in's clock moves one second per phase change and per step.
    for step in ("quarantine", "mask", "comm_rebuild", "expert_repair", "validate"):
        assert _value(done, f"{hist}_count", kind="scale_down", step=step) == 3.0
        assert _value(done, f"{hist}_sum", kind="scale_down", step=step) == 3.0
    assert _value(done, f"{hist}_count", kind="scale_down", step="detect") == 3.0
    assert _value(done, f"{hist}_count", kind="scale_down", step="total") == 3.0
    assert _value(done, f"{hist}_sum", kind="scale_down", step="total") == 16.0 + 18.0 + 20.0
    assert _value(done, "ftengine_experts_reloaded_total") == 24.0
    assert _value(done, "ftengine_bytes_reloaded_total") == 24000.0
    assert _value(done, "ftengine_reload_lower_bound") == 4.0
    assert _value(done, "ftengine_commands_total", instruction="retry", outcome="failure") == 1
    assert _value(done, "ftengine_commands_total", instruction="scale_down", outcome="success") == 1
    assert _value(done, "ftengine_engine_epoch", engine="0") == 1.0
    assert _value(done, "ftengine_engine_phase", engine="0", phase="healthy") == 1.0
    assert _samples(client) == done


def test_completions_count_by_finish_reason_and_requests_by_outcome(
    setup: tuple[StandInCluster, Jobs, TestClient],
) -> None:
    cluster, _, client = setup
    quiet = _samples(client)
    for reason in ("length", "stop", "abort", "error"):
        assert ("ftengine_completions_total", (("finish_reason", reason),)) in quiet
    client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4})
    client.post("/v1/completions", json={"prompt": [[1], [5]], "max_tokens": 4, "stream": True})
    client.post("/v1/completions", json={"prompt": [1], "max_tokens": 9, "stop_token_ids": [3]})
    client.post("/v1/completions", json={"prompt": [POISON], "max_tokens": 2})
    client.post("/v1/completions", json={"prompt": [1, 2, 99999]})
    cluster.inject(0)
    client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4})
    samples = _samples(client)
    completions = "ftengine_completions_total"
    assert _value(samples, completions, finish_reason="length") == 3.0
    assert _value(samples, completions, finish_reason="stop") == 1.0
    assert _value(samples, completions, finish_reason="error") == 1.0
    assert _value(samples, completions, finish_reason="abort") == 0.0
    requests = "ftengine_completion_requests_total"
    assert _value(samples, requests, outcome="accepted") == 4.0
    assert _value(samples, requests, outcome="rejected") == 1.0
    assert _value(samples, requests, outcome="unavailable") == 1.0
    assert _value(samples, "ftengine_generated_tokens_total") == 4.0 + 4.0 + 4.0 + 2.0
    assert _value(samples, "ftengine_faults_total", kind="transient") == 4.0


def _view(*episodes: Episode) -> ClusterView:
    engine = EngineView(id=0, status=HealthStatus.UNHEALTHY, phase="quarantined", episodes=episodes)
    return ClusterView(total_engines=1, engines=(engine,))


def test_faults_count_as_they_arrive_and_episodes_once_they_end() -> None:
    metrics = ControlMetrics()
    quarantined = PhaseMark("running", "quarantined", 2.0)
    running = Episode(
        1, ("hung_peer",), 1.0, None, (quarantined,), (StepMark("detect", 0, 1.0, 1.5),)
    )
    metrics.observe(_view(running))
    metrics.observe(_view(attrs.evolve(running, fault_kinds=("hung_peer", "dead_peer"))))
    value = metrics.registry.get_sample_value
    assert value("ftengine_faults_total", {"kind": "hung_peer"}) == 1.0
    assert value("ftengine_faults_total", {"kind": "dead_peer"}) == 1.0
    assert (
        value("ftengine_recovery_duration_seconds_count", {"kind": "none", "step": "detect"})
        is None
    )
    dead = attrs.evolve(
        running,
        fault_kinds=("hung_peer", "dead_peer"),
        ended=4.0,
        phases=(quarantined, PhaseMark("quarantined", "dead", 4.0)),
    )
    metrics.observe(_view(dead))
    metrics.observe(_view(dead))
    assert value("ftengine_recoveries_total", {"kind": "none", "outcome": "dead"}) == 1.0
    assert (
        value("ftengine_recovery_duration_seconds_sum", {"kind": "none", "step": "detect"}) == 0.5
    )
    assert (
        value("ftengine_recovery_duration_seconds_count", {"kind": "none", "step": "total"}) is None
    )
    second = Episode(2, ("transient",), 9.0, None, (PhaseMark("running", "quarantined", 9.0),))
    metrics.observe(_view(second))
    assert value("ftengine_faults_total", {"kind": "transient"}) == 1.0
    metrics.observe(_view(dead))
    assert value("ftengine_recoveries_total", {"kind": "none", "outcome": "dead"}) == 1.0
