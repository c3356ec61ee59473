"""vLLM's own completion stream generator (the installed one, not a copy) swallows the
finishing chunk of a request that ended before its first token; with ftengine's patch the
stream says how it ended. The chaos campaign's "lost" streams were these."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from ftengine.integrations.vllm.api_server.stream_ends import (
    with_finishing_chat_chunks,
    with_finishing_chunks,
)

serving = pytest.importorskip("vllm.entrypoints.openai.completion.serving")
from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata  # noqa: E402
from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # noqa: E402
from vllm.outputs import CompletionOutput, RequestOutput  # noqa: E402

PROMPT = [11, 12, 13]


def _server() -> Any:
    """vLLM's OpenAIServingCompletion with only what its stream generator reads."""
    server = object.__new__(serving.OpenAIServingCompletion)
    server.enable_force_include_usage = False
    server.system_fingerprint = None
    server.enable_prompt_tokens_details = False
    server.enable_per_request_metrics = False
    return server


def _output(tokens: list[int], finish: str | None, stop: str | None = None, index: int = 0) -> Any:
    return CompletionOutput(
        index=index,
        text=" ".join(f"w{t}" for t in tokens),
        token_ids=tokens,
        cumulative_logprob=None,
        logprobs=None,
        finish_reason=finish,
        stop_reason=stop,
    )


def _stream(
    generator: Callable[..., Any], outputs: list[list[Any]], **request: Any
) -> list[dict[str, Any] | str]:
    async def results() -> AsyncIterator[tuple[int, Any]]:
        for step in outputs:
            finished = any(o.finish_reason is not None for o in step)
            yield 0, RequestOutput("r", "p", PROMPT, None, step, finished)

    body = CompletionRequest(
        model="m", prompt=PROMPT, max_tokens=4, stream=True, return_token_ids=True, **request
    )

    async def lines() -> list[str]:
        metadata = RequestResponseMetadata(request_id="r")
        args = (body, [None], results(), "r", 7, "m")
        kwargs = {"num_prompts": 1, "tokenizer": None, "request_metadata": metadata}
        return [line async for line in generator(_server(), *args, **kwargs)]

    return [
        line if line == "data: [DONE]\n\n" else json.loads(line.removeprefix("data: "))
        for line in asyncio.run(lines())
    ]


ORIGINAL = serving.OpenAIServingCompletion.completion_stream_generator
PATCHED = with_finishing_chunks(ORIGINAL)
ABORTED_FIRST = [[_output([], None)], [_output([], "abort", "engine 1 faulted")]]


def test_vllm_alone_ends_a_stream_aborted_before_its_first_token_with_no_reason() -> None:
    assert _stream(ORIGINAL, ABORTED_FIRST) == ["data: [DONE]\n\n"]


def test_the_patched_stream_sends_the_finishing_chunk_it_skipped() -> None:
    *chunks, done = _stream(PATCHED, ABORTED_FIRST)
    assert done == "data: [DONE]\n\n"
    assert len(chunks) == 1 and isinstance(chunks[0], dict)
    (choice,) = chunks[0]["choices"]
    assert (chunks[0]["id"], chunks[0]["created"], chunks[0]["model"]) == ("r", 7, "m")
    assert choice == {
        "index": 0,
        "text": "",
        "finish_reason": "abort",
        "stop_reason": "engine 1 faulted",
        "prompt_token_ids": PROMPT,
        "token_ids": [],
    }


@pytest.mark.parametrize(
    "outputs",
    [
        [[_output([5], None)], [_output([6], "length")]],
        [[_output([5], None)], [_output([], "abort", "later")]],  # emitted first: vLLM sends it
        [[_output([5, 6], "length")]],
    ],
    ids=["two-tokens", "abort-after-a-token", "one-step"],
)
def test_streams_vllm_ends_itself_are_unchanged(outputs: list[list[Any]]) -> None:
    assert _stream(PATCHED, outputs) == _stream(ORIGINAL, outputs)
    finishes = [c for c in _stream(PATCHED, outputs) if isinstance(c, dict)]
    assert [c["choices"][0]["finish_reason"] for c in finishes][-1] is not None


def test_an_echoed_prompt_is_left_to_vllm() -> None:
    """vLLM sends an echoed prompt's first chunk whatever the output: nothing is skipped."""
    assert _stream(PATCHED, ABORTED_FIRST, echo=True) == _stream(ORIGINAL, ABORTED_FIRST, echo=True)


chat_serving = pytest.importorskip("vllm.entrypoints.openai.chat_completion.serving")
from vllm.entrypoints.openai.chat_completion.protocol import (  # noqa: E402
    ChatCompletionRequest,
)

CHAT_ORIGINAL = chat_serving.OpenAIServingChat.chat_completion_stream_generator
CHAT_PATCHED = with_finishing_chat_chunks(CHAT_ORIGINAL)


def _chat_server() -> Any:
    """vLLM's OpenAIServingChat with only what its stream generator reads (no parser)."""
    server = object.__new__(chat_serving.OpenAIServingChat)
    server.parser_cls = None
    server.response_role = "assistant"
    server.enable_force_include_usage = False
    server.system_fingerprint = None
    server.enable_prompt_tokens_details = False
    server.enable_per_request_metrics = False
    server.enable_log_outputs = False
    server.enable_log_deltas = False
    server.request_logger = None
    server._include_reasoning_tokens_details = False
    return server


def _chat(
    generator: Callable[..., Any], outputs: list[list[Any]], **request: Any
) -> list[dict[str, Any] | str]:
    async def results() -> AsyncIterator[Any]:
        for step in outputs:
            finished = any(o.finish_reason is not None for o in step)
            yield RequestOutput("r", "p", PROMPT, None, step, finished)

    body = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        return_token_ids=True,
        **request,
    )

    async def lines() -> list[str]:
        metadata = RequestResponseMetadata(request_id="r")
        args: tuple[Any, ...] = (body, results(), "chatcmpl-r", "m", [], None, metadata)
        return [line async for line in generator(_chat_server(), *args)]

    return [
        line if line == "data: [DONE]\n\n" else json.loads(line.removeprefix("data: "))
        for line in asyncio.run(lines())
    ]


def test_vllms_chat_stream_aborted_before_its_first_token_has_no_finish_reason() -> None:
    role, done = _chat(CHAT_ORIGINAL, ABORTED_FIRST)
    assert done == "data: [DONE]\n\n" and isinstance(role, dict)
    assert role["choices"][0]["finish_reason"] is None  # the role chunk, then nothing


def test_the_patched_chat_stream_sends_the_finishing_chunk_it_skipped() -> None:
    role, finish, done = _chat(CHAT_PATCHED, ABORTED_FIRST)
    assert done == "data: [DONE]\n\n" and isinstance(role, dict) and isinstance(finish, dict)
    assert (finish["id"], finish["created"], finish["model"]) == (
        role["id"],
        role["created"],
        "m",
    )
    assert finish["object"] == "chat.completion.chunk"
    assert finish["choices"] == [
        {
            "index": 0,
            "delta": {},
            "finish_reason": "abort",
            "stop_reason": "engine 1 faulted",
            "token_ids": [],
        }
    ]


def test_the_finishing_chunk_comes_before_the_usage_chunk() -> None:
    usage = {"stream_options": {"include_usage": True}}
    for lines in (
        _chat(CHAT_PATCHED, ABORTED_FIRST, **usage),
        _stream(PATCHED, ABORTED_FIRST, **usage),
    ):
        *_, finish, last, done = lines
        assert isinstance(finish, dict) and finish["choices"][0]["finish_reason"] == "abort"
        assert isinstance(last, dict) and last["choices"] == [] and "usage" in last
        assert done == "data: [DONE]\n\n"


@pytest.mark.parametrize(
    "outputs",
    [
        [[_output([5], None)], [_output([6], "length")]],
        [[_output([5], None)], [_output([], "abort", "later")]],
        [[_output([5, 6], "length")]],
    ],
    ids=["two-tokens", "abort-after-a-token", "one-step"],
)
def test_chat_streams_vllm_ends_itself_are_unchanged(outputs: list[list[Any]]) -> None:
    def strip(lines: list[dict[str, Any] | str]) -> list[Any]:
        return [
            {k: v for k, v in line.items() if k != "created"} if isinstance(line, dict) else line
            for line in lines
        ]

    assert strip(_chat(CHAT_PATCHED, outputs)) == strip(_chat(CHAT_ORIGINAL, outputs))
