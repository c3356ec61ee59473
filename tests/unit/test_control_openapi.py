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

from ftengine.control.app import create_app
from ftengine.control.messages import FaultToleranceRequest, GenerateRequest
from ftengine.errors import BackendError
from tests.unit.control_standin import Jobs, StandInCluster

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

    def __init__(self) -> None:
        self.cluster, self.jobs = StandInCluster(), Jobs()
        self.app = create_app(self.cluster, spawn=self.jobs)
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
        self.seen.add((method, template or path, answer.status_code))
        return answer


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
    assert ("post", "/v1/fault_tolerance/apply") in published


def test_request_bodies_are_the_decoding_structs(api: Checked) -> None:
    _, components = msgspec.json.schema_components(
        (FaultToleranceRequest, GenerateRequest), ref_template="#/components/schemas/{name}"
    )
    published = api.schema["components"]["schemas"]
    for name, schema in components.items():
        assert published[name] == schema
    for path, struct in (
        ("/v1/fault_tolerance/apply", "FaultToleranceRequest"),
        ("/v1/generate", "GenerateRequest"),
    ):
        body = api.schema["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"]["$ref"].endswith(f"/{struct}")
        assert api.schema["paths"][path]["post"]["security"] == [{"HTTPBearer": []}]


def test_every_answer_is_documented_and_matches_its_schema(api: Checked) -> None:
    apply, req = "/v1/fault_tolerance/apply", "/v1/fault_tolerance/requests/{request_id}"
    api.call("GET", "/v1/fault_tolerance/status")
    api.call("GET", "/health")
    api.call("GET", "/metrics")
    api.call("POST", "/v1/generate", json={"prompt_token_ids": [1, 2], "max_tokens": 2})
    api.cluster.kill(3)
    api.call("GET", "/health")
    api.call("POST", "/v1/generate", json={"prompt_token_ids": [1]})
    api.call("POST", "/v1/generate", json={"prompt_token_ids": []})
    body = {"instruction": "scale_down", "params": {"removed_dp_ranks": [3]}, "request_id": "s"}
    api.call("POST", apply, json=body)
    api.call("POST", apply, json=body)
    api.call("POST", apply, json={**body, "request_id": "t"})
    api.call("GET", "/v1/fault_tolerance/requests/s", template=req)
    api.jobs.run_all()
    api.call("GET", "/v1/fault_tolerance/requests/s", template=req)
    api.call("GET", "/v1/fault_tolerance/requests/zz", template=req)
    api.call("POST", apply, json=body)
    api.call("POST", apply, json={"instruction": "nope", "request_id": "x"})
    api.call("GET", "/v1/fault_tolerance/status")
    statuses = {(path, status) for _, path, status in api.seen}
    expected = {(apply, 202), (apply, 200), (apply, 409), (apply, 422), (req, 200), (req, 404)}
    expected |= {("/health", 200), ("/health", 503), ("/v1/generate", 503), ("/v1/generate", 422)}
    assert expected <= statuses


def test_auth_answers_are_documented_too() -> None:
    cluster, jobs = StandInCluster(), Jobs()
    client = TestClient(create_app(cluster, api_key="k", spawn=jobs))
    schema = client.get("/openapi.json").json()
    answer = client.post("/v1/generate", json={"prompt_token_ids": [1]})
    assert answer.status_code == 401
    assert "401" in schema["paths"]["/v1/generate"]["post"]["responses"]
    assert schema_errors(answer.json(), {"$ref": "#/components/schemas/ErrorBody"}, schema) == []


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
    answer = api.call("POST", "/v1/fault_tolerance/apply", json=body)
    assert (answer.status_code == 202) == schema_ok


def test_the_schema_checker_itself_catches_mismatches(api: Checked) -> None:
    result = {"$ref": "#/components/schemas/FaultToleranceResult"}
    request = {"$ref": "#/components/schemas/FaultToleranceRequest"}
    assert schema_errors({"request_id": "r", "success": True}, result, api.schema) == []
    assert schema_errors({"success": True}, result, api.schema) == ["$: missing 'request_id'"]
    assert schema_errors({"request_id": 1, "success": True}, result, api.schema) != []
    assert schema_errors({"request_id": "r", "success": 1}, result, api.schema) != []
    body = {"instruction": "retry", "request_id": "r", "x": 1}
    assert schema_errors(body, request, api.schema) == ["$: unexpected 'x'"]
    assert schema_errors({"instruction": "go", "request_id": "r"}, request, api.schema) != []


class ShutDown(StandInCluster):
    """A cluster that was shut down: every call raises, as ``Cluster`` does."""

    def status(self) -> dict[str, Any]:
        raise BackendError("the cluster was shut down; launch a new one")


def test_a_cluster_that_is_gone_answers_documented_503s() -> None:
    api = Checked()
    api.app = create_app(ShutDown(), spawn=api.jobs)
    api.client = TestClient(api.app)
    health = api.call("GET", "/health")
    assert health.status_code == 503 and "shut down" in health.json()["detail"]
    for method, path in (("GET", "/v1/fault_tolerance/status"), ("GET", "/metrics")):
        answer = api.call(method, path)
        assert answer.status_code == 503 and "shut down" in answer.json()["detail"]
    body = {"instruction": "retry", "params": {}, "request_id": "r"}
    assert api.call("POST", "/v1/fault_tolerance/apply", json=body).status_code == 503
    assert api.jobs.queue == []
