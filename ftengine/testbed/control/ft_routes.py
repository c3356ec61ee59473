"""vLLM's fault-tolerance routes, no ``/v1`` prefix, exactly as vLLM serves them:
``POST /fault_tolerance/apply`` (202, recovery runs in the background) and
``GET /fault_tolerance/status``; plus ftengine's ``GET /fault_tolerance/requests/{id}``
(one command's record, for clients that send their own ``request_id``).
"""

from __future__ import annotations

import msgspec
from fastapi import Depends, FastAPI, HTTPException, Request, Response
from starlette.concurrency import run_in_threadpool

from ftengine.testbed.control.bodies import read_json_body
from ftengine.testbed.control.errors import ErrorResponse, clip
from ftengine.testbed.control.messages import (
    APPLY_PATH,
    REQUESTS_PATH,
    STATUS_PATH,
    ApplyAccepted,
    CommandRecord,
    FaultToleranceRequest,
    FaultToleranceResult,
    StatusBody,
)
from ftengine.testbed.control.openapi import json_body, responses
from ftengine.testbed.control.plane import ControlPlane
from ftengine.testbed.control.routing import (
    BAD_INPUT,
    TOO_LARGE,
    TOO_SLOW,
    UNAUTHORIZED,
    UNAVAILABLE,
    RequireKey,
    json_response,
)

APPLY_SUMMARY = (
    "Start a recovery command (retry; scale_down, which vLLM 0.33 does not accept yet: "
    "upstream PR #46370 adds it) in the background"
)


def add_fault_tolerance_routes(app: FastAPI, plane: ControlPlane, require_key: RequireKey) -> None:
    """Mount the three routes on ``app``; the POST needs the key when one is set."""
    _add_apply_route(app, plane, require_key)
    _add_status_routes(app, plane)


def _add_apply_route(app: FastAPI, plane: ControlPlane, require_key: RequireKey) -> None:
    @app.post(
        APPLY_PATH,
        status_code=202,
        summary=APPLY_SUMMARY,
        dependencies=[Depends(require_key)],
        openapi_extra=json_body(FaultToleranceRequest),
        responses=responses(
            {
                202: ("accepted (or a replay of a command still running)", ApplyAccepted),
                200: (
                    "a replay (same client request_id) of a finished command: its result",
                    FaultToleranceResult,
                ),
                409: (
                    "another command is running, or request_id reused differently",
                    ErrorResponse,
                ),
                UNAUTHORIZED[0]: UNAUTHORIZED[1],
                BAD_INPUT[0]: BAD_INPUT[1],
                TOO_LARGE[0]: TOO_LARGE[1],
                TOO_SLOW[0]: TOO_SLOW[1],
                UNAVAILABLE[0]: UNAVAILABLE[1],
            }
        ),
    )
    async def apply(request: Request) -> Response:
        body = await read_json_body(request)
        status, answer = await run_in_threadpool(plane.submit, body)
        return json_response(status, answer)


def _add_status_routes(app: FastAPI, plane: ControlPlane) -> None:
    @app.get(
        STATUS_PATH,
        summary="vLLM's status (lower-case status names) plus phase, removed ranks, epoch and "
        "the timeline per engine",
        responses=responses(
            {200: ("every engine's status", StatusBody), UNAVAILABLE[0]: UNAVAILABLE[1]}
        ),
    )
    def status() -> Response:
        return Response(msgspec.json.encode(plane.status()), media_type="application/json")

    @app.get(
        REQUESTS_PATH + "/{request_id}",
        summary="One command (ftengine's extension): running, or done with its result",
        responses=responses(
            {200: ("the command", CommandRecord), 404: ("unknown request_id", ErrorResponse)}
        ),
    )
    def command_record(request_id: str) -> Response:
        record = plane.record(request_id)
        if record is None:
            raise HTTPException(404, f"no command with request_id {clip(request_id)}")
        return json_response(200, record)
