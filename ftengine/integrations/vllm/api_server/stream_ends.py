"""Every completion and chat-completion stream ends with its finish reason, even one that
ended before its first token.

vLLM's completion and chat-completion stream generators skip an output that carries no text
and no token while its request has emitted none (their "chunked prefill case, don't return
empty chunks"). That skip also swallows the final output of a request finished before its
first token, aborted by a fault for instance: the stream then ends with ``data: [DONE]`` and
no finish reason, and the client cannot tell an abort from a cut connection (the chaos
campaign's "lost" streams). :func:`with_finishing_chunks` and
:func:`with_finishing_chat_chunks` watch the outputs the generator reads and, before its
usage chunk (``stream_options.include_usage``) or its ``[DONE]``, send the finishing chunk
vLLM skipped: no text, the finish and stop reasons.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs

from ftengine.integrations.vllm.messages import import_vllm

PROTOCOL_MODULE = "vllm.entrypoints.openai.completion.protocol"
CHAT_PROTOCOL_MODULE = "vllm.entrypoints.openai.chat_completion.protocol"
DELTA_MODULE = "vllm.entrypoints.generate.base.protocol"
DONE = "data: [DONE]\n\n"


def closes_choices(line: str) -> bool:
    """Whether ``line`` ends the choices' chunks: ``[DONE]``, or the usage chunk (no
    choices) that vLLM sends just before it."""
    if line == DONE:
        return True
    try:
        chunk = json.loads(line.removeprefix("data: "))
    except ValueError:
        return False
    return isinstance(chunk, dict) and chunk.get("choices") == [] and "usage" in chunk


@attrs.define
class SkippedEnds:
    """The finished outputs of requests that emitted nothing, by choice index (``index +
    prompt index * n``, vLLM's numbering), with their prompt's token ids."""

    n: int
    emitted: set[int] = attrs.field(factory=set)
    skipped: dict[int, tuple[Any, Any]] = attrs.field(factory=dict)

    async def watch(
        self, results: AsyncIterator[tuple[int, Any]]
    ) -> AsyncIterator[tuple[int, Any]]:
        """``results`` unchanged, noting each choice's first text or token and its end."""
        async for prompt_index, result in results:
            for output in result.outputs:
                index = output.index + prompt_index * self.n
                if output.text or output.token_ids:
                    self.emitted.add(index)
                elif output.finish_reason is not None and index not in self.emitted:
                    self.skipped[index] = (output, result.prompt_token_ids)
            yield prompt_index, result

    async def watch_outputs(self, results: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """A chat's ``results`` (one prompt: ``RequestOutput``s) unchanged, watched alike."""

        async def indexed() -> AsyncIterator[tuple[int, Any]]:
            async for result in results:
                yield 0, result

        async for _, result in self.watch(indexed()):
            yield result


def finishing_chunk(
    request: Any,
    request_id: str,
    created: int,
    model: str,
    index: int,
    output: Any,
    prompt_token_ids: Any,
) -> str:
    """The SSE line vLLM would have sent for ``output``, a finish with no text."""
    protocol = import_vllm(PROTOCOL_MODULE)
    ids = bool(request.return_token_ids)
    choice = protocol.CompletionResponseStreamChoice(
        index=index,
        text="",
        finish_reason=output.finish_reason,
        stop_reason=output.stop_reason,
        prompt_token_ids=list(prompt_token_ids) if ids and prompt_token_ids is not None else None,
        token_ids=[] if ids else None,
    )
    chunk = protocol.CompletionStreamResponse(
        id=request_id, object="text_completion", created=created, model=model, choices=[choice]
    )
    return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


def with_finishing_chunks(original: Callable[..., Any]) -> Callable[..., Any]:
    """``OpenAIServingCompletion.completion_stream_generator`` that also finishes the
    streams of requests ended before their first token (an echoed prompt is never skipped)."""
    signature = inspect.signature(original)

    async def completion_stream_generator(*args: Any, **kwargs: Any) -> AsyncIterator[str]:
        bound = signature.bind(*args, **kwargs)
        request = bound.arguments["request"]
        ends = SkippedEnds(1 if request.n is None else request.n)
        if not request.echo:
            bound.arguments["result_generator"] = ends.watch(bound.arguments["result_generator"])
        async for line in original(*bound.args, **bound.kwargs):
            if ends.skipped and closes_choices(line):
                for index, (output, prompt_token_ids) in sorted(ends.skipped.items()):
                    yield finishing_chunk(
                        request,
                        bound.arguments["request_id"],
                        bound.arguments["created_time"],
                        bound.arguments["model_name"],
                        index,
                        output,
                        prompt_token_ids,
                    )
                ends.skipped.clear()
            yield line

    return completion_stream_generator


def finishing_chat_chunk(request: Any, head: dict[str, Any], index: int, output: Any) -> str:
    """The SSE line vLLM's chat generator would have sent for ``output``: an empty delta
    with the finish and stop reasons, under the stream's ``head`` (id, created, model)."""
    protocol = import_vllm(CHAT_PROTOCOL_MODULE)
    choice = protocol.ChatCompletionResponseStreamChoice(
        index=index,
        delta=import_vllm(DELTA_MODULE).DeltaMessage(),
        finish_reason=output.finish_reason,
        stop_reason=output.stop_reason,
        token_ids=[] if request.return_token_ids else None,
    )
    chunk = protocol.ChatCompletionStreamResponse(
        object="chat.completion.chunk", choices=[choice], **head
    )
    return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


def with_finishing_chat_chunks(original: Callable[..., Any]) -> Callable[..., Any]:
    """``OpenAIServingChat.chat_completion_stream_generator`` that also finishes the
    streams of requests ended before their first token. Its chunks' id, time and model are
    those of the stream's first chunk (vLLM's role chunk, sent before any output)."""
    signature = inspect.signature(original)

    async def chat_completion_stream_generator(*args: Any, **kwargs: Any) -> AsyncIterator[str]:
        bound = signature.bind(*args, **kwargs)
        request = bound.arguments["request"]
        ends = SkippedEnds(1)  # one prompt: the choice index is the output's
        bound.arguments["result_generator"] = ends.watch_outputs(
            bound.arguments["result_generator"]
        )
        head: dict[str, Any] | None = None
        async for line in original(*bound.args, **bound.kwargs):
            if head is None and line != DONE:
                with contextlib.suppress(ValueError):
                    first = json.loads(line.removeprefix("data: "))
                    head = {key: first[key] for key in ("id", "created", "model")}
            if ends.skipped and head is not None and closes_choices(line):
                for index, (output, _) in sorted(ends.skipped.items()):
                    yield finishing_chat_chunk(request, head, index, output)
                ends.skipped.clear()
            yield line

    return chat_completion_stream_generator
