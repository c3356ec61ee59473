"""The HTTP control API (FastAPI): vLLM's fault-tolerance endpoints, health, metrics and a
generation endpoint, over one cluster.

Routes: ``POST /v1/fault_tolerance/apply``, ``GET /v1/fault_tolerance/status``,
``GET /v1/fault_tolerance/requests/{request_id}``, ``GET /health``, ``GET /metrics``,
``POST /v1/generate``. Every POST needs ``Authorization: Bearer <key>`` when a key is set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import msgspec
from fastapi import Depends, FastAPI, Request, Response, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

import ftengine
from ftengine.control.auth import ApiKeyGuard, Unauthorized
from ftengine.control.ledger import CommandConflict, Spawn, spawn_thread
from ftengine.control.messages import (
    SCHEMA_STRUCTS,
    ApplyAccepted,
    CommandRecord,
    ErrorBody,
    FaultToleranceRequest,
    FaultToleranceResult,
    GenerateRequest,
    GenerateResponse,
    HealthBody,
    InvalidRequest,
    StatusBody,
)
from ftengine.control.metrics import ControlMetrics
from ftengine.control.openapi import install_schema, json_body, responses
from ftengine.control.plane import ControlPlane
from ftengine.control.protocol import ClusterHandle
from ftengine.errors import FTEngineError

_UNAUTHORIZED = (401, ("missing or wrong bearer key (only when the server has a key)", ErrorBody))
_BAD_INPUT = (422, ("bad input; nothing changed", ErrorBody))
_UNAVAILABLE = (503, ("the cluster cannot answer now (shut down or failing)", ErrorBody))


def create_app(
    cluster: ClusterHandle,
    *,
    api_key: str | None = None,
    metrics: ControlMetrics | None = None,
    spawn: Spawn = spawn_thread,
) -> FastAPI:
    """Build the control API over ``cluster``; ``app.state.plane`` is its ``ControlPlane``."""
    plane = ControlPlane(cluster, metrics=metrics, spawn=spawn)
    app = FastAPI(
        title="ftengine control API",
        version=ftengine.__version__,
        description="vLLM-compatible fault-tolerance control, health and metrics.",
    )
    app.state.plane = plane
    _add_error_handlers(app)
    require_key = _KeyCheck(ApiKeyGuard(api_key))
    _add_fault_tolerance_routes(app, plane, require_key)
    _add_probe_routes(app, plane)
    _add_generate_route(app, plane, require_key)
    install_schema(app, SCHEMA_STRUCTS)
    return app


# Module level: FastAPI resolves the dependency's (string) annotations in this module.
_BEARER = HTTPBearer(auto_error=False, description="required on POSTs when a key is set")


class _KeyCheck:
    """Dependency of every POST: checks the bearer key (declared in OpenAPI via ``_BEARER``)."""

    def __init__(self, guard: ApiKeyGuard) -> None:
        self._guard = guard

    def __call__(
        self,
        request: Request,
        _credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER)],
    ) -> None:
        self._guard.check(request.headers.get("authorization"))


def _json(status: int, body: msgspec.Struct, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status, headers, media_type="application/json")


def _error(status: int, exc: Exception, headers: dict[str, str] | None = None) -> Response:
    return _json(status, ErrorBody(detail=str(exc)), headers)


def _add_error_handlers(app: FastAPI) -> None:
    async def invalid(_request: Request, exc: Exception) -> Response:
        return _error(422, exc)

    async def conflict(_request: Request, exc: Exception) -> Response:
        return _error(409, exc)

    async def unauthorized(_request: Request, exc: Exception) -> Response:
        return _error(401, exc, {"WWW-Authenticate": "Bearer"})

    async def unavailable(_request: Request, exc: Exception) -> Response:
        # Any other deliberate ftengine error means the cluster cannot serve this right now.
        return _error(503, FTEngineError(f"{type(exc).__name__}: {exc}"), {"Retry-After": "1"})

    async def request_invalid(_request: Request, exc: Exception) -> Response:
        return _error(422, exc)

    app.add_exception_handler(InvalidRequest, invalid)
    app.add_exception_handler(CommandConflict, conflict)
    app.add_exception_handler(Unauthorized, unauthorized)
    app.add_exception_handler(FTEngineError, unavailable)
    app.add_exception_handler(RequestValidationError, request_invalid)


def _add_fault_tolerance_routes(
    app: FastAPI, plane: ControlPlane, require_key: Callable[..., None]
) -> None:
    _add_apply_route(app, plane, require_key)
    _add_status_routes(app, plane)


def _add_apply_route(app: FastAPI, plane: ControlPlane, require_key: Callable[..., None]) -> None:
    @app.post(
        "/v1/fault_tolerance/apply",
        status_code=202,
        summary="Start a recovery command (retry | scale_down) in the background",
        dependencies=[Depends(require_key)],
        openapi_extra=json_body(FaultToleranceRequest),
        responses=responses(
            {
                202: ("accepted (or a replay of a command still running)", ApplyAccepted),
                200: ("a replay of a finished command: its recorded result", FaultToleranceResult),
                409: ("another command is running, or request_id reused differently", ErrorBody),
                _UNAUTHORIZED[0]: _UNAUTHORIZED[1],
                _BAD_INPUT[0]: _BAD_INPUT[1],
                _UNAVAILABLE[0]: _UNAVAILABLE[1],
            }
        ),
    )
    async def apply(request: Request) -> Response:
        status, body = await run_in_threadpool(plane.submit, await request.body())
        return _json(status, body)


def _add_status_routes(app: FastAPI, plane: ControlPlane) -> None:
    @app.get(
        "/v1/fault_tolerance/status",
        summary="vLLM-shaped status plus phase, removed ranks, epoch and timeline per engine",
        responses=responses(
            {200: ("every engine's status", StatusBody), _UNAVAILABLE[0]: _UNAVAILABLE[1]}
        ),
    )
    def status() -> Response:
        return Response(msgspec.json.encode(plane.status()), media_type="application/json")

    @app.get(
        "/v1/fault_tolerance/requests/{request_id}",
        summary="One command: running, or done with its result",
        responses=responses(
            {200: ("the command", CommandRecord), 404: ("unknown request_id", ErrorBody)}
        ),
    )
    def command_record(request_id: str) -> Response:
        record = plane.record(request_id)
        if record is None:
            return _error(404, KeyError(f"no command with request_id {request_id!r}"))
        return _json(200, record)


def _add_probe_routes(app: FastAPI, plane: ControlPlane) -> None:
    @app.get(
        "/health",
        summary="Readiness: 200 only when every live engine is HEALTHY and none recovers",
        responses=responses(
            {200: ("ready", HealthBody), 503: ("not ready (recovering or unhealthy)", HealthBody)}
        ),
    )
    def health() -> Response:
        body = plane.health()
        return _json(200 if body.healthy else 503, body)

    @app.get(
        "/metrics",
        summary="Prometheus metrics (text exposition format)",
        response_class=PlainTextResponse,
        responses=responses({_UNAVAILABLE[0]: _UNAVAILABLE[1]}),
    )
    def metrics() -> Response:
        return Response(plane.scrape(), media_type=CONTENT_TYPE_LATEST)


def _add_generate_route(
    app: FastAPI, plane: ControlPlane, require_key: Callable[..., None]
) -> None:
    @app.post(
        "/v1/generate",
        summary="Greedy generation on a live DP rank: prompt token ids in, new token ids out",
        dependencies=[Depends(require_key)],
        openapi_extra=json_body(GenerateRequest),
        responses=responses(
            {
                200: ("generated token ids", GenerateResponse),
                503: ("the cluster cannot serve now (recovering); retry later", ErrorBody),
                _UNAUTHORIZED[0]: _UNAUTHORIZED[1],
                _BAD_INPUT[0]: _BAD_INPUT[1],
            }
        ),
    )
    async def generate(request: Request) -> Response:
        try:
            body = msgspec.json.decode(await request.body(), type=GenerateRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise InvalidRequest(f"generate body does not match GenerateRequest: {exc}") from exc
        try:
            answer = await run_in_threadpool(plane.generate, body)
        except FTEngineError:
            plane.metrics.record_generation("unavailable")
            raise
        return _json(200, answer)
