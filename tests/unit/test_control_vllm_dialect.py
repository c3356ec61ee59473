"""ftengine's API against vLLM's own code: the same bodies sent to vLLM's real
fault-tolerance router (mounted with vLLM's exception handlers over a stand-in engine
client) and to ftengine's get the same status code, error type and vLLM's message (ftengine
may say more after it); and every answer ftengine gives decodes with vLLM's pydantic
message types."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from ftengine.testbed.control.app import create_app
from ftengine.testbed.control.messages import ACCEPTED_MESSAGE
from ftengine.testbed.control.openai_routes import Completions
from tests.unit.control_standin import POISON, StandInCluster, StandInService, standin_model

ft_router = pytest.importorskip(
    "vllm.entrypoints.serve.fault_tolerance.api_router", reason="vllm is not installed"
)
handlers = pytest.importorskip("vllm.entrypoints.serve.exception_handling.register")
engine_protocol = pytest.importorskip("vllm.entrypoints.serve.engine.protocol")
completion_protocol = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
EngineStatusType = pytest.importorskip("vllm.v1.engine").EngineStatusType
FaultToleranceRequest = pytest.importorskip("vllm.v1.fault_tolerance.utils").FaultToleranceRequest
FaultToleranceResult = pytest.importorskip("vllm.v1.fault_tolerance.utils").FaultToleranceResult

APPLY, STATUS = "/fault_tolerance/apply", "/fault_tolerance/status"


class EngineClient:
    """What vLLM's router calls on ``app.state.engine_client``."""

    def __init__(self) -> None:
        self.handled: list[Any] = []

    async def handle_fault(self, request: Any) -> Any:
        self.handled.append(request)
        return FaultToleranceResult(request_id=request.request_id, success=True, reason=None)

    async def get_status(self) -> dict[str, Any]:
        return {"schema_version": 1, "total_engines": 1, "engines": []}


@pytest.fixture(scope="module")
def vllm() -> Iterator[TestClient]:
    app = FastAPI()
    ft_router.register_fault_tolerance_api_router(app)
    handlers.init_exception_handler(app)
    app.state.args = types.SimpleNamespace(log_error_stack=False)
    app.state.engine_client = EngineClient()
    with TestClient(app) as client:
        yield client


@pytest.fixture
def ours() -> Iterator[TestClient]:
    cluster = StandInCluster()
    cluster.inject(0)  # every engine UNHEALTHY: a retry is acceptable
    completions = Completions(StandInService(cluster), standin_model())
    with TestClient(
        create_app(cluster, completions=completions, spawn=lambda job, name: None)
    ) as c:
        yield c


def post(client: TestClient, content: bytes, content_type: str | None) -> Any:
    headers = {} if content_type is None else {"content-type": content_type}
    return client.post(APPLY, content=content, headers=headers)


JSON = "application/json"
BODIES: list[tuple[bytes, str | None]] = [
    (b"[1, 2]", JSON),
    (b'"retry"', JSON),
    (b"{}", JSON),
    (b'{"instruction": ""}', JSON),
    (b'{"instruction": "reboot"}', JSON),
    (b'{"instruction": 7}', JSON),
    (b'{"instruction": "retry", "params": []}', JSON),
    (b'{"instruction": "retry", "params": null}', JSON),
    (b"{oops", JSON),
    (b'{"instruction": "retry"}', "text/plain"),
    (b'{"instruction": "retry"}', None),
]


@pytest.mark.parametrize(("content", "content_type"), BODIES)
def test_bad_bodies_get_vllms_status_type_and_message(
    vllm: TestClient, ours: TestClient, content: bytes, content_type: str | None
) -> None:
    theirs, mine = post(vllm, content, content_type), post(ours, content, content_type)
    assert (mine.status_code, theirs.status_code) == (400, 400)
    their_error = engine_protocol.ErrorResponse.model_validate(theirs.json()).error
    my_error = engine_protocol.ErrorResponse.model_validate(mine.json()).error
    assert (my_error.type, my_error.code) == (their_error.type, their_error.code)
    # vLLM's validation handler wraps the media-type message in "1 validation error:".
    expected = their_error.message.removeprefix("1 validation error:\n").strip()
    assert my_error.message.startswith(expected), (my_error.message, their_error.message)


def test_an_accepted_retry_has_vllms_answer_and_a_server_made_id(
    vllm: TestClient, ours: TestClient
) -> None:
    body = msgspec.json.encode({"instruction": "retry", "params": {}})
    theirs, mine = post(vllm, body, JSON), post(ours, body, JSON)
    assert (mine.status_code, theirs.status_code) == (202, 202)
    assert set(theirs.json()) <= set(mine.json())
    assert mine.json()["message"] == theirs.json()["message"] == ACCEPTED_MESSAGE


def test_scale_down_is_ftengines_addition(vllm: TestClient, ours: TestClient) -> None:
    """vLLM 0.33 refuses scale_down (upstream PR #46370 adds it); ftengine accepts it."""
    body = msgspec.json.encode({"instruction": "scale_down", "params": {"removed_dp_ranks": [3]}})
    theirs = post(vllm, body, JSON)
    assert theirs.status_code == 400 and "Invalid instruction" in theirs.text
    assert post(ours, body, JSON).status_code == 202


def test_vllms_own_request_struct_is_accepted(ours: TestClient) -> None:
    request = FaultToleranceRequest(instruction="retry", params={}, request_id="from-vllm")
    answer = post(ours, msgspec.json.encode(request), JSON)
    assert answer.status_code == 202 and answer.json()["request_id"] == "from-vllm"


def test_status_names_are_engine_status_types(ours: TestClient) -> None:
    engines = ours.get(STATUS).json()["engines"]
    assert [EngineStatusType[e["status"].upper()] for e in engines] == [
        EngineStatusType.UNHEALTHY
    ] * 4
    assert all(e["status"] == e["status"].lower() for e in engines)


def test_completion_answers_decode_with_vllms_types(ours: TestClient) -> None:
    ours.app.state.plane.cluster.apply("retry", {}, "heal")  # type: ignore[attr-defined]
    body = {"model": "standin", "prompt": [[1, 2], [3]], "max_tokens": 3, "return_token_ids": True}
    vllm_request = completion_protocol.CompletionRequest.model_validate(body)
    assert vllm_request.return_token_ids is True, "our body is a valid vLLM request"
    answer = completion_protocol.CompletionResponse.model_validate(
        ours.post("/v1/completions", json=body).json()
    )
    assert [c.token_ids for c in answer.choices] == [[3, 4, 5], [4, 5, 6]]
    assert [c.finish_reason for c in answer.choices] == ["length", "length"]
    assert answer.usage.total_tokens == 9
    stream = ours.post("/v1/completions", json={**body, "stream": True}).text
    chunks = [part.removeprefix("data: ") for part in stream.split("\n\n") if part]
    assert chunks[-1] == "[DONE]"
    decoded = [
        completion_protocol.CompletionStreamResponse.model_validate_json(c) for c in chunks[:-1]
    ]
    assert sum(len(c.choices[0].token_ids or []) for c in decoded) == 6
    models = engine_protocol.ModelList.model_validate(ours.get("/v1/models").json())
    assert [card.id for card in models.data] == ["standin"]


def test_error_answers_decode_with_vllms_error_response(ours: TestClient) -> None:
    ours.app.state.plane.cluster.apply("retry", {}, "heal")  # type: ignore[attr-defined]
    for body, code in (
        ({"prompt": [1, 2, 99999]}, 400),
        ({"prompt": [1], "model": "x"}, 404),
        ({"prompt": [POISON]}, 500),
    ):
        answer = ours.post("/v1/completions", json=body)
        error = engine_protocol.ErrorResponse.model_validate(answer.json()).error
        assert answer.status_code == error.code == code
