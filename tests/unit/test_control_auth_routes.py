"""With a key, every route that needs one (every POST, every ``/v1/`` route) refuses a
missing or wrong bearer key with vLLM's 401 error object and changes nothing; found by
walking the app's routes, so a route added without the check fails here. The read-only
probes (status, a command's record, health, metrics) stay open, as vLLM leaves its
``/fault_tolerance/status`` and probes open."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.routing import APIRoute

from ftengine.testbed.control.bodies import MAX_BODY_BYTES
from tests.unit.control_harness import APPLY, COMPLETIONS, MODELS, Api, error_object

KEY = "k3y-for-tests"
GOOD = {"Authorization": f"Bearer {KEY}"}
BAD_HEADERS: list[dict[str, str]] = [
    {},
    {"Authorization": ""},
    {"Authorization": "Bearer"},
    {"Authorization": "Bearer "},
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": KEY},
    {"Authorization": f"Bearer {KEY[:-1]}"},
    {"Authorization": f"Bearer {KEY}x"},
    {"Authorization": f"Bearer {KEY.upper()}"},
    {"Authorization": f"Bearer {KEY} extra"},
    {"Authorization": "Bearer \u00e9\u00ff"},  # latin-1 on the wire
    {"X-Api-Key": KEY},
]
BODIES = {
    APPLY: {"instruction": "scale_down", "params": {"removed_dp_ranks": [3]}, "request_id": "r"},
    COMPLETIONS: {"prompt": [1, 2], "max_tokens": 2},
}


@pytest.fixture
def api() -> Iterator[Api]:
    harness = Api(api_key=KEY)
    harness.cluster.kill(3)
    with harness.client:
        yield harness


def routes(api: Api) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, path parameters filled in."""
    found = []
    for route in api.app.routes:
        if isinstance(route, APIRoute):
            path = route.path.replace("{request_id}", "r")
            found += [(method, path) for method in sorted(route.methods)]
    return found


def guarded(method: str, path: str) -> bool:
    return method == "POST" or path.startswith("/v1/")


def test_the_guarded_routes_are_the_three_that_act_or_serve(api: Api) -> None:
    assert {r for r in routes(api) if guarded(*r)} == {
        ("POST", APPLY),
        ("POST", COMPLETIONS),
        ("GET", MODELS),
    }


@pytest.mark.parametrize("headers", BAD_HEADERS)
def test_every_guarded_route_refuses_a_missing_or_wrong_key(
    api: Api, headers: dict[str, str]
) -> None:
    raw = [(name.encode(), value.encode("latin-1")) for name, value in headers.items()]
    for method, path in filter(lambda r: guarded(*r), routes(api)):
        before = api.state()
        answer = api.client.request(method, path, json=BODIES.get(path), headers=raw)
        assert answer.status_code == 401, (method, path, answer.text)
        assert answer.headers["www-authenticate"] == "Bearer"
        info = error_object(answer)
        assert info["type"] == "Unauthorized"
        assert "Bearer <key>" in info["message"] or info["message"] == "wrong API key"
        assert api.state() == before, (method, path)


def test_the_key_is_checked_before_the_body_is_read(api: Api) -> None:
    """An unauthenticated client cannot make the server read (or judge) a body: a huge
    one, or a malformed one, is a 401, not a 413 or a 400."""
    for content in (b"x" * (MAX_BODY_BYTES + 1), b"{oops"):
        for path in (APPLY, COMPLETIONS):
            answer = api.client.post(path, content=content, headers={"content-type": "text/plain"})
            assert answer.status_code == 401, answer.text


def test_the_right_key_opens_every_guarded_route(api: Api) -> None:
    assert api.client.post(APPLY, json=BODIES[APPLY], headers=GOOD).status_code == 202
    api.jobs.run_all()  # healthy again: completions are served
    assert [call[2] for call in api.cluster.calls] == ["r"]
    for method, path in filter(lambda r: guarded(*r), routes(api)):
        answer = api.client.request(method, path, json=BODIES.get(path), headers=GOOD)
        assert answer.status_code == 200, (method, path, answer.text)


def test_the_read_only_routes_stay_open(api: Api) -> None:
    api.client.post(APPLY, json=BODIES[APPLY], headers=GOOD)
    for method, path in routes(api):
        if not guarded(method, path):
            answer = api.client.request(method, path)
            assert answer.status_code in (200, 503), (method, path, answer.text)
