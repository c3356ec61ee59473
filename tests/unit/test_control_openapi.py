"""The published OpenAPI schema matches the server: same routes, request bodies the schema
accepts are accepted (and the ones it refuses are refused), and every real answer has a
documented status code and a body that validates against the documented schema."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from ftengine.errors import BackendError
from ftengine.testbed.control.app import create_app
from ftengine.testbed.control.messages import FaultToleranceRequest
from ftengine.testbed.control.openai_messages import CompletionRequest, CompletionStreamResponse
from ftengine.testbed.control.openai_routes import Completions
from tests.unit.control_standin import POISON, Jobs, StandInCluster, StandInService, standin_model

APPLY, STATUS = "/fault_tolerance/apply", "/fault_tolerance/status"
REQ = "/fault_tolerance/requests/{request_id}"
COMPLETIONS = "/v1/completions"

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def schema_errors(
    value: Any, schema: dict[str, Any], root: dict[str, Any], at: str = "$"
) -> list[str]:
    """The subset of JSON Schema that msgspec and FastAPI emit, enough to judge bodies."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return schema_errors(value, root["components"]["schemas"][name], root, at)
    if "anyOf" in schema:
        options = [schema_errors(value, option, root, at) for option in schema["anyOf"]]
        return [] if any(not errors for errors in options) else [f"{at}: matches no anyOf option"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{at}: {value!r} not in {schema['enum']}"]
    kind = schema.get("type")
    if kind is not None:
        allowed = _TYPES[kind]
        if not isinstance(value, allowed) or (kind in ("integer", "number") and value is True):
            return [f"{at}: expected {kind}, found {type(value).__name__}"]
    errors = _bounds(value, schema, at)
    if isinstance(value, dict):
        errors += _object_errors(value, schema, root, at)
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            errors += schema_errors(item, schema["items"], root, f"{at}[{index}]")
    return errors


def _bounds(value: Any, schema: dict[str, Any], at: str) -> list[str]:
    checks: list[tuple[str, Callable[[Any, Any], bool]]] = [
        ("minLength", lambda v, b: len(v) >= b),
        ("maxLength", lambda v, b: len(v) <= b),
        ("minItems", lambda v, b: len(v) >= b),
        ("maxItems", lambda v, b: len(v) <= b),
        ("minimum", lambda v, b: v >= b),
        ("maximum", lambda v, b: v <= b),
    ]
    return [
        f"{at}: violates {key}={schema[key]}"
        for key, ok in checks
        if key in schema and not ok(value, schema[key])
    ]


def _object_errors(
    value: dict[str, Any], schema: dict[str, Any], root: dict[str, Any], at: str
) -> list[str]:
    properties = schema.get("properties", {})
    errors = [f"{at}: missing {key!r}" for key in schema.get("required", []) if key not in value]
    if schema.get("additionalProperties") is False:
        errors += [f"{at}: unexpected {key!r}" for key in value if key not in properties]
    for key, item in value.items():
        if key in properties:
            errors += schema_errors(item, properties[key], root, f"{at}.{key}")
    return errors


class Checked:
    """A TestClient wrapper that checks every answer against the published schema."""

    def __init__(self, cluster: StandInCluster | None = None, api_key: str | None = None) -> None:
        self.cluster, self.jobs = cluster or StandInCluster(), Jobs()
        completions = Completions(StandInService(self.cluster), standin_model())
        self.app = create_app(
            self.cluster, completions=completions, api_key=api_key, spawn=self.jobs
        )
        self.client = TestClient(self.app)
        self.schema: dict[str, Any] = self.client.get("/openapi.json").json()
        self.seen: set[tuple[str, str, int]] = set()

    def call(self, method: str, path: str, template: str | None = None, **kwargs: Any) -> Any:
        answer = self.client.request(method, path, **kwargs)
        documented = self.schema["paths"][template or path][method.lower()]["responses"]
        status = str(answer.status_code)
        assert status in documented, (
            f"{method} {path} answered {status}, documented {list(documented)}"
        )
        content = documented[status].get("content", {})
        media = answer.headers["content-type"].split(";")[0]
        assert media in {key.split(";")[0] for key in content}, f"{path}: {media} undocumented"
        if media == "application/json":
            errors = schema_errors(
                answer.json(), content["application/json"]["schema"], self.schema
            )
            assert errors == [], f"{method} {path} {status}: {errors}"
        if media == "text/event-stream":
            for event in stream_events(answer.text):
                errors = schema_errors(event, content[media]["schema"], self.schema)
                if "error" in event:  # an error event mid-stream is vLLM's error object
                    errors = schema_errors(event, self._ref("ErrorResponse"), self.schema)
                assert errors == [], f"{method} {path} {status} event {event}: {errors}"
        self.seen.add((method, template or path, answer.status_code))
        return answer

    @staticmethod
    def _ref(name: str) -> dict[str, Any]:
        return {"$ref": f"#/components/schemas/{name}"}


def stream_events(text: str) -> list[dict[str, Any]]:
    """The JSON events of a server-sent event stream, which must end with [DONE]."""
    data = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert data[-1] == "[DONE]", f"the stream must end with data: [DONE], got {data[-1:]}"
    return [msgspec.json.decode(item) for item in data[:-1]]


@pytest.fixture
def api() -> Iterator[Checked]:
    checked = Checked()
    with checked.client:
        yield checked


def test_schema_lists_exactly_the_served_routes(api: Checked) -> None:
    served = {
        (method.lower(), route.path)
        for route in api.app.routes
        if isinstance(route, APIRoute) and route.include_in_schema
        for method in route.methods or ()
    }
    published = {(method, path) for path, item in api.schema["paths"].items() for method in item}
    assert served == published
    assert {("post", APPLY), ("get", STATUS), ("post", COMPLETIONS), ("get", "/v1/models")} <= (
        published
    )
    assert not any(path.startswith("/v1/fault_tolerance") for _, path in published)


def test_request_bodies_are_the_decoding_structs(api: Checked) -> None:
    _, components = msgspec.json.schema_components(
        (FaultToleranceRequest, CompletionRequest, CompletionStreamResponse),
        ref_template="#/components/schemas/{name}",
    )
    published = api.schema["components"]["schemas"]
    for name, schema in components.items():
        assert published[name] == schema
    for path, struct in ((APPLY, "FaultToleranceRequest"), (COMPLETIONS, "CompletionRequest")):
        body = api.schema["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"]["$ref"].endswith(f"/{struct}")
        assert api.schema["paths"][path]["post"]["security"] == [{"HTTPBearer": []}]
    assert "scale_down" in api.schema["paths"][APPLY]["post"]["summary"]
    assert "#46370" in api.schema["paths"][APPLY]["post"]["summary"]


def test_every_answer_is_documented_and_matches_its_schema(api: Checked) -> None:
    api.call("GET", STATUS)
    api.call("GET", "/health")
    api.call("GET", "/metrics")
    api.call("GET", "/v1/models")
    api.call("POST", COMPLETIONS, json={"prompt": [1, 2], "max_tokens": 2})
    api.call("POST", COMPLETIONS, json={"prompt": [[1, 2], [3]], "return_token_ids": True})
    stream = {"prompt": [1], "max_tokens": 3, "stream": True}
    api.call("POST", COMPLETIONS, json={**stream, "stream_options": {"include_usage": True}})
    api.call("POST", COMPLETIONS, json={**stream, "prompt": [POISON]})
    api.call("POST", COMPLETIONS, json={"prompt": [POISON]})
    api.call("POST", COMPLETIONS, json={"prompt": [1, 99999]})
    api.call("POST", COMPLETIONS, json={"prompt": [1], "model": "other"})
    api.cluster.kill(3)
    api.call("GET", "/health")
    api.call("POST", COMPLETIONS, json={"prompt": [1]})
    body = {"instruction": "scale_down", "params": {"removed_dp_ranks": [3]}, "request_id": "s"}
    api.call("POST", APPLY, json=body)
    api.call("POST", APPLY, json=body)
    api.call("POST", APPLY, json={**body, "request_id": "t"})
    api.call("GET", "/fault_tolerance/requests/s", template=REQ)
    api.jobs.run_all()
    api.call("GET", "/fault_tolerance/requests/s", template=REQ)
    api.call("GET", "/fault_tolerance/requests/zz", template=REQ)
    api.call("POST", APPLY, json=body)
    api.call("POST", APPLY, json={"instruction": "nope"})
    api.call("GET", STATUS)
    statuses = {(path, status) for _, path, status in api.seen}
    expected = {(APPLY, 202), (APPLY, 200), (APPLY, 409), (APPLY, 400), (REQ, 200), (REQ, 404)}
    expected |= {("/health", 200), ("/health", 503), ("/v1/models", 200)}
    expected |= {(COMPLETIONS, code) for code in (200, 400, 404, 500, 503)}
    assert expected <= statuses


def test_auth_answers_are_documented_too() -> None:
    api = Checked(api_key="k")
    for method, path in (("POST", COMPLETIONS), ("POST", APPLY), ("GET", "/v1/models")):
        answer = api.call(method, path, json={"prompt": [1]} if method == "POST" else None)
        assert answer.status_code == 401


@pytest.mark.parametrize(
    "body",
    [
        {"instruction": "retry", "request_id": "a"},
        {"instruction": "retry", "params": {}, "request_id": "b"},
        {"instruction": "retry", "params": {}, "request_id": "c", "extra": 1},
        {"instruction": "restart", "params": {}, "request_id": "d"},
        {"instruction": "retry", "params": {}, "request_id": ""},
        {"instruction": "retry", "params": [], "request_id": "e"},
        {"params": {}, "request_id": "f"},
    ],
)
def test_the_server_accepts_exactly_the_bodies_the_schema_accepts(
    api: Checked, body: dict[str, Any]
) -> None:
    api.cluster.inject(0)
    schema_ok = (
        schema_errors(body, {"$ref": "#/components/schemas/FaultToleranceRequest"}, api.schema)
        == []
    )
    answer = api.call("POST", APPLY, json=body)
    assert (answer.status_code == 202) == schema_ok


def test_the_schema_checker_itself_catches_mismatches(api: Checked) -> None:
    result = {"$ref": "#/components/schemas/FaultToleranceResult"}
    request = {"$ref": "#/components/schemas/FaultToleranceRequest"}
    assert schema_errors({"request_id": "r", "success": True}, result, api.schema) == []
    assert schema_errors({"success": True}, result, api.schema) == ["$: missing 'request_id'"]
    assert schema_errors({"request_id": 1, "success": True}, result, api.schema) != []
    assert schema_errors({"request_id": "r", "success": 1}, result, api.schema) != []
    assert schema_errors({"instruction": "retry", "x": 1}, request, api.schema) == []
    assert schema_errors({"request_id": "r"}, request, api.schema) == ["$: missing 'instruction'"]
    assert schema_errors({"instruction": "go", "request_id": "r"}, request, api.schema) != []
    no_extras = {"type": "object", "properties": {}, "additionalProperties": False}
    assert schema_errors({"x": 1}, no_extras, api.schema) == ["$: unexpected 'x'"]


class ShutDown(StandInCluster):
    """A cluster that was shut down: every call raises, as ``Cluster`` does."""

    def status(self) -> dict[str, Any]:
        raise BackendError("the cluster was shut down; launch a new one")


def test_a_cluster_that_is_gone_answers_documented_503s() -> None:
    api = Checked(ShutDown())
    health = api.call("GET", "/health")
    assert health.status_code == 503 and "shut down" in health.json()["detail"]
    for method, path in (("GET", STATUS), ("GET", "/metrics")):
        answer = api.call(method, path)
        assert answer.status_code == 503 and "shut down" in answer.json()["error"]["message"]
    body = {"instruction": "retry", "params": {}, "request_id": "r"}
    assert api.call("POST", APPLY, json=body).status_code == 503
    assert api.jobs.queue == []
