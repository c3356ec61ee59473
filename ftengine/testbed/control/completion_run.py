"""Running a judged completion on the serving loop and answering it: the whole response
once every prompt finished, or server-sent events in OpenAI's chunk format as the tokens
come (one chunk per token, the finish reason on the last), ending with ``data: [DONE]``.

A request a fault aborted answers normally with what it had, ``finish_reason: abort`` and
why in ``stop_reason``;
one that failed (``error``) is a 500, or an error event in a stream, as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Collection
from http import HTTPStatus

import attrs
import msgspec

from ftengine.errors import FTEngineError
from ftengine.testbed.control.completions import CompletionPlan
from ftengine.testbed.control.errors import ApiError
from ftengine.testbed.control.metrics import ControlMetrics
from ftengine.testbed.control.openai_messages import (
    CompletionChoice,
    CompletionResponse,
    CompletionStreamResponse,
    UsageInfo,
)
from ftengine.testbed.control.protocol import GenerationService, Ticket, Tokenizer
from ftengine.testbed.serving_api import FinishReason, Listener, TokenEvent

DONE = b"data: [DONE]\n\n"


class _Bridge:
    """Moves a serving loop's events (its thread) onto the server's event loop, counting
    them on the way: a request whose client went away is still counted (as ``abort``)."""

    def __init__(self, metrics: ControlMetrics) -> None:
        self._loop = asyncio.get_running_loop()
        self._metrics = metrics
        self.queue: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()

    def listener(self, index: int) -> Listener:
        def put(event: TokenEvent) -> None:
            reason = event.finish_reason
            self._metrics.record_tokens(
                len(event.token_ids), None if reason is None else reason.value
            )
            # RuntimeError: the event loop is closed, the answer is gone, nobody to tell.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

        return put


@attrs.define
class _Choice:
    """One prompt's output so far."""

    index: int
    prompt: tuple[int, ...]
    tokenizer: Tokenizer | None
    token_ids: list[int] = attrs.field(factory=list)
    text: str = ""
    last: TokenEvent | None = None

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    def take(self, event: TokenEvent) -> str:
        """Add ``event``'s tokens; returns the text they added (empty without a tokenizer)."""
        self.last = event
        self.token_ids.extend(event.token_ids)
        if self.tokenizer is None or not event.token_ids:
            return ""
        full = self.tokenizer.decode(self.token_ids)
        delta = full[len(self.text) :] if full.startswith(self.text) else full
        self.text = full
        return delta


class CompletionRun:
    """A plan's requests submitted to a service; answer with :meth:`response` or
    :meth:`stream`. Unfinished requests are cancelled when the answer ends early."""

    def __init__(
        self, plan: CompletionPlan, tokenizer: Tokenizer | None, metrics: ControlMetrics
    ) -> None:
        self.plan = plan
        self.created = int(time.time())
        self._metrics = metrics
        self._bridge = _Bridge(metrics)
        self._tickets: list[Ticket] = []
        self._choices = [
            _Choice(i, request.prompt_token_ids, tokenizer)
            for i, request in enumerate(plan.requests)
        ]

    def start(self, service: GenerationService) -> CompletionRun:
        """Submit every prompt; raises the service's FTEngineError (nothing left running)."""
        try:
            for choice, request in zip(self._choices, self.plan.requests, strict=True):
                self._tickets.append(service.submit(request, self._bridge.listener(choice.index)))
        except FTEngineError:
            self.cancel()
            self._metrics.record_completion_request("unavailable")
            raise
        self._metrics.record_completion_request("accepted")
        return self

    def cancel(self) -> None:
        """Cancel every request that has not finished."""
        for ticket, choice in zip(self._tickets, self._choices, strict=False):
            if not choice.finished:
                ticket.cancel()

    async def response(self) -> CompletionResponse:
        """Wait for every prompt; the whole answer (ApiError 500 if one failed)."""
        try:
            while not all(choice.finished for choice in self._choices):
                await self._next()
        finally:
            self.cancel()
        failed = [c for c in self._choices if _reason(c) is FinishReason.ERROR]
        if failed:
            raise _generation_error(failed[0])
        return CompletionResponse(
            id=self.plan.completion_id,
            created=self.created,
            model=self.plan.model,
            choices=[self._choice(c, c.text, c.token_ids, True) for c in self._choices],
            usage=self._usage(self._choices),
        )

    async def stream(self) -> AsyncIterator[bytes]:
        """Server-sent events: a chunk per token, the usage chunk if asked, ``[DONE]``."""
        first = {choice.index: True for choice in self._choices}
        try:
            while not all(choice.finished for choice in self._choices):
                choice, delta, event = await self._next()
                if _reason(choice) is FinishReason.ERROR:
                    yield _sse(_generation_error(choice).body())
                    break
                chunk = self._chunk(choice, delta, list(event.token_ids), first[choice.index])
                first[choice.index] = False
                yield _sse(chunk)
            else:
                if self.plan.include_usage:
                    yield _sse(self._usage_chunk())
        finally:
            self.cancel()
        yield DONE

    async def _next(self) -> tuple[_Choice, str, TokenEvent]:
        index, event = await self._bridge.queue.get()
        choice = self._choices[index]
        return choice, choice.take(event), event

    def _choice(
        self, choice: _Choice, text: str, token_ids: list[int], with_prompt: bool
    ) -> CompletionChoice:
        last = choice.last
        reason = last.finish_reason if last is not None else None
        ids = self.plan.return_token_ids
        return CompletionChoice(
            index=choice.index,
            text=text,
            finish_reason=None if reason is None else reason.value,
            stop_reason=_stop_reason(last, self.plan.user_stop_ids),
            token_ids=list(token_ids) if ids else None,
            prompt_token_ids=list(choice.prompt) if ids and with_prompt else None,
        )

    def _chunk(
        self, choice: _Choice, delta: str, token_ids: list[int], first: bool
    ) -> CompletionStreamResponse:
        return CompletionStreamResponse(
            id=self.plan.completion_id,
            object="text_completion",
            created=self.created,
            model=self.plan.model,
            choices=[self._choice(choice, delta, token_ids, first)],
            usage=self._usage([choice]) if self.plan.continuous_usage else None,
        )

    def _usage_chunk(self) -> CompletionStreamResponse:
        return CompletionStreamResponse(
            id=self.plan.completion_id,
            object="text_completion",
            created=self.created,
            model=self.plan.model,
            choices=[],
            usage=self._usage(self._choices),
        )

    @staticmethod
    def _usage(choices: list[_Choice]) -> UsageInfo:
        prompt = sum(len(c.prompt) for c in choices)
        completion = sum(len(c.token_ids) for c in choices)
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )


def _reason(choice: _Choice) -> FinishReason | None:
    return None if choice.last is None else choice.last.finish_reason


def _stop_reason(last: TokenEvent | None, user_stop_ids: Collection[int]) -> int | str | None:
    """vLLM's ``stop_reason``: the stop token id for a requested stop id, None for an
    end-of-sequence. An abort carries why (e.g. the re-inference limit), ftengine's
    extension: vLLM has no other field a client could read the reason from."""
    if last is None:
        return None
    if last.finish_reason is FinishReason.ABORT:
        return last.detail
    return last.stop_reason if last.stop_reason in user_stop_ids else None


def _generation_error(choice: _Choice) -> ApiError:
    detail = choice.last.detail if choice.last is not None else None
    return ApiError(
        f"prompt {choice.index} could not be computed: {detail or 'unknown error'}",
        status=HTTPStatus.INTERNAL_SERVER_ERROR,
        err_type="InternalServerError",
    )


def _sse(body: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"
