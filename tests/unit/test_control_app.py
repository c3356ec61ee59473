"""The control API over a stand-in cluster: vLLM's two scenarios, replay, bad input, auth,
health flipping and generation, all through HTTP (FastAPI's TestClient)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ftengine.control.app import create_app
from tests.unit.control_standin import Jobs, StandInCluster

APPLY = "/v1/fault_tolerance/apply"
STATUS = "/v1/fault_tolerance/status"


class Harness:
    def __init__(self, api_key: str | None = None) -> None:
        self.cluster = StandInCluster()
        self.jobs = Jobs()
        self.client = TestClient(create_app(self.cluster, api_key=api_key, spawn=self.jobs))

    def apply(self, instruction: str, request_id: str, **params: object) -> Any:
        body = {"instruction": instruction, "params": params, "request_id": request_id}
        return self.client.post(APPLY, json=body)

    def result(self, request_id: str) -> dict[str, Any]:
        answer = self.client.get(f"/v1/fault_tolerance/requests/{request_id}")
        assert answer.status_code == 200
        record: dict[str, Any] = answer.json()
        assert record["state"] == "done"
        return dict(record["result"])

    def engines(self) -> list[dict[str, Any]]:
        engines: list[dict[str, Any]] = self.client.get(STATUS).json()["engines"]
        return engines


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    with harness.client:
        yield harness


def test_status_has_vllm_fields_plus_phase_epoch_timeline(h: Harness) -> None:
    body = h.client.get(STATUS).json()
    assert body["schema_version"] == 1 and body["total_engines"] == 4
    assert body["running_request_id"] is None
    for rank, engine in enumerate(body["engines"]):
        assert engine["id"] == rank and engine["status"] == 0 and engine["phase"] == "running"
        for key in ("fault_info", "last_ft_request_id", "ft_error", "removed_ranks", "epoch"):
            assert key in engine
        assert engine["timeline"] is None


def test_injected_fault_then_retry_recovers_every_engine(h: Harness) -> None:
    h.cluster.inject(3)
    assert h.client.get("/health").status_code == 503
    engines = h.engines()
    assert [e["status"] for e in engines] == [2, 2, 2, 2]
    assert engines[3]["fault_info"] == "RuntimeError"
    assert [p["phase"] for p in engines[0]["timeline"]["phases"]] == ["quarantined"]
    accepted = h.apply("retry", "retry-1")
    assert accepted.status_code == 202
    assert accepted.json() == {
        "request_id": "retry-1",
        "state": "accepted",
        "result_url": "/v1/fault_tolerance/requests/retry-1",
    }
    assert h.client.get(STATUS).json()["running_request_id"] == "retry-1"
    h.jobs.run_all()
    assert h.result("retry-1") == {"request_id": "retry-1", "success": True, "reason": None}
    engines = h.engines()
    assert [e["phase"] for e in engines] == ["healthy"] * 4
    phases = [p["phase"] for p in engines[0]["timeline"]["phases"]]
    assert phases == ["quarantined", "retrying", "healthy"]
    assert h.client.get("/health").status_code == 200


def test_sigkill_scenario_dead_victim_rejects_retry_then_scale_down(h: Harness) -> None:
    h.cluster.kill(3)
    assert [e["status"] for e in h.engines()] == [2, 2, 2, 1]
    assert h.apply("retry", "retry-1").status_code == 202
    h.jobs.run_all()
    rejected = h.result("retry-1")
    assert rejected["success"] is False and "status is DEAD" in rejected["reason"]
    assert h.apply("scale_down", "sd-1", removed_dp_ranks=[3]).status_code == 202
    h.jobs.run_all()
    assert h.result("sd-1")["success"] is True
    engines = h.engines()
    assert [e["status"] for e in engines] == [0, 0, 0, 1]
    assert all(e["removed_ranks"] == [3] for e in engines)
    health = h.client.get("/health")
    assert health.status_code == 200
    assert health.json()["live_engines"] == [0, 1, 2]
    answer = h.client.post("/v1/generate", json={"prompt_token_ids": [5, 6], "max_tokens": 3})
    assert answer.status_code == 200 and answer.json()["token_ids"] == [7, 8, 9]


def test_health_is_false_while_a_recovery_runs(h: Harness) -> None:
    h.cluster.inject(1)
    seen: list[tuple[int, list[str]]] = []
    h.cluster.during_recovery = lambda: seen.append(
        (h.client.get("/health").status_code, [e["phase"] for e in h.engines()])
    )
    h.apply("retry", "r")
    assert h.client.get("/health").json()["running_request_id"] == "r"
    h.jobs.run_all()
    assert seen == [(503, ["retrying"] * 4)]
    assert h.client.get("/health").status_code == 200


def test_replay_answers_from_the_record_and_acts_once(h: Harness) -> None:
    h.cluster.kill(2)
    h.apply("scale_down", "sd", removed_dp_ranks=[2])
    again = h.apply("scale_down", "sd", removed_dp_ranks=[2])
    assert again.status_code == 202 and again.json()["state"] == "running"
    h.jobs.run_all()
    replay = h.apply("scale_down", "sd", removed_dp_ranks=[2])
    assert replay.status_code == 200
    assert replay.json() == {"request_id": "sd", "success": True, "reason": None}
    assert h.jobs.queue == []
    assert [call[2] for call in h.cluster.calls] == ["sd"]


def test_reusing_a_request_id_for_another_command_is_409(h: Harness) -> None:
    h.cluster.kill(2)
    h.apply("retry", "x")
    h.jobs.run_all()
    answer = h.apply("scale_down", "x", removed_dp_ranks=[2])
    assert answer.status_code == 409 and "already used for retry" in answer.json()["detail"]
    assert len(h.cluster.calls) == 1


def test_a_second_command_while_one_runs_is_409_and_not_started(h: Harness) -> None:
    h.cluster.kill(2)
    h.apply("scale_down", "a", removed_dp_ranks=[2])
    answer = h.apply("retry", "b")
    assert answer.status_code == 409 and "'a' is still running" in answer.json()["detail"]
    h.jobs.run_all()
    assert [call[2] for call in h.cluster.calls] == ["a"]
    assert h.client.get("/v1/fault_tolerance/requests/b").status_code == 404


BAD_BODIES: list[tuple[object, str]] = [
    ({"instruction": "reboot", "params": {}, "request_id": "r"}, "unknown instruction"),
    ({"params": {}, "request_id": "r"}, "instruction"),
    ({"instruction": "retry", "params": {}}, "request_id"),
    ({"instruction": "retry", "params": {"x": 1}, "request_id": "r"}, "retry takes no params"),
    ({"instruction": "scale_down", "params": {}, "request_id": "r"}, "list of integer"),
    ({"instruction": "scale_down", "params": {"removed_dp_ranks": "3"}, "request_id": "r"}, "list"),
    (
        {"instruction": "scale_down", "params": {"removed_dp_ranks": [7]}, "request_id": "r"},
        "range",
    ),
    (
        {"instruction": "scale_down", "params": {"removed_dp_ranks": [-1]}, "request_id": "r"},
        "range",
    ),
    ({"instruction": "scale_down", "params": {"removed_dp_ranks": []}, "request_id": "r"}, "empty"),
    (
        {
            "instruction": "scale_down",
            "params": {"removed_dp_ranks": [0, 1, 2, 3]},
            "request_id": "r",
        },
        "every one of the 4",
    ),
    ([1, 2, 3], "FaultToleranceRequest"),
]


@pytest.mark.parametrize(("body", "needle"), BAD_BODIES)
def test_bad_input_is_422_with_a_message_and_changes_nothing(
    h: Harness, body: object, needle: str
) -> None:
    h.cluster.kill(3)
    before = h.client.get(STATUS).json()
    answer = h.client.post(APPLY, json=body)
    assert answer.status_code == 422
    assert needle in answer.json()["detail"]
    assert h.jobs.queue == [] and h.cluster.calls == []
    assert h.client.get(STATUS).json() == before


def test_invalid_json_is_422(h: Harness) -> None:
    answer = h.client.post(APPLY, content=b"{oops", headers={"content-type": "application/json"})
    assert answer.status_code == 422 and "not valid JSON" in answer.json()["detail"]


def test_removing_every_rank_counts_earlier_removals(h: Harness) -> None:
    h.cluster.kill(3)
    h.apply("scale_down", "a", removed_dp_ranks=[3])
    h.jobs.run_all()
    answer = h.apply("scale_down", "b", removed_dp_ranks=[0, 1, 2])
    assert answer.status_code == 422 and "already removed" in answer.json()["detail"]


def test_generate_while_recovering_is_503_and_bad_bodies_422(h: Harness) -> None:
    h.cluster.kill(0)
    answer = h.client.post("/v1/generate", json={"prompt_token_ids": [1], "max_tokens": 2})
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert "recovering" in answer.json()["detail"]
    bodies: list[dict[str, object]] = [
        {"prompt_token_ids": []},
        {"prompt_token_ids": [1], "max_tokens": 0},
        {"x": 1},
    ]
    for body in bodies:
        bad = h.client.post("/v1/generate", json=body)
        assert bad.status_code == 422 and "GenerateRequest" in bad.json()["detail"]
    assert h.cluster.generated == []


def test_auth_off_lets_posts_through_without_a_header(h: Harness) -> None:
    answer = h.client.post("/v1/generate", json={"prompt_token_ids": [1], "max_tokens": 1})
    assert answer.status_code == 200


@pytest.mark.parametrize(
    "header",
    [None, "Bearer wrong", "Basic c2VjcmV0", "secret", "Bearer "],
)
def test_auth_on_rejects_posts_without_the_key(header: str | None) -> None:
    h = Harness(api_key="secret")
    h.cluster.kill(3)
    headers = {} if header is None else {"Authorization": header}
    body = {"instruction": "scale_down", "params": {"removed_dp_ranks": [3]}, "request_id": "r"}
    answer = h.client.post(APPLY, json=body, headers=headers)
    assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
    generate = h.client.post("/v1/generate", json={"prompt_token_ids": [1]}, headers=headers)
    assert generate.status_code == 401
    assert h.jobs.queue == [] and h.cluster.calls == []


def test_auth_on_accepts_the_key_and_leaves_reads_open() -> None:
    h = Harness(api_key="secret")
    h.cluster.kill(3)
    for path in (STATUS, "/health", "/metrics"):
        assert h.client.get(path).status_code in (200, 503)
    body = {"instruction": "scale_down", "params": {"removed_dp_ranks": [3]}, "request_id": "r"}
    answer = h.client.post(APPLY, json=body, headers={"Authorization": "Bearer secret"})
    assert answer.status_code == 202
    h.jobs.run_all()
    assert h.result("r")["success"] is True


def test_unknown_request_id_is_404(h: Harness) -> None:
    answer = h.client.get("/v1/fault_tolerance/requests/nope")
    assert answer.status_code == 404 and "nope" in answer.json()["detail"]
