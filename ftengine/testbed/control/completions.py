"""Judging a ``POST /v1/completions`` body at the API edge, before anything runs: types,
sizes, the served model's name, greedy-only sampling, and every prompt against the
model's limits (token ids inside the vocabulary, prompt plus ``max_tokens`` inside the
context), each refusal a 400 naming the field, the value and the limit, in vLLM's words
where vLLM has them. The result is a :class:`CompletionPlan` of generation requests.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import Any

import attrs
import msgspec

from ftengine.testbed.control.errors import InvalidCompletion, ModelNotFound, clip, decode_json
from ftengine.testbed.control.openai_messages import MAX_PROMPTS, CompletionRequest
from ftengine.testbed.control.served_model import ServedModel
from ftengine.testbed.model_limits import ModelLimits
from ftengine.testbed.serving_api import GenerationRequest

MAX_CHARS_PER_TOKEN = 32  # a text prompt longer than this many chars per position is refused
_AT = re.compile(r"at `\$\.([^`]*)`")

# Fields served only at their neutral values: (field, the values allowed, why). An absent
# temperature means greedy here; vLLM would sample with the model's default (1.0).
_NEUTRAL: tuple[tuple[str, tuple[Any, ...], str], ...] = (
    ("temperature", (None, 0), "ftengine decodes greedily only: send temperature 0"),
    ("n", (1,), "one choice per prompt"),
    ("best_of", (None, 1), "one choice per prompt"),
    ("use_beam_search", (False,), "greedy decoding only"),
    ("echo", (None, False), "echo is not supported"),
    ("logprobs", (None,), "logprobs are not supported"),
    ("suffix", (None,), "suffix is not supported"),
    ("stop", (None, "", []), "stop strings are not supported; use stop_token_ids"),
    ("presence_penalty", (None, 0), "penalties are not supported"),
    ("frequency_penalty", (None, 0), "penalties are not supported"),
    ("repetition_penalty", (None, 1), "penalties are not supported"),
    ("logit_bias", (None, {}), "logit_bias is not supported"),
    ("min_tokens", (0,), "min_tokens is not supported"),
)


@attrs.frozen
class CompletionPlan:
    """A judged completion request: one generation request per prompt, and how to answer."""

    completion_id: str
    model: str
    requests: tuple[GenerationRequest, ...]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    user_stop_ids: frozenset[int]


def plan_completion(body: bytes, model: ServedModel) -> CompletionPlan:
    """Judge ``body`` against ``model``; raises InvalidCompletion (400) or ModelNotFound."""
    request = decode_completion(body)
    if request.model and request.model != model.name:
        raise ModelNotFound(request.model, model.name)
    check_sampling(request)
    prompts = prompt_token_ids(request.prompt, model)
    limits = model.limits
    user_stop = frozenset(request.stop_token_ids or ())
    stop = user_stop if request.ignore_eos else user_stop | limits.eos_token_ids
    requests = tuple(
        GenerationRequest(prompt, max_new_tokens(request.max_tokens, len(prompt), limits), stop)
        for prompt in prompts
    )
    options = request.stream_options
    return CompletionPlan(
        completion_id=f"cmpl-{request.request_id or uuid.uuid4().hex}",
        model=model.name,
        requests=requests,
        stream=bool(request.stream),
        include_usage=bool(options and (options.include_usage or options.continuous_usage_stats)),
        continuous_usage=bool(options and options.continuous_usage_stats),
        return_token_ids=bool(request.return_token_ids),
        user_stop_ids=user_stop,
    )


def decode_completion(body: bytes) -> CompletionRequest:
    """The body as a CompletionRequest; a 400 naming the field whose type is wrong."""
    raw = decode_json(body)
    if not isinstance(raw, dict):
        raise InvalidCompletion(
            f"the request body must be a JSON object, found {type(raw).__name__}", param=None
        )
    try:
        request = msgspec.convert(raw, CompletionRequest)
    except msgspec.ValidationError as exc:
        found = _AT.search(str(exc))
        raise InvalidCompletion(
            f"the request does not match CompletionRequest: {exc}",
            param=found.group(1) if found else None,
        ) from exc
    if request.stream_options and not request.stream:
        raise InvalidCompletion(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    return request


def check_sampling(request: CompletionRequest) -> None:
    """Refuse every field set to a value that would change greedy decoding."""
    # msgspec already refused wrong types (a bool is no int there), so == is enough here.
    for field, allowed, why in _NEUTRAL:
        value = getattr(request, field)
        if value not in allowed:
            raise InvalidCompletion(
                f"{field}={clip(value)} is not supported: {why}", param=field, value=value
            )


def prompt_token_ids(prompt: object, model: ServedModel) -> list[tuple[int, ...]]:
    """Every prompt as token ids (text through the model's tokenizer), each checked."""
    if prompt is None or prompt == "" or prompt == []:
        raise InvalidCompletion(
            "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
        )
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts: Sequence[object] = [prompt]
    elif isinstance(prompt, list) and (
        all(isinstance(p, str) for p in prompt) or all(_is_ids(p) for p in prompt)
    ):
        if len(prompt) > MAX_PROMPTS:
            raise InvalidCompletion(
                f"prompt list length {len(prompt)} exceeds the maximum allowed count of "
                f"{MAX_PROMPTS}.",
                param="prompt",
            )
        prompts = prompt
    else:
        raise InvalidCompletion(
            "prompt must be a string, a list of token ids, a list of strings or a list of "
            f"token-id lists; found {_shape(prompt)}",
            param="prompt",
        )
    return [_one_prompt(p, index, model) for index, p in enumerate(prompts)]


def _one_prompt(prompt: object, index: int, model: ServedModel) -> tuple[int, ...]:
    limits = model.limits
    if isinstance(prompt, str):
        ids = _tokenize(prompt, model)
    else:
        assert isinstance(prompt, list)
        ids = list(prompt)
    if not ids:
        raise InvalidCompletion(f"prompt {index} is empty", param="prompt")
    bad = limits.out_of_vocab(ids)
    if bad is not None:
        raise InvalidCompletion(
            f"Token id {bad} is out of vocabulary: this model has {limits.vocab_size} tokens "
            f"(ids 0..{limits.vocab_size - 1})",
            param="prompt",
            value=bad,
        )
    if len(ids) > limits.max_model_len:
        raise InvalidCompletion(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"your prompt contains {len(ids)} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            param="input_tokens",
            value=len(ids),
        )
    return tuple(ids)


def _tokenize(text: str, model: ServedModel) -> list[int]:
    if model.tokenizer is None:
        raise InvalidCompletion(
            f"prompt is text, but this server has no tokenizer for the model "
            f'({model.tokenizer_note}); send token ids instead, e.g. "prompt": [1, 2, 3]',
            param="prompt",
        )
    limit = model.limits.max_model_len * MAX_CHARS_PER_TOKEN
    if len(text) > limit:
        raise InvalidCompletion(
            f"This model's maximum context length is {model.limits.max_model_len} tokens. "
            f"However, your prompt contains {len(text)} characters (more than {limit} "
            "characters, the upper bound this server tokenises). Please reduce the length "
            "of the input prompt.",
            param="input_text",
            value=len(text),
        )
    return model.tokenizer.encode(text)


def max_new_tokens(max_tokens: int | None, prompt_len: int, limits: ModelLimits) -> int:
    """``max_tokens`` checked against the context (None: all the room the prompt leaves)."""
    room = limits.max_model_len - prompt_len
    if max_tokens is None:
        if room < 1:
            raise InvalidCompletion(
                f"This model's maximum context length is {limits.max_model_len} tokens and "
                f"your prompt uses all {prompt_len} of them: no room is left for output "
                "tokens. Please reduce the length of the input prompt.",
                param="input_tokens",
                value=prompt_len,
            )
        return room
    if max_tokens < 1:
        raise InvalidCompletion(
            f"max_tokens must be at least 1 (echo is not supported), found {max_tokens}",
            param="max_tokens",
            value=max_tokens,
        )
    if max_tokens > limits.max_model_len:
        raise InvalidCompletion(
            f"max_tokens={max_tokens} cannot be greater than "
            f"max_model_len={limits.max_model_len}. Please request fewer output tokens.",
            param="max_tokens",
            value=max_tokens,
        )
    # vLLM 0.33 silently clamps max_tokens to the room left; refusing tells the client it
    # would get fewer tokens than it asked for.
    if prompt_len + max_tokens > limits.max_model_len:
        raise InvalidCompletion(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} in the completion). Please reduce the length of the prompt or "
            "max_tokens.",
            param="max_tokens",
            value=max_tokens,
        )
    return max_tokens


def _is_ids(value: object) -> bool:
    # JSON true/false decode as bool, which is an int subclass: never a token id.
    return isinstance(value, list) and all(type(v) is int for v in value)


def _shape(value: object) -> str:
    if isinstance(value, list):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a list of {', '.join(kinds)}"
    return type(value).__name__
