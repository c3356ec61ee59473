"""Continuous concurrent streaming traffic through the OpenAI completions endpoint, with the
official ``openai`` client (its own retries off: the campaign's are counted): each
client thread streams one completion after another (greedy, ``return_token_ids``) and keeps
a :class:`StreamRecord` of every chunk, so the invariants can check each stream token by
token against the fault-free reference. A request refused before admission (503, or no
server listening) is asked again after the answer's ``Retry-After``, on the next server the
campaign streams to, as the ``openai`` client and a load balancer do (``refusal.py``),
until its time budget or the campaign's pause: one request the user asked, however many
attempts it took (``refusals``). A stream whose connection breaks before its finish
reason (its server was killed, with its host) is resumed on the next server from the
tokens it has, as ftengine's own hand-off resumes a DEAD rank's (prompt + emitted token
ids, what is left of ``max_tokens``, greedy: the same tokens), as a router in front of the
servers would (``resumes``); one cut with no other server to ask keeps its error."""

from __future__ import annotations

import importlib
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

import attrs
import openai

from ftengine.testbed.chaos.history import History
from ftengine.testbed.refusal import RETRY_AFTER_CAP_S, retry_after_s

BACKOFF_S = 0.2
CUT = "cut"  # an attempt whose connection broke mid-stream (``Traffic.attempt``)
PROMPTS = ([1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [3, 1, 4, 1, 5, 9], [100, 7])
"""Every campaign's prompts (token ids of the tests' tiny checkpoint), on either target."""


@attrs.define
class StreamRecord:
    """One streamed completion: its prompt (index into the campaign's prompts), the token
    ids of every chunk as they came, how it ended, and why (``stop_reason`` or the error)."""

    client: int
    prompt: int
    started: float
    chunks: list[list[int]] = attrs.field(factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    error: str | None = None
    ended: float | None = None
    refusals: int = 0  # attempts refused before one was admitted (each asked again)
    resumes: int = 0  # connections cut mid-stream, each resumed on another server
    url: str | None = None  # the server of its last attempt

    @property
    def tokens(self) -> list[int]:
        """Every streamed token, in order."""
        return [t for chunk in self.chunks for t in chunk]


def _transport() -> ModuleType:
    """The HTTP library the installed ``openai`` client is built on (``httpx`` before
    openai 3, its fork ``httpx2`` since): a stream that breaks mid-way raises its errors."""
    base = next(c for c in openai.DefaultHttpxClient.__mro__ if c.__name__ == "Client")
    return importlib.import_module(base.__module__.split(".")[0])


TRANSPORT = _transport()


def _read_stream(chunks: Iterable[Any], record: StreamRecord) -> None:
    """The ``openai`` client's completion chunks into ``record`` (vLLM's ``token_ids`` and
    ``stop_reason`` are extra fields of each choice)."""
    for chunk in chunks:
        for choice in getattr(chunk, "choices", None) or ():  # (an event that is no chunk)
            extra = choice.model_extra or {}
            record.chunks.append([int(t) for t in extra.get("token_ids") or ()])
            record.finish_reason = choice.finish_reason or record.finish_reason
            record.stop_reason = extra.get("stop_reason") or record.stop_reason


class Traffic:
    """``clients`` threads streaming completions of ``prompts`` (``max_tokens`` each) to
    ``url`` until :meth:`stop`; :meth:`pause` lets every in-flight stream end first (a
    rebuild must not cut streams), :meth:`resume` points them at a new ``url``."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        *,
        clients: int,
        seed: int,
        history: History,
        timeout_s: float,
    ) -> None:
        self.prompts = [list(p) for p in prompts]
        self.max_tokens = max_tokens
        self.records: list[StreamRecord] = []
        self._history = history
        self._timeout_s = timeout_s
        self._url = ""
        self._cond = threading.Condition()
        self._open = False
        self._stopped = False
        self._in_flight = 0
        self._rngs = [random.Random(seed * 1000 + i) for i in range(clients)]
        # The other servers a refused request may be asked on (the fleet's: those streamed
        # to now); none: only this traffic's own.
        self.alternates: Callable[[], Sequence[str]] = tuple
        self._threads = [
            threading.Thread(target=self._loop, args=(i,), name=f"chaos-client-{i}", daemon=True)
            for i in range(clients)
        ]

    def start(self, url: str) -> None:
        """Start streaming to ``url``."""
        self.resume(url)
        for thread in self._threads:
            thread.start()

    @property
    def streaming_to(self) -> str | None:
        """The URL new streams go to, or None while paused."""
        with self._cond:
            return self._url if self._open else None

    def resume(self, url: str) -> None:
        """Let the clients start new streams again, to ``url``."""
        with self._cond:
            self._url, self._open = url, True
            self._cond.notify_all()

    def pause(self, timeout_s: float) -> bool:
        """Start no new stream and wait until the running ones ended; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._open = False
            while self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self, timeout_s: float) -> bool:
        """Pause, then end the client threads; False when a stream did not end in time."""
        drained = self.pause(timeout_s)
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5.0)
        return drained

    def completed_tokens(self) -> int:
        """Tokens received so far over every stream (progress and throughput)."""
        with self._cond:
            return sum(len(r.tokens) for r in self.records)

    def _next_url(self) -> str | None:
        with self._cond:
            while not self._open and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return None
            self._in_flight += 1
            return self._url

    def _loop(self, client: int) -> None:
        rng = self._rngs[client]
        with openai.DefaultHttpxClient(timeout=self._timeout_s) as http:
            while (url := self._next_url()) is not None:
                record = StreamRecord(client, rng.randrange(len(self.prompts)), time.monotonic())
                with self._cond:
                    self.records.append(record)
                try:
                    self._stream(http, url, record)
                finally:
                    record.ended = time.monotonic()
                    with self._cond:
                        self._in_flight -= 1
                        self._cond.notify_all()

    def _open_now(self) -> bool:
        with self._cond:
            return self._open and not self._stopped

    def _servers(self, url: str) -> list[str]:
        """``url`` first, then the other servers streamed to now, in the fleet's order."""
        return [url, *(u for u in self.alternates() if u != url)]

    def _body(self, record: StreamRecord) -> dict[str, Any]:
        """The request for what ``record`` still lacks: its prompt and the tokens it has."""
        return {
            "model": "chaos",
            "prompt": self.prompts[record.prompt] + record.tokens,
            "max_tokens": self.max_tokens - len(record.tokens),
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }

    def _stream(self, http: openai.DefaultHttpxClient, url: str, record: StreamRecord) -> None:
        deadline = record.started + self._timeout_s
        while True:
            servers = self._servers(url)
            server = servers[(record.refusals + record.resumes) % len(servers)]
            wait = self.attempt(http, server, self._body(record), record)
            if isinstance(wait, str):  # CUT
                if not self._resumable(server, deadline):
                    break
                record.resumes += 1
                self._history.add(
                    "stream_cut", client=record.client, prompt=record.prompt,
                    tokens=len(record.tokens), url=server, error=record.error,
                )  # fmt: skip
                continue
            if wait is None:
                break
            record.refusals += 1
            if time.monotonic() + wait > deadline or not self._open_now():
                break  # refused to the end: its last refusal is its error
            time.sleep(wait)
            if not self._open_now():
                break
        if record.error is not None or record.finish_reason != "length":
            time.sleep(BACKOFF_S)  # a refused client does not spin
            self._history.add(
                "request_not_completed",
                client=record.client,
                prompt=record.prompt,
                finish_reason=record.finish_reason,
                stop_reason=record.stop_reason,
                error=record.error,
                tokens=len(record.tokens),
                refusals=record.refusals,
                url=record.url,
            )

    def _resumable(self, cut: str, deadline: float) -> bool:
        """Whether a stream cut on server ``cut`` is asked again: another server is streamed
        to and the request's budget is not spent."""
        return time.monotonic() < deadline and any(u != cut for u in self.alternates())

    @staticmethod
    def attempt(
        http: openai.DefaultHttpxClient, url: str, body: dict[str, Any], record: StreamRecord
    ) -> float | str | None:
        """One streamed completion of ``body`` from ``url`` through the official ``openai``
        client (no retries of its own: the campaign's are counted); seconds to wait before
        asking again when it was refused before admission (a 503, or nothing listening),
        :data:`CUT` when its connection broke before a finish reason, else None (it ran:
        how it ended is in ``record``)."""
        record.url, record.error, had = url, None, len(record.chunks)
        client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=http.timeout,
            http_client=http,
        )  # fmt: skip
        fields = {k: body[k] for k in ("model", "prompt", "max_tokens", "temperature")}
        extra = {k: v for k, v in body.items() if k not in fields and k != "stream"}
        try:
            _read_stream(client.completions.create(**fields, stream=True, extra_body=extra), record)
        except openai.APIStatusError as exc:  # the server answered, refusing it
            record.error = f"HTTP {exc.status_code}: {exc.response.text[:300]}"
            if exc.status_code == 503 and len(record.chunks) == had:
                return retry_after_s(exc.response.headers)
        except openai.APITimeoutError as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        except openai.APIConnectionError as exc:  # before any answer
            record.error = f"{type(exc.__cause__ or exc).__name__}: {exc.__cause__ or exc}"
            if isinstance(exc.__cause__, TRANSPORT.ConnectError):  # nothing sent: not admitted
                return RETRY_AFTER_CAP_S
            return CUT
        except openai.APIError as exc:
            # The server ended the stream itself, saying why (vLLM's in-stream error event,
            # e.g. a request judged poison): an end with a reason, not a lost stream.
            record.finish_reason, record.stop_reason = "error", exc.message or None
        except (TRANSPORT.NetworkError, TRANSPORT.RemoteProtocolError) as exc:  # no timeout
            record.error = f"{type(exc).__name__}: {exc}"
            return CUT if record.finish_reason is None else None
        except (TRANSPORT.HTTPError, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        return None
