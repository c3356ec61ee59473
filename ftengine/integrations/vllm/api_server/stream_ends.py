"""Every completion stream ends with its finish reason, even one that ended before its
first token.

vLLM's completion stream generator skips an output that carries no text and no token while
its request has emitted none (its "chunked prefill case, don't return empty chunks"). That
skip also swallows the final output of a request finished before its first token, aborted by
a fault for instance: the stream then ends with ``data: [DONE]`` and no finish reason, and
the client cannot tell an abort from a cut connection (the chaos campaign's "lost" streams).
:func:`with_finishing_chunks` watches the outputs the generator reads and, before its
``[DONE]``, sends the finishing chunk vLLM skipped: no text, the finish and stop reasons.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs

from ftengine.integrations.vllm.messages import import_vllm

PROTOCOL_MODULE = "vllm.entrypoints.openai.completion.protocol"
DONE = "data: [DONE]\n\n"


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
            if line == DONE:
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
            yield line

    return completion_stream_generator
