"""A DEAD rank's API server tells the truth, against vLLM's own ``/health`` route and error
object: ``/health`` 503 once every engine it feeds is ``dead`` (200 while ``unhealthy``:
recovering), a new completion refused with 503, ``Retry-After`` and vLLM's error JSON, reads
and the FT routes still answered; the URL each API server hands its engine core."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from typing import Any

import pytest

from ftengine.integrations.vllm.api_server.advertised_url import advertised_url, export_url
from ftengine.integrations.vllm.api_server.dead_rank import RETRY_AFTER_S, DeadRankGuard, all_dead
from ftengine.integrations.vllm.messages import API_KEY_ENV, API_URL_ENV
from ftengine.integrations.vllm.patches import api_server as patches

health = pytest.importorskip("vllm.entrypoints.serve.instrumentator.health")
engine_protocol = pytest.importorskip("vllm.entrypoints.serve.engine.protocol")
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402


class EngineClient:
    """vLLM's ``EngineClient`` as the guard and vLLM's ``/health`` use it: ``get_status``
    (the client's cached FT statuses, ``AsyncMPClient.get_status``'s shape) and
    ``check_health`` (raises only once the client itself is errored)."""

    def __init__(self, *statuses: str) -> None:
        self.statuses = list(statuses)

    async def get_status(self) -> dict[str, Any]:
        engines = [{"id": i, "status": s} for i, s in enumerate(self.statuses)]
        return {"schema_version": 1, "total_engines": len(engines), "engines": engines}

    async def check_health(self) -> None:
        return None  # vLLM's engine-core client is not errored while its engine is DEAD


def server(engine: EngineClient, *, guarded: bool = True) -> TestClient:
    """vLLM's own ``/health`` route and stand-ins of its other routes behind the guard."""
    app = FastAPI()
    app.include_router(health.router)
    app.state.engine_client = engine

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, str]:
        return {"object": "text_completion"}

    @app.get("/v1/models")
    async def models() -> dict[str, str]:
        return {"object": "list"}

    @app.post("/fault_tolerance/apply")
    async def apply() -> dict[str, str]:
        return {"message": "Request accepted"}

    @app.get("/fault_tolerance/status")
    async def status() -> dict[str, Any]:
        return await engine.get_status()  # vLLM's route: the client's cached statuses

    if guarded:
        app.add_middleware(DeadRankGuard)
    return TestClient(app)


def test_vllm_alone_says_healthy_and_accepts_work_on_a_dead_rank() -> None:
    """What the issue found: vLLM's /health asks only whether its client errored."""
    client = server(EngineClient("dead"), guarded=False)
    assert client.get("/health").status_code == 200
    assert client.post("/v1/completions", json={}).status_code == 200


def test_a_dead_rank_fails_its_health_check_and_refuses_new_work_saying_so() -> None:
    client = server(EngineClient("dead"))
    assert client.get("/health").status_code == 503
    refused = client.post("/v1/completions", json={"prompt": "hi"})
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == str(RETRY_AFTER_S)
    error = engine_protocol.ErrorResponse.model_validate(refused.json()).error  # vLLM's shape
    assert (error.code, error.type) == (503, "ServiceUnavailableError")
    assert "DEAD" in error.message and "load balancer" in error.message
    assert client.get("/v1/models").status_code == 200  # reads still answer
    assert client.post("/fault_tolerance/apply", json={}).status_code == 200  # the orchestrator


@pytest.mark.parametrize("statuses", [("healthy",), ("unhealthy",), ("dead", "healthy"), ()])
def test_a_rank_that_serves_or_will_serve_again_answers_as_vllm_does(
    statuses: tuple[str, ...],
) -> None:
    """``unhealthy`` holds its requests and resumes them: the balancer keeps it (every DP
    peer is unhealthy for a moment after any rank's fault)."""
    client = server(EngineClient(*statuses))
    assert client.get("/health").status_code == 200
    assert client.post("/v1/completions", json={}).status_code == 200


def test_all_dead_reads_vllms_status_shape() -> None:
    assert all_dead({"engines": [{"id": 0, "status": "dead"}]})
    assert not all_dead({"engines": []}) and not all_dead({}) and not all_dead(None)
    assert not all_dead({"engines": [{"status": "dead"}, {"status": "unhealthy"}]})


def test_the_patched_ft_router_registration_puts_the_guard_in_front() -> None:
    app = FastAPI()
    app.state.args = argparse.Namespace(host="127.0.0.1", port=8000, api_key=None)
    registered: list[Any] = []
    patches._guarded_and_warning_when_open(registered.append)(app)
    assert registered == [app]
    classes: list[object] = [m.cls for m in app.user_middleware]
    assert classes == [DeadRankGuard]


def flags(**given: Any) -> argparse.Namespace:
    """vLLM's API-server flags the URL is made of (its defaults otherwise)."""
    defaults = dict(
        host=None, port=8000, uds=None, ssl_keyfile=None, ssl_certfile=None, api_key=None
    )
    return argparse.Namespace(**(defaults | given))


def test_the_advertised_url_is_reachable_from_the_peers() -> None:
    assert advertised_url(flags(host="10.0.0.5", port=8001)) == "http://10.0.0.5:8001"
    for wildcard in (None, "", "0.0.0.0", "::"):  # every interface: the host's address
        assert advertised_url(flags(host=wildcard), lambda: "10.1.2.3") == "http://10.1.2.3:8000"
    assert advertised_url(flags(host="::1")) == "http://[::1]:8000"
    assert advertised_url(flags(ssl_keyfile="k", ssl_certfile="c"), lambda: "h") == "https://h:8000"
    assert advertised_url(flags(uds="/tmp/vllm.sock")) is None


@pytest.fixture
def no_url(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Neither variable set; whatever the test's exports set is undone after it (a
    ``delenv`` of an absent variable alone records nothing to undo)."""
    for name in (API_URL_ENV, API_KEY_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    yield


def test_the_engine_client_start_exports_the_url_first(
    no_url: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The patched ``build_async_engine_client`` (which starts the engine core, inheriting
    the environment) exports it with fault tolerance on, and an operator's value wins."""
    seen: list[str | None] = []

    def build(args: argparse.Namespace, **kwargs: Any) -> str:
        seen.append(os.environ.get(API_URL_ENV))
        return f"client({kwargs})"

    start = patches._exporting_url(build)
    assert start(flags(host="127.0.0.1", enable_fault_tolerance=False), client_config=None)
    assert seen == [None]
    assert start(flags(host="127.0.0.1", port=8005, enable_fault_tolerance=True)) == "client({})"
    assert seen[-1] == "http://127.0.0.1:8005"
    assert API_KEY_ENV not in os.environ  # no --api-key
    monkeypatch.setenv(API_URL_ENV, "http://public.example:80")
    export_url(flags(host="127.0.0.1", api_key=["sk-1", "sk-2"]))
    assert os.environ[API_URL_ENV] == "http://public.example:80"
    assert os.environ[API_KEY_ENV] == "sk-1"  # the survivors ask for it


class ReasonedEngineClient(EngineClient):
    """Engines that are DEAD with ``fault_info`` (ftengine's reason in the status)."""

    def __init__(self, reason: str) -> None:
        super().__init__("dead")
        self.reason = reason

    async def get_status(self) -> dict[str, Any]:
        status = await super().get_status()
        for engine in status["engines"]:
            engine["fault_info"] = self.reason
        return status


def test_a_refusal_names_why_the_engine_is_dead() -> None:
    why = "policy gave up: network partition: engine 3 reaches live DP ranks [3] of [0, 1, 2, 3]"
    reply = server(ReasonedEngineClient(why)).post("/v1/completions", json={})
    assert reply.status_code == 503
    assert why in reply.json()["error"]["message"]


class GoneEngineClient(EngineClient):
    """vLLM's client after its engine-core monitor saw the process exit: ``errored``, the
    last pushed statuses still cached (``healthy``), ``check_health`` raising."""

    errored = True

    async def check_health(self) -> None:
        raise RuntimeError("EngineDeadError")  # vLLM's /health then answers 503 itself


def test_a_rank_whose_engine_core_exited_reports_dead_not_its_stale_cache() -> None:
    stale = server(GoneEngineClient("healthy"), guarded=False).get("/fault_tolerance/status")
    assert stale.json()["engines"][0]["status"] == "healthy"  # vLLM alone: its stale cache
    client = server(GoneEngineClient("healthy"))
    status = client.get("/fault_tolerance/status")
    assert status.status_code == 200
    (engine,) = status.json()["engines"]
    assert (engine["id"], engine["status"], engine["phase"]) == (0, "dead", "dead")
    assert "engine core process exited" in engine["fault_info"]
    assert client.get("/health").status_code == 503
    refused = client.post("/v1/completions", json={})
    assert refused.status_code == 503 and "engine core process exited" in refused.text
    alive = server(EngineClient("healthy"))  # not errored: vLLM's own answer
    assert alive.post("/v1/completions", json={}).status_code == 200
