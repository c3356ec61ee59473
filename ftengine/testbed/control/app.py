"""The HTTP API (FastAPI) over one cluster, in vLLM's dialect: its fault-tolerance routes
(``ftengine.testbed.control.ft_routes``), OpenAI completions and models
(``ftengine.testbed.control.openai_routes``), ``/health`` and ``/metrics``.

Every error is vLLM's error object. Every POST, and every ``/v1/`` route, needs
``Authorization: Bearer <key>`` when a key is set.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Annotated

from fastapi import FastAPI, Request, Response, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import ftengine
from ftengine.errors import FTEngineError
from ftengine.testbed.control.auth import ApiKeyGuard, Unauthorized
from ftengine.testbed.control.errors import ApiError, ErrorInfo, ErrorResponse
from ftengine.testbed.control.ft_routes import add_fault_tolerance_routes
from ftengine.testbed.control.ledger import CommandConflict, Spawn, spawn_thread
from ftengine.testbed.control.messages import SCHEMA_STRUCTS, HealthBody
from ftengine.testbed.control.metrics import ControlMetrics
from ftengine.testbed.control.openai_messages import OPENAI_STRUCTS
from ftengine.testbed.control.openai_routes import Completions, add_openai_routes
from ftengine.testbed.control.openapi import install_schema, responses
from ftengine.testbed.control.plane import ControlPlane
from ftengine.testbed.control.protocol import ClusterHandle
from ftengine.testbed.control.routing import UNAVAILABLE, json_response


def create_app(
    cluster: ClusterHandle,
    *,
    completions: Completions | None = None,
    api_key: str | None = None,
    metrics: ControlMetrics | None = None,
    spawn: Spawn = spawn_thread,
) -> FastAPI:
    """Build the API over ``cluster``; ``app.state.plane`` is its ``ControlPlane``.

    Without ``completions`` (a serving loop and the model it serves) only the
    fault-tolerance, health and metrics routes exist.
    """
    plane = ControlPlane(cluster, metrics=metrics, spawn=spawn)
    app = FastAPI(
        title="ftengine API",
        version=ftengine.__version__,
        description="vLLM-compatible fault-tolerance control, OpenAI completions, health "
        "and metrics.",
    )
    app.state.plane = plane
    _add_error_handlers(app)
    require_key = KeyCheck(ApiKeyGuard(api_key))
    add_fault_tolerance_routes(app, plane, require_key)
    _add_probe_routes(app, plane)
    if completions is not None:
        add_openai_routes(app, completions, plane.metrics, require_key)
    install_schema(app, (*SCHEMA_STRUCTS, *OPENAI_STRUCTS))
    return app


# Module level: FastAPI resolves the dependency's (string) annotations in this module.
_BEARER = HTTPBearer(auto_error=False, description="required when the server has a key")


class KeyCheck:
    """Dependency of every guarded route: checks the bearer key (declared via ``_BEARER``)."""

    def __init__(self, guard: ApiKeyGuard) -> None:
        self._guard = guard

    def __call__(
        self,
        request: Request,
        _credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER)],
    ) -> None:
        self._guard.check(request.headers.get("authorization"))


def _error(
    status: HTTPStatus,
    message: str,
    err_type: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    info = ErrorInfo(message=message, type=err_type or status.phrase, param=param, code=status)
    return json_response(status, ErrorResponse(error=info), headers)


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return json_response(exc.status, exc.body())

    async def conflict(_request: Request, exc: Exception) -> Response:
        return _error(HTTPStatus.CONFLICT, str(exc))

    async def unauthorized(_request: Request, exc: Exception) -> Response:
        return _error(HTTPStatus.UNAUTHORIZED, str(exc), headers={"WWW-Authenticate": "Bearer"})

    async def unavailable(_request: Request, exc: Exception) -> Response:
        # Any other deliberate ftengine error means the cluster cannot serve this right now.
        message = f"{type(exc).__name__}: {exc}"
        return _error(HTTPStatus.SERVICE_UNAVAILABLE, message, "ServiceUnavailableError",
                      headers={"Retry-After": "1"})  # fmt: skip

    async def invalid(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        loc = errors[0].get("loc") if errors and isinstance(errors[0], dict) else None
        param = ".".join(str(part) for part in loc) if loc else None
        return _error(HTTPStatus.BAD_REQUEST, f"{len(errors)} validation error(s): {errors}",
                      param=param)  # fmt: skip

    async def http_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        headers = dict(exc.headers) if exc.headers else None
        return _error(HTTPStatus(exc.status_code), str(exc.detail), headers=headers)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(CommandConflict, conflict)
    app.add_exception_handler(Unauthorized, unauthorized)
    app.add_exception_handler(FTEngineError, unavailable)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)


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
        return json_response(200 if body.healthy else 503, body)

    @app.get(
        "/metrics",
        summary="Prometheus metrics (text exposition format)",
        response_class=PlainTextResponse,
        responses=responses({UNAVAILABLE[0]: UNAVAILABLE[1]}),
    )
    def metrics() -> Response:
        return Response(plane.scrape(), media_type=CONTENT_TYPE_LATEST)
