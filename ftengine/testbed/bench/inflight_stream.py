"""Streaming OpenAI completions for the in-flight benchmark: one thread per request, each
reading the server-sent events of ``POST /v1/completions`` (vLLM's dialect, as ``ftengine
serve`` and ``vllm serve`` speak it) and keeping every chunk's token ids as they came, the
finish and stop reasons, and when the request started and ended.

It speaks the wire format with httpx (a core dependency) rather than the ``openai`` client
(not one of ftengine's dependencies): the benchmark must run wherever ``ftengine`` does."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs
import httpx

from ftengine.testbed.refusal import retry_after_s

DATA = "data: "
DONE = "[DONE]"


@attrs.frozen
class StreamRequest:
    """What one client asks: greedy, ``max_tokens`` new tokens, EOS ignored, token ids back."""

    url: str
    model: str
    prompt: tuple[int, ...]
    max_tokens: int
    timeout_s: float

    def body(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": list(self.prompt),
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }


class Stream(threading.Thread):
    """One streaming completion in its own thread. ``chunks``: the token ids of each chunk
    in arrival order, ``arrivals`` when each came, ``start_s`` / ``end_s`` (all
    ``time.monotonic`` seconds); ``error``: why the stream broke (an HTTP or transport
    error), None when it ended with ``[DONE]``."""

    def __init__(self, request: StreamRequest) -> None:
        super().__init__(daemon=True)
        self.request = request
        self.chunks: list[list[int]] = []
        self.arrivals: list[float] = []  # time.monotonic() of each chunk
        self.finish_reason: str | None = None
        self.stop_reason: object = None
        self.error: str | None = None
        self.start_s = 0.0
        self.end_s: float | None = None
        self.refusals = 0  # 503s before admission, each retried
        self.admitted_s = 0.0  # when the attempt the server admitted began

    def run(self) -> None:
        self.start_s = time.monotonic()
        try:
            self._read()
        except (httpx.HTTPError, ValueError, KeyError) as exc:  # reported, never raised
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.end_s = time.monotonic()

    def _read(self) -> None:
        # A 503 before any token means "not admitted: the cluster is recovering" (with a
        # Retry-After): the request was never in flight, and the official openai client
        # retries it by default, so the stream does too, within its own timeout.
        deadline = self.start_s + self.request.timeout_s
        while not self._attempt() and time.monotonic() < deadline:
            self.refusals += 1

    def _attempt(self) -> bool:
        """One POST; False when it was refused with a 503 (after waiting its Retry-After)."""
        req = self.request
        self.admitted_s = time.monotonic()
        with (
            httpx.Client(timeout=req.timeout_s) as http,
            http.stream("POST", f"{req.url}/v1/completions", json=req.body()) as answer,
        ):
            if answer.status_code == 503 and not self.chunks:
                answer.read()
                time.sleep(retry_after_s(answer.headers))
                return False
            if answer.status_code != 200:
                answer.read()
                raise ValueError(f"expected HTTP 200, got {answer.status_code}: {answer.text}")
            for line in answer.iter_lines():
                if not line.startswith(DATA) or line[len(DATA) :] == DONE:
                    continue
                for choice in json.loads(line[len(DATA) :]).get("choices", ()):
                    self.chunks.append([int(t) for t in choice.get("token_ids") or ()])
                    self.arrivals.append(time.monotonic())
                    self.finish_reason = choice.get("finish_reason") or self.finish_reason
                    self.stop_reason = choice.get("stop_reason", self.stop_reason)
        return True

    @property
    def tokens(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk]

    @property
    def completed(self) -> bool:
        """Ended normally: every asked token came (``finish_reason`` ``length``)."""
        return self.error is None and self.finish_reason == "length"


def start_streams(
    url: str, model: str, prompts: Sequence[Sequence[int]], max_tokens: int, timeout_s: float
) -> list[Stream]:
    """One started :class:`Stream` per prompt."""
    streams = [Stream(StreamRequest(url, model, tuple(p), max_tokens, timeout_s)) for p in prompts]
    for stream in streams:
        stream.start()
    return streams


def wait_streaming(streams: Sequence[Stream], at_least: int, timeout_s: float) -> None:
    """Until every stream has ``at_least`` tokens or has ended; TimeoutError after
    ``timeout_s`` naming each stream's count."""
    deadline = time.monotonic() + timeout_s
    while not all(len(s.tokens) >= at_least or s.end_s is not None for s in streams):
        if time.monotonic() > deadline:
            counts = [len(s.tokens) for s in streams]
            raise TimeoutError(
                f"expected every stream to reach {at_least} tokens in {timeout_s} s, found {counts}"
            )
        time.sleep(0.01)


def join_all(streams: Sequence[Stream], timeout_s: float) -> None:
    """Wait for every stream; one still running after ``timeout_s`` is left (daemon) and
    counts as not completed."""
    deadline = time.monotonic() + timeout_s
    for stream in streams:
        stream.join(max(0.0, deadline - time.monotonic()))
