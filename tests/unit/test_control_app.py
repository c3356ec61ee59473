"""The fault-tolerance API over a stand-in cluster, in vLLM's dialect: vLLM's two scenarios,
server-made and client request ids (replay), bad input as vLLM's 400 error object, auth and
health flipping, all through HTTP (FastAPI's TestClient)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ftengine.testbed.control.app import create_app
from ftengine.testbed.control.messages import ACCEPTED_MESSAGE
from ftengine.testbed.control.openai_routes import Completions
from tests.unit.control_standin import Jobs, StandInCluster, StandInService, standin_model

APPLY = "/fault_tolerance/apply"
STATUS = "/fault_tolerance/status"
REQUESTS = "/fault_tolerance/requests"


class Harness:
    def __init__(self, api_key: str | None = None) -> None:
        self.cluster = StandInCluster()
        self.service = StandInService(self.cluster)
        self.jobs = Jobs()
        completions = Completions(self.service, standin_model())
        app = create_app(self.cluster, completions=completions, api_key=api_key, spawn=self.jobs)
        self.client = TestClient(app)

    def apply(self, instruction: str, request_id: str | None, **params: object) -> Any:
        body: dict[str, object] = {"instruction": instruction, "params": params}
        if request_id is not None:
            body["request_id"] = request_id
        return self.client.post(APPLY, json=body)

    def result(self, request_id: str) -> dict[str, Any]:
        answer = self.client.get(f"{REQUESTS}/{request_id}")
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


def test_status_is_vllms_object_plus_phase_epoch_timeline(h: Harness) -> None:
    body = h.client.get(STATUS).json()
    assert body["schema_version"] == 1 and body["total_engines"] == 4
    assert body["running_request_id"] is None
    for rank, engine in enumerate(body["engines"]):
        assert engine["id"] == rank and engine["status"] == "healthy"
        assert engine["phase"] == "running" and engine["removed_ranks"] == []
        assert engine["epoch"] == 0 and engine["timeline"] is None
        # vLLM sends fault_info only while unhealthy, ft fields only after a failed command.
        for key in ("fault_info", "last_ft_request_id", "ft_error"):
            assert key not in engine


def test_injected_fault_then_retry_recovers_every_engine(h: Harness) -> None:
    h.cluster.inject(3)
    assert h.client.get("/health").status_code == 503
    engines = h.engines()
    assert [e["status"] for e in engines] == ["unhealthy"] * 4
    assert engines[3]["fault_info"] == "RuntimeError"
    assert [p["phase"] for p in engines[0]["timeline"]["phases"]] == ["quarantined"]
    accepted = h.apply("retry", "retry-1")
    assert accepted.status_code == 202
    assert accepted.json() == {
        "message": ACCEPTED_MESSAGE,
        "request_id": "retry-1",
        "state": "accepted",
        "result_url": f"{REQUESTS}/retry-1",
    }
    assert h.client.get(STATUS).json()["running_request_id"] == "retry-1"
    h.jobs.run_all()
    assert h.result("retry-1") == {"request_id": "retry-1", "success": True, "reason": None}
    engines = h.engines()
    assert [e["phase"] for e in engines] == ["healthy"] * 4
    assert all("fault_info" not in e and "ft_error" not in e for e in engines)
    phases = [p["phase"] for p in engines[0]["timeline"]["phases"]]
    assert phases == ["quarantined", "retrying", "healthy"]
    assert h.client.get("/health").status_code == 200


def test_without_a_request_id_the_server_makes_a_uuid4(h: Harness) -> None:
    h.cluster.inject(0)
    first, second = h.apply("retry", None), h.apply("retry", None)
    assert first.status_code == 202 and first.json()["message"] == ACCEPTED_MESSAGE
    made = first.json()["request_id"]
    assert uuid.UUID(made).version == 4
    assert second.status_code == 409 and made in second.json()["error"]["message"]
    h.jobs.run_all()
    assert h.result(made)["success"] is True
    assert [call[2] for call in h.cluster.calls] == [made]


def test_sigkill_scenario_dead_victim_rejects_retry_then_scale_down(h: Harness) -> None:
    h.cluster.kill(3)
    assert [e["status"] for e in h.engines()] == ["unhealthy"] * 3 + ["dead"]
    assert "fault_info" not in h.engines()[3], "vLLM: fault_info only while unhealthy"
    assert h.apply("retry", "retry-1").status_code == 202
    h.jobs.run_all()
    rejected = h.result("retry-1")
    assert rejected["success"] is False and "status is DEAD" in rejected["reason"]
    for engine in h.engines():
        assert engine["last_ft_request_id"] == "retry-1"
        assert "status is DEAD" in engine["ft_error"]
    assert h.apply("scale_down", "sd-1", removed_dp_ranks=[3]).status_code == 202
    h.jobs.run_all()
    assert h.result("sd-1")["success"] is True
    engines = h.engines()
    assert [e["status"] for e in engines] == ["healthy"] * 3 + ["dead"]
    assert all(e["removed_ranks"] == [3] for e in engines)
    health = h.client.get("/health")
    assert health.status_code == 200
    assert health.json()["live_engines"] == [0, 1, 2]
    body = {"prompt": [5, 6], "max_tokens": 3, "return_token_ids": True}
    answer = h.client.post("/v1/completions", json=body)
    assert answer.status_code == 200 and answer.json()["choices"][0]["token_ids"] == [7, 8, 9]


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


def error(answer: Any) -> dict[str, Any]:
    """vLLM's error object: exactly message, type, param, code (= the HTTP status)."""
    body = answer.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == answer.status_code
    return dict(body["error"])


def test_reusing_a_request_id_for_another_command_is_409(h: Harness) -> None:
    h.cluster.kill(2)
    h.apply("retry", "x")
    h.jobs.run_all()
    answer = h.apply("scale_down", "x", removed_dp_ranks=[2])
    assert answer.status_code == 409 and "already used for retry" in error(answer)["message"]
    assert error(answer)["type"] == "Conflict"
    assert len(h.cluster.calls) == 1


def test_a_second_command_while_one_runs_is_409_and_not_started(h: Harness) -> None:
    h.cluster.kill(2)
    h.apply("scale_down", "a", removed_dp_ranks=[2])
    answer = h.apply("retry", "b")
    assert answer.status_code == 409 and "'a' is still running" in error(answer)["message"]
    h.jobs.run_all()
    assert [call[2] for call in h.cluster.calls] == ["a"]
    assert h.client.get(f"{REQUESTS}/b").status_code == 404


SD = "scale_down"
BAD_BODIES: list[tuple[object, str, str | None]] = [
    # vLLM's own checks and messages (api_router._validate_payload), param added.
    ([1, 2, 3], "Request body must be a JSON object.", None),
    ("retry", "Request body must be a JSON object.", None),
    ({"params": {}}, "'instruction' is required.", "instruction"),
    ({"instruction": "", "params": {}}, "'instruction' is required.", "instruction"),
    ({"instruction": "reboot", "params": {}}, "Invalid instruction: 'reboot'.", "instruction"),
    ({"instruction": "retry", "params": []}, "'params' must be an object.", "params"),
    ({"instruction": "retry", "params": None}, "'params' must be an object.", "params"),
    # ftengine's range checks.
    ({"instruction": "retry", "params": {"x": 1}}, "retry takes no params", "params"),
    ({"instruction": "retry", "request_id": ""}, "'request_id' must be a string", "request_id"),
    ({"instruction": "retry", "request_id": 7}, "'request_id' must be a string", "request_id"),
    ({"instruction": SD, "params": {}}, "list of integer", "params.removed_dp_ranks"),
    ({"instruction": SD, "params": {"removed_dp_ranks": "3"}}, "list", "params.removed_dp_ranks"),
    ({"instruction": SD, "params": {"removed_dp_ranks": [7]}}, "range", "params.removed_dp_ranks"),
    ({"instruction": SD, "params": {"removed_dp_ranks": [-1]}}, "range", "params.removed_dp_ranks"),
    ({"instruction": SD, "params": {"removed_dp_ranks": []}}, "empty", "params.removed_dp_ranks"),
    (
        {"instruction": SD, "params": {"removed_dp_ranks": [0, 1, 2, 3]}},
        "every one of the 4",
        "params.removed_dp_ranks",
    ),
]


@pytest.mark.parametrize(("body", "needle", "param"), BAD_BODIES)
def test_bad_input_is_vllms_400_naming_the_field_and_changes_nothing(
    h: Harness, body: object, needle: str, param: str | None
) -> None:
    h.cluster.kill(3)
    before = h.client.get(STATUS).json()
    answer = h.client.post(APPLY, json=body)
    assert answer.status_code == 400
    info = error(answer)
    assert needle in info["message"] and info["type"] == "Bad Request"
    assert info["param"] == param
    assert h.jobs.queue == [] and h.cluster.calls == []
    assert h.client.get(STATUS).json() == before


@pytest.mark.parametrize(
    ("content", "content_type", "needle"),
    [
        (b"{oops", "application/json", "Invalid JSON format"),
        (b'{"instruction": "retry"}', "text/plain", "Only 'application/json' is allowed"),
        (b'{"instruction": "retry"}', None, "Only 'application/json' is allowed"),
    ],
)
def test_a_non_json_body_or_content_type_is_400_as_vllm(
    h: Harness, content: bytes, content_type: str | None, needle: str
) -> None:
    h.cluster.inject(0)
    headers = {} if content_type is None else {"content-type": content_type}
    answer = h.client.post(APPLY, content=content, headers=headers)
    assert answer.status_code == 400 and needle in error(answer)["message"]
    assert h.jobs.queue == []


def test_unknown_body_fields_are_ignored_as_vllm_ignores_them(h: Harness) -> None:
    h.cluster.inject(0)
    answer = h.client.post(APPLY, json={"instruction": "retry", "timeout": 5, "request_id": "u"})
    assert answer.status_code == 202
    h.jobs.run_all()
    assert h.result("u")["success"] is True


def test_removing_every_rank_counts_earlier_removals(h: Harness) -> None:
    h.cluster.kill(3)
    h.apply("scale_down", "a", removed_dp_ranks=[3])
    h.jobs.run_all()
    answer = h.apply("scale_down", "b", removed_dp_ranks=[0, 1, 2])
    assert answer.status_code == 400 and "already removed" in error(answer)["message"]


def test_unknown_routes_and_methods_answer_with_the_error_object(h: Harness) -> None:
    assert error(h.client.get("/v1/fault_tolerance/status"))["type"] == "Not Found"
    assert h.client.post("/v1/fault_tolerance/apply", json={}).status_code == 404
    assert error(h.client.get(APPLY))["code"] == 405


@pytest.mark.parametrize(
    "header",
    [None, "Bearer wrong", "Basic c2VjcmV0", "secret", "Bearer "],
)
def test_auth_on_rejects_posts_and_v1_routes_without_the_key(header: str | None) -> None:
    h = Harness(api_key="secret")
    h.cluster.kill(3)
    headers = {} if header is None else {"Authorization": header}
    body = {"instruction": "scale_down", "params": {"removed_dp_ranks": [3]}, "request_id": "r"}
    answer = h.client.post(APPLY, json=body, headers=headers)
    assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
    assert error(answer)["type"] == "Unauthorized"
    completion = h.client.post("/v1/completions", json={"prompt": [1]}, headers=headers)
    assert completion.status_code == 401
    assert h.client.get("/v1/models", headers=headers).status_code == 401
    assert h.jobs.queue == [] and h.cluster.calls == [] and h.service.requests == []


def test_auth_on_accepts_the_key_and_leaves_status_health_metrics_open() -> None:
    h = Harness(api_key="secret")
    h.cluster.kill(3)
    for path in (STATUS, "/health", "/metrics"):
        assert h.client.get(path).status_code in (200, 503)
    body = {"instruction": "scale_down", "params": {"removed_dp_ranks": [3]}, "request_id": "r"}
    answer = h.client.post(APPLY, json=body, headers={"Authorization": "Bearer secret"})
    assert answer.status_code == 202
    h.jobs.run_all()
    assert h.result("r")["success"] is True
    models = h.client.get("/v1/models", headers={"Authorization": "Bearer secret"})
    assert models.status_code == 200


def test_auth_off_lets_posts_through_without_a_header(h: Harness) -> None:
    answer = h.client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
    assert answer.status_code == 200


def test_unknown_request_id_is_404(h: Harness) -> None:
    answer = h.client.get(f"{REQUESTS}/nope")
    assert answer.status_code == 404 and "nope" in error(answer)["message"]
