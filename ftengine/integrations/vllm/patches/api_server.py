"""The vLLM names ftengine replaces in vLLM's API server: the FT router's payload check, so
that ``scale_down`` (vLLM 0.32 has only ``retry``) passes it, and a malformed one is a 400
with vLLM's error object, as vLLM answers a malformed ``retry``; the FT router's
registration, to warn when the routes answer anyone (``api_server.ft_routes``, which also
puts them behind the API key) and to put the DEAD-rank guard in front of every route
(``api_server.dead_rank``: ``/health`` 503, new requests 503 with ``Retry-After``); the
engine client's start, to hand the engine core its server's URL first
(``api_server.advertised_url``); the completion and chat-completion stream generators, so that a
stream whose request ended before its first token still gets its finishing chunk
(``api_server.stream_ends``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ftengine.errors import CommandRejected
from ftengine.integrations.vllm.api_server.advertised_url import export_url
from ftengine.integrations.vllm.api_server.dead_rank import DeadRankGuard
from ftengine.integrations.vllm.api_server.ft_routes import warn_if_open
from ftengine.integrations.vllm.api_server.rejoin_responder import answering_rejoins
from ftengine.integrations.vllm.api_server.scale_down_payload import INSTRUCTIONS, check_payload
from ftengine.integrations.vllm.api_server.stream_ends import (
    with_finishing_chat_chunks,
    with_finishing_chunks,
)
from ftengine.integrations.vllm.engine_core.entry import as_process_entry
from ftengine.integrations.vllm.messages import import_vllm
from ftengine.integrations.vllm.patches.mechanism import PATCHED_MARK, Patch, marked

ROUTER_MODULE = "vllm.entrypoints.serve.fault_tolerance.api_router"
COMPLETION_MODULE = "vllm.entrypoints.openai.completion.serving"
CHAT_MODULE = "vllm.entrypoints.openai.chat_completion.serving"
ENTRY_MODULE = "vllm.entrypoints.launchers.api_server.entry"
ENGINE_UTILS_MODULE = "vllm.v1.engine.utils"
CORE_MODULE = "vllm.v1.engine.core"


def _checking_scale_down(validate: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(validate)
    def validate_or_scale_down(body: Any) -> Any:
        instruction = body.get("instruction") if isinstance(body, dict) else None
        if instruction not in INSTRUCTIONS:
            return validate(body)  # vLLM's own checks and messages
        params = body.get("params", {})
        try:
            if not isinstance(params, dict):
                raise CommandRejected("'params' must be an object.")
            check_payload(str(instruction), params)
        except CommandRejected as exc:  # vLLM's own answer to a malformed command: 400
            raise import_vllm("fastapi").HTTPException(400, str(exc)) from exc
        return instruction, params

    setattr(validate_or_scale_down, PATCHED_MARK, validate)
    return validate_or_scale_down


SCALE_DOWN_PATCHES = (
    Patch(ROUTER_MODULE, "", "_validate_payload", ("body",), _checking_scale_down),
)


def _guarded_and_warning_when_open(original: Callable[..., Any]) -> Callable[..., Any]:
    def register_fault_tolerance_api_router(app: Any) -> Any:
        result = original(app)
        # Only with --enable-fault-tolerance (vLLM registers this router only then); added
        # before vLLM's own middleware, so authentication and CORS still run first.
        app.add_middleware(DeadRankGuard)
        warn_if_open(app.state.args)  # vLLM's build_app sets it before registering routers
        return result

    return register_fault_tolerance_api_router


def _exporting_url(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def build_async_engine_client(args: Any, **kwargs: Any) -> Any:
        if getattr(args, "enable_fault_tolerance", False):
            export_url(args)  # the engine core it starts inherits the environment
        return original(args, **kwargs)

    return build_async_engine_client


API_SERVER_PATCHES = (
    Patch(
        ROUTER_MODULE, "", "register_fault_tolerance_api_router", ("app",),
        marked(_guarded_and_warning_when_open),
    ),
    Patch(
        ENTRY_MODULE, "", "build_async_engine_client", ("args", "usage_context", "client_config"),
        marked(_exporting_url),
    ),
    # The engine cores this server starts install the rejoin patch before their DP start.
    Patch(
        CORE_MODULE, "EngineCoreProc", "run_engine_core", ("dp_rank", "local_dp_rank", "kwargs"),
        as_process_entry,
    ),
    Patch(
        ENGINE_UTILS_MODULE, "", "wait_for_engine_startup",
        (
            "handshake_socket", "core_engines", "parallel_config", "coordinated_dp",
            "cache_config", "launch",
        ),
        marked(answering_rejoins),
    ),
    Patch(
        COMPLETION_MODULE, "OpenAIServingCompletion", "completion_stream_generator",
        (
            "request", "engine_inputs", "result_generator", "request_id", "created_time",
            "model_name", "num_prompts", "tokenizer", "request_metadata",
        ),
        marked(with_finishing_chunks),
    ),
    Patch(
        CHAT_MODULE, "OpenAIServingChat", "chat_completion_stream_generator",
        (
            "request", "result_generator", "request_id", "model_name", "conversation",
            "tokenizer", "request_metadata", "chat_template_kwargs", "mm_token_counts",
        ),
        marked(with_finishing_chat_chunks),
    ),
)  # fmt: skip
