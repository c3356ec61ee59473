"""OpenAI-compatible routes over the cluster's serving loop: ``POST /v1/completions``
(JSON, or server-sent events with ``stream: true``) and ``GET /v1/models``.

Concurrent requests are served concurrently: each prompt joins the serving loop's next
step (continuous batching), so a request never waits for another to finish.
"""

from __future__ import annotations

import attrs
import msgspec
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from ftengine.testbed.control.bodies import read_json_body
from ftengine.testbed.control.completion_run import CompletionRun
from ftengine.testbed.control.completions import plan_completion
from ftengine.testbed.control.errors import ApiError, ErrorResponse
from ftengine.testbed.control.metrics import ControlMetrics
from ftengine.testbed.control.openai_messages import (
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ModelCard,
    ModelList,
)
from ftengine.testbed.control.openapi import json_body, responses
from ftengine.testbed.control.protocol import GenerationService
from ftengine.testbed.control.routing import (
    BAD_INPUT,
    TOO_LARGE,
    TOO_SLOW,
    UNAUTHORIZED,
    UNAVAILABLE,
    RequireKey,
    json_response,
)
from ftengine.testbed.control.served_model import ServedModel

COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"


@attrs.frozen
class Completions:
    """What the OpenAI routes serve: a generation service and the model it runs."""

    service: GenerationService
    model: ServedModel


def add_openai_routes(
    app: FastAPI, completions: Completions, metrics: ControlMetrics, require_key: RequireKey
) -> None:
    """Mount ``/v1/completions`` and ``/v1/models`` (both need the key when one is set)."""
    _add_completions_route(app, completions, metrics, require_key)
    _add_models_route(app, completions.model, require_key)


def _add_completions_route(
    app: FastAPI, completions: Completions, metrics: ControlMetrics, require_key: RequireKey
) -> None:
    media: dict[str, type[msgspec.Struct]] = {
        "application/json": CompletionResponse,
        "text/event-stream": CompletionStreamResponse,
    }

    @app.post(
        COMPLETIONS_PATH,
        summary="OpenAI completions, greedy: JSON, or server-sent events with stream: true",
        dependencies=[Depends(require_key)],
        openapi_extra=json_body(CompletionRequest),
        responses=responses(
            {
                200: ("the completion, or its chunks ending with data: [DONE]", media),
                404: ("the request names a model this server does not serve", ErrorResponse),
                500: ("a prompt could not be computed (it alone failed)", ErrorResponse),
                UNAUTHORIZED[0]: UNAUTHORIZED[1],
                BAD_INPUT[0]: BAD_INPUT[1],
                TOO_LARGE[0]: TOO_LARGE[1],
                TOO_SLOW[0]: TOO_SLOW[1],
                UNAVAILABLE[0]: UNAVAILABLE[1],
            }
        ),
    )
    async def create_completion(request: Request) -> Response:
        try:
            body = await read_json_body(request)
            plan = plan_completion(body, completions.model)
        except ApiError:
            metrics.record_completion_request("rejected")
            raise
        run = CompletionRun(plan, completions.model.tokenizer, metrics)
        run.start(completions.service)
        if plan.stream:
            return StreamingResponse(run.stream(), media_type="text/event-stream")
        return json_response(200, await run.response())


def _add_models_route(app: FastAPI, model: ServedModel, require_key: RequireKey) -> None:
    @app.get(
        MODELS_PATH,
        summary="The served model (one), with its context length",
        dependencies=[Depends(require_key)],
        responses=responses(
            {200: ("the served models", ModelList), UNAUTHORIZED[0]: UNAUTHORIZED[1]}
        ),
    )
    def list_models() -> Response:
        card = ModelCard(
            id=model.name,
            created=model.created,
            root=model.root,
            max_model_len=model.limits.max_model_len,
        )
        return json_response(200, ModelList(data=[card]))
