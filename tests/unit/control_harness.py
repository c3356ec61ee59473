"""The control API over the stand-ins, in process, and a snapshot of everything a refused
request must leave alone: every engine's status (phase, epoch, removed ranks, timeline),
the command ledger, the commands the cluster ran and the requests the service served."""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import httpx
from fastapi.testclient import TestClient

from ftengine.testbed.control.app import create_app
from ftengine.testbed.control.ledger import Submission
from ftengine.testbed.control.openai_routes import Completions
from ftengine.testbed.control.plane import ControlPlane
from ftengine.testbed.control.served_model import ServedModel
from tests.unit.control_standin import Jobs, StandInCluster, StandInService, standin_model

APPLY = "/fault_tolerance/apply"
STATUS = "/fault_tolerance/status"
REQUESTS = "/fault_tolerance/requests"
COMPLETIONS = "/v1/completions"
MODELS = "/v1/models"
JSON = {"content-type": "application/json"}


@attrs.frozen
class State:
    """What no refused request may change."""

    status: dict[str, Any]
    ledger: tuple[Submission, ...]
    running: str | None
    calls: tuple[tuple[str, dict[str, object], str], ...]
    served: tuple[object, ...]
    cancelled: tuple[object, ...]
    jobs: tuple[str, ...]


class Api:
    """One app over a fresh stand-in cluster (4 engines) and serving loop; background
    commands wait in ``jobs`` until a test runs them."""

    def __init__(self, api_key: str | None = None, model: ServedModel | None = None) -> None:
        self.cluster = StandInCluster()
        self.service = StandInService(self.cluster)
        self.jobs = Jobs()
        completions = Completions(self.service, model or standin_model())
        self.app = create_app(
            self.cluster, completions=completions, api_key=api_key, spawn=self.jobs
        )
        # A 500 must be seen as an answer, not re-raised into the test.
        self.client = TestClient(self.app, raise_server_exceptions=False)

    @property
    def plane(self) -> ControlPlane:
        plane = self.app.state.plane
        assert isinstance(plane, ControlPlane)
        return plane

    def async_client(self) -> httpx.AsyncClient:
        """An async client on the app (ASGI transport): requests really run concurrently."""
        transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)
        return httpx.AsyncClient(transport=transport, base_url="http://ftengine.test")

    def state(self) -> State:
        plane = self.plane
        return State(
            status=plane.status(),
            ledger=plane.ledger.entries(),
            running=plane.ledger.running,
            calls=tuple(self.cluster.calls),
            served=tuple(self.service.requests),
            cancelled=tuple(self.service.cancelled),
            jobs=tuple(name for name, _ in self.jobs.queue),
        )


class Answer(Protocol):
    """An HTTP answer (httpx's, or the TestClient's own httpx build)."""

    @property
    def status_code(self) -> int: ...

    def json(self) -> Any: ...


def error_object(answer: Answer) -> dict[str, Any]:
    """vLLM's / OpenAI's error object: exactly message, type, param, code (= the status)."""
    body = answer.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == answer.status_code
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return dict(body["error"])
