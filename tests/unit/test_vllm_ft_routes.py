"""The FT routes behind vLLM's API key: vLLM's own ``AuthenticationMiddleware`` (the installed
one) in front of a stand-in app, with and without ftengine's guard; the start-up warning."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace

import pytest

from ftengine.integrations.vllm.api_server import ft_routes as ft_routes_auth
from ftengine.integrations.vllm.patches.api_server import API_SERVER_PATCHES, ROUTER_MODULE
from ftengine.integrations.vllm.patches.mechanism import VllmSeamMoved

authenticate = pytest.importorskip("vllm.entrypoints.serve.middleware.authenticate")
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

KEY = "sk-ft-test"


@pytest.fixture
def vllm_prefixes() -> Iterator[tuple[str, ...]]:
    """vLLM's prefixes as installed, restored after the test (the guard changes them)."""
    before: tuple[str, ...] = authenticate.GUARDED_PREFIX
    yield tuple(p for p in before if p != ft_routes_auth.FT_PREFIX)
    authenticate.GUARDED_PREFIX = before


def _client() -> TestClient:
    async def accepted(request: Request) -> JSONResponse:
        return JSONResponse({"message": "Request accepted"}, status_code=202)

    async def ok(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    app = Starlette(
        routes=[
            Route("/fault_tolerance/apply", accepted, methods=["POST"]),
            Route("/fault_tolerance/status", ok),
            Route("/health", ok),
            Route("/v1/models", ok),
        ]
    )
    app.add_middleware(authenticate.AuthenticationMiddleware, tokens=[KEY])
    return TestClient(app)


def test_vllm_alone_leaves_the_ft_routes_open(vllm_prefixes: tuple[str, ...]) -> None:
    """What the issue measured: with a key, /v1 is 401 and apply is 202."""
    authenticate.GUARDED_PREFIX = vllm_prefixes
    client = _client()
    assert client.get("/v1/models").status_code == 401
    assert client.post("/fault_tolerance/apply", json={}).status_code == 202


def test_guarded_ft_routes_need_the_key_in_vllms_shape(vllm_prefixes: tuple[str, ...]) -> None:
    authenticate.GUARDED_PREFIX = vllm_prefixes
    ft_routes_auth.guard_ft_routes()
    ft_routes_auth.guard_ft_routes()  # idempotent
    assert (*vllm_prefixes, "/fault_tolerance") == authenticate.GUARDED_PREFIX
    client = _client()
    body = {"instruction": "scale_down", "params": {"dead_dp_ranks": [1]}}
    for method, path in (("POST", "/fault_tolerance/apply"), ("GET", "/fault_tolerance/status")):
        payload = body if method == "POST" else None
        refused = client.request(method, path, json=payload)
        assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
        wrong = client.request(method, path, json=payload, headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 401
        good = client.request(
            method, path, json=payload, headers={"Authorization": f"Bearer {KEY}"}
        )
        assert good.status_code == (202 if method == "POST" else 200)
    assert client.get("/health").status_code == 200  # vLLM leaves /health open


def test_a_vllm_that_stops_guarding_by_prefix_fails_loudly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    moved = ModuleType(ft_routes_auth.AUTH_MODULE)

    class AuthenticationMiddleware:
        def __call__(self, scope: object, receive: object, send: object) -> None:
            return None  # guards by something else

    moved.AuthenticationMiddleware = AuthenticationMiddleware  # type: ignore[attr-defined]
    moved.GUARDED_PREFIX = ("/v1",)  # type: ignore[attr-defined]
    monkeypatch.setattr(ft_routes_auth, "import_vllm", lambda name: moved)
    with pytest.raises(VllmSeamMoved, match="GUARDED_PREFIX"):
        ft_routes_auth.guard_ft_routes()
    del moved.GUARDED_PREFIX
    with pytest.raises(VllmSeamMoved, match="GUARDED_PREFIX"):
        ft_routes_auth.guard_ft_routes()


def test_the_start_up_check_patches_vllms_router_registration() -> None:
    """The patched name exists with the parameters ftengine expects (vLLM moved it: fails)."""
    check = API_SERVER_PATCHES[0]
    owner, original = check.target()
    assert owner.__name__ == ROUTER_MODULE
    assert original.__name__ == "register_fault_tolerance_api_router"


@pytest.mark.parametrize(
    ("host", "api_key", "env_key", "warned"),
    [
        (None, None, None, True),  # vLLM's default: every interface
        ("0.0.0.0", None, None, True),
        ("10.1.2.3", None, "", True),
        ("node-a", None, None, True),
        ("127.0.0.1", None, None, False),
        ("::1", None, None, False),
        ("localhost", None, None, False),
        ("0.0.0.0", [KEY], None, False),
        ("0.0.0.0", None, KEY, False),
        ("0.0.0.0", [""], None, True),
    ],
)
def test_an_open_server_beyond_loopback_warns_at_start_up(
    host: str | None,
    api_key: list[str] | None,
    env_key: str | None,
    warned: bool,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(
        ft_routes_auth, "import_vllm", lambda name: SimpleNamespace(VLLM_API_KEY=env_key)
    )
    args = argparse.Namespace(host=host, port=8000, api_key=api_key)
    with caplog.at_level(logging.WARNING, logger=ft_routes_auth.__name__):
        assert ft_routes_auth.warn_if_open(args) is warned
    assert ("open to anyone" in caplog.text) is warned
    if warned:
        assert "--api-key" in caplog.text
