"""The vLLM names ftengine replaces in vLLM's API server: the FT router's payload check, so
that ``scale_down`` (vLLM 0.32 has only ``retry``) passes it, and a malformed one is a 400
with vLLM's error object, as vLLM answers a malformed ``retry``; the FT router's
registration, to warn when the routes answer anyone (``api_server.ft_routes``, which also
puts them behind the API key); the completion stream generator, so that a stream whose
request ended before its first token still gets its finishing chunk
(``api_server.stream_ends``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ftengine.errors import CommandRejected
from ftengine.integrations.vllm.api_server.ft_routes import warn_if_open
from ftengine.integrations.vllm.api_server.scale_down_payload import INSTRUCTION, check_payload
from ftengine.integrations.vllm.api_server.stream_ends import with_finishing_chunks
from ftengine.integrations.vllm.messages import import_vllm
from ftengine.integrations.vllm.patches.mechanism import PATCHED_MARK, Patch, marked

ROUTER_MODULE = "vllm.entrypoints.serve.fault_tolerance.api_router"
COMPLETION_MODULE = "vllm.entrypoints.openai.completion.serving"


def _checking_scale_down(validate: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(validate)
    def validate_or_scale_down(body: Any) -> Any:
        if not isinstance(body, dict) or body.get("instruction") != INSTRUCTION:
            return validate(body)  # vLLM's own checks and messages
        params = body.get("params", {})
        try:
            if not isinstance(params, dict):
                raise CommandRejected("'params' must be an object.")
            check_payload(INSTRUCTION, params)
        except CommandRejected as exc:  # vLLM's own answer to a malformed command: 400
            raise import_vllm("fastapi").HTTPException(400, str(exc)) from exc
        return INSTRUCTION, params

    setattr(validate_or_scale_down, PATCHED_MARK, validate)
    return validate_or_scale_down


SCALE_DOWN_PATCHES = (
    Patch(ROUTER_MODULE, "", "_validate_payload", ("body",), _checking_scale_down),
)


def _warning_when_open(original: Callable[..., Any]) -> Callable[..., Any]:
    def register_fault_tolerance_api_router(app: Any) -> Any:
        result = original(app)
        warn_if_open(app.state.args)  # vLLM's build_app sets it before registering routers
        return result

    return register_fault_tolerance_api_router


API_SERVER_PATCHES = (
    Patch(
        ROUTER_MODULE, "", "register_fault_tolerance_api_router", ("app",),
        marked(_warning_when_open),
    ),
    Patch(
        COMPLETION_MODULE, "OpenAIServingCompletion", "completion_stream_generator",
        (
            "request", "engine_inputs", "result_generator", "request_id", "created_time",
            "model_name", "num_prompts", "tokenizer", "request_metadata",
        ),
        marked(with_finishing_chunks),
    ),
)  # fmt: skip
