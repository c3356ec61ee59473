"""OpenAI completion and model-list bodies, field for field as vLLM sends them (vLLM's
``CompletionRequest`` / ``CompletionResponse`` / ``CompletionStreamResponse`` /
``ModelList``), as msgspec structs that decode requests and document the schema.

``CompletionRequest`` lists every field ftengine reads or refuses; others are ignored, as
vLLM ignores fields it does not know. Which values are served is judged in
``ftengine.testbed.control.completions``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec

MAX_PROMPTS = 64
"""Prompts one request may carry (a list of texts or of token-id lists)."""

_IDS: dict[str, Any] = {"type": "array", "items": {"type": "integer", "minimum": 0}}
PROMPT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "maxItems": MAX_PROMPTS},
        _IDS,
        {"type": "array", "items": _IDS, "maxItems": MAX_PROMPTS},
    ],
    "description": "text, token ids, or a list of either (one choice per prompt)",
}


class StreamOptions(msgspec.Struct, kw_only=True):
    """``stream_options``: a last chunk with the usage, or usage on every chunk."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class CompletionRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/completions`` body. Served: ``prompt``, ``max_tokens``, greedy
    ``temperature`` (0 or absent), ``stream`` (+ ``stream_options``), ``stop_token_ids``,
    ``ignore_eos``, ``return_token_ids``, ``request_id``; the other listed fields only at
    their neutral values (anything else is a 400 naming the field)."""

    model: str | None = None
    prompt: Annotated[Any, msgspec.Meta(extra_json_schema=PROMPT_SCHEMA)] = None
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, msgspec.Meta(ge=0)]] | None = None
    ignore_eos: bool = False
    echo: bool | None = False
    logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    use_beam_search: bool = False
    suffix: str | None = None
    seed: int | None = None
    user: str | None = None
    return_token_ids: bool | None = None
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] | None = None


class UsageInfo(msgspec.Struct, kw_only=True):
    """Token counts of a response (or of a stream so far)."""

    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0


class CompletionChoice(msgspec.Struct, kw_only=True):
    """One prompt's completion. ``token_ids`` / ``prompt_token_ids`` only with
    ``return_token_ids``; ``stop_reason`` the stop token id (None for an end-of-sequence)."""

    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["length", "stop", "abort", "error"] | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    """The answer to a non-streaming completion request."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One server-sent event of a streaming completion (``data: <this>``; the stream ends
    with ``data: [DONE]``). ``usage`` only on the last chunk (``include_usage``) or on
    every chunk (``continuous_usage_stats``)."""

    id: str
    object: Literal["text_completion"]  # no default: omit_defaults must not drop it
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    """One served model in ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ftengine"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict[str, Any]] = msgspec.field(default_factory=list)


class ModelList(msgspec.Struct, kw_only=True):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


OPENAI_STRUCTS: tuple[type[msgspec.Struct], ...] = (
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ModelList,
)
