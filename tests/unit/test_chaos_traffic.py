"""The campaigns' streaming clients ask a refused request again (issue 30's answered share):
a 503 before any token, or no server listening, is asked again after its ``Retry-After``,
on the next server the fleet streams to, as the ``openai`` client and a load balancer do;
a request refused to the end (its budget, or the campaign's pause) is counted refused. A
stream cut mid-way (its server killed with its host) is resumed on another server from the
tokens it has, and its tokens are the uncut stream's."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import attrs
import pytest

from ftengine.testbed.chaos.history import History
from ftengine.testbed.chaos.invariants import answered, check_request, refused
from ftengine.testbed.chaos.target import Fleet
from ftengine.testbed.chaos.traffic import PROMPTS, StreamRecord, Traffic
from ftengine.testbed.refusal import RETRY_AFTER_CAP_S, retry_after_s

MAX_TOKENS = 3


def tokens_of(prompt: list[int], count: int = MAX_TOKENS) -> list[int]:
    """The fake server's greedy answer to ``prompt``: each token a function of every token
    before it, as a model's (so a continuation from prompt + emitted tokens is the same)."""
    seq = list(prompt)
    for _ in range(count):
        seq.append(sum(seq) % 97)
    return seq[len(prompt) :]


@attrs.define
class Server:
    """Refuses the first ``refuse`` asks (503, ``Retry-After: retry_after``; -1: always),
    then streams :func:`tokens_of` the prompt (``max_tokens`` of them); with ``cut_after``,
    closes the connection after that many tokens instead (a server killed mid-stream)."""

    refuse: int = 0
    retry_after: str = "0"
    asks: int = 0
    url: str = ""
    cut_after: int | None = None
    prompts: list[list[int]] = attrs.field(factory=list)

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        body = json.loads(handler.rfile.read(int(handler.headers["Content-Length"])))
        self.asks += 1
        self.prompts.append(list(body["prompt"]))
        if self.refuse < 0 or self.asks <= self.refuse:
            handler.send_response(503)
            handler.send_header("Retry-After", self.retry_after)
            handler.end_headers()
            handler.wfile.write(b'{"error": {"message": "engine 1 is DEAD", "code": 503}}')
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        if self.cut_after is not None:  # a body it promises and never ends, as a killed one
            handler.send_header("Content-Length", str(1 << 20))
        handler.end_headers()
        count = int(body["max_tokens"])
        for i, token in enumerate(tokens_of(body["prompt"], count)):
            if i == self.cut_after:
                handler.wfile.flush()
                handler.connection.shutdown(socket.SHUT_RDWR)  # no end of the chunked body
                return
            finish = "length" if i == count - 1 else None
            choice = {"index": 0, "text": "x", "token_ids": [token], "finish_reason": finish}
            handler.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        handler.wfile.write(b"data: [DONE]\n\n")


@contextlib.contextmanager
def one_server(server: Server) -> Iterator[Server]:
    """``server`` listening on a free port for the ``with`` block."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_POST(self) -> None:
            server.answer(self)

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.url = f"http://127.0.0.1:{http.server_address[1]}"
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        http.shutdown()
        http.server_close()


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    """A DEAD rank's server (refuses every ask) and a serving one."""
    with one_server(Server(refuse=-1)) as dead, one_server(Server()) as serving:
        yield [dead, serving]


def traffic(timeout_s: float = 20.0) -> Traffic:
    return Traffic(PROMPTS, MAX_TOKENS, clients=1, seed=3, history=History(), timeout_s=timeout_s)


def first_record(fleet_or_traffic: Traffic, timeout_s: float = 20.0) -> StreamRecord:
    deadline = time.monotonic() + timeout_s
    while not any(r.ended is not None for r in fleet_or_traffic.records):
        assert time.monotonic() < deadline, fleet_or_traffic.records
        time.sleep(0.01)
    return next(r for r in fleet_or_traffic.records if r.ended is not None)


def test_a_request_refused_by_a_dead_ranks_server_is_answered_by_the_next_one(
    servers: list[Server],
) -> None:
    dead, serving = servers
    refused_side, other = traffic(), traffic()
    fleet = Fleet([refused_side, other])
    fleet.start([dead.url, serving.url])
    try:
        record = first_record(refused_side)
    finally:
        assert fleet.stop(10.0) == 0
    prompt = PROMPTS[record.prompt]
    assert answered(record) and record.tokens == tokens_of(list(prompt)), record
    assert record.refusals == 1 and record.url == serving.url and dead.asks >= 1
    assert check_request(record, tokens_of(list(prompt)), MAX_TOKENS) == []


def test_a_server_that_refuses_a_few_times_answers_the_same_request_after() -> None:
    server = Server(refuse=3)
    with one_server(server):
        alone = traffic()
        alone.start(server.url)  # no fleet: no other server to ask
        try:
            record = first_record(alone)
        finally:
            assert alone.stop(10.0)
    assert answered(record) and record.refusals == 3 and record.url == server.url


def test_a_request_refused_to_the_end_of_its_budget_is_refused_with_the_reason() -> None:
    server = Server(refuse=-1, retry_after="0")
    with one_server(server):
        alone = traffic(timeout_s=0.5)
        alone.start(server.url)
        try:
            record = first_record(alone)
        finally:
            alone.stop(10.0)
    assert refused(record) and not answered(record) and record.refusals >= 2, record
    assert "engine 1 is DEAD" in str(record.error)
    assert check_request(record, [1, 2, 3], MAX_TOKENS) == []  # a refusal, not a loss


def test_the_campaigns_pause_ends_a_refused_request_rather_than_waiting_its_budget() -> None:
    server = Server(refuse=-1, retry_after="1")
    with one_server(server):
        alone = traffic(timeout_s=600.0)
        alone.start(server.url)
        while server.asks == 0:
            time.sleep(0.01)
        started = time.monotonic()
        assert alone.pause(10.0)  # returns once the refused request gave up
        waited = time.monotonic() - started
        alone.stop(10.0)
    assert waited < RETRY_AFTER_CAP_S + 2.0, waited  # one Retry-After, not the 600 s budget
    assert all(refused(r) for r in alone.records), alone.records


def test_nothing_listening_is_asked_again_on_the_next_server(servers: list[Server]) -> None:
    _, serving = servers
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    gone, other = traffic(), traffic()
    fleet = Fleet([gone, other])
    fleet.start([closed, serving.url])
    try:
        record = first_record(gone)
    finally:
        fleet.stop(10.0)
    assert answered(record) and record.refusals == 1 and record.url == serving.url


def test_a_paused_clients_server_is_not_asked() -> None:
    first, second = traffic(), traffic()
    fleet = Fleet([first, second])
    fleet.traffic[0].resume("http://a")
    fleet.traffic[1].resume("http://b")
    assert fleet.serving_urls() == ["http://a", "http://b"]
    second.pause(1.0)
    assert fleet.serving_urls() == ["http://a"]


def streamed_first(urls: list[str]) -> StreamRecord:
    """The first request the first of a fleet's clients (one per URL of ``urls``) ended; a
    client alone when there is one URL (no other server to ask)."""
    clients = [traffic() for _ in urls]
    fleet = Fleet(clients)
    fleet.start(urls)
    try:
        return first_record(clients[0])
    finally:
        fleet.stop(10.0)


def test_a_stream_cut_mid_way_is_resumed_on_another_server_from_its_tokens() -> None:
    with one_server(Server(cut_after=1)) as killed, one_server(Server()) as serving:
        record = streamed_first([killed.url, serving.url])
    prompt = list(PROMPTS[record.prompt])
    want = tokens_of(prompt)
    assert answered(record) and record.tokens == want and record.resumes == 1, record
    assert check_request(record, want, MAX_TOKENS) == []  # no gap, no repeat
    assert prompt + want[:1] in serving.prompts  # asked for the rest only
    assert record.url == serving.url and record.refusals == 0


@attrs.define
class Failing(Server):
    """Streams one token, then vLLM's in-stream error event ``error`` (``data: {...}``)."""

    error: dict[str, object] = attrs.field(
        factory=lambda: {"message": "poison request: re-run alone", "code": 500}
    )

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        handler.rfile.read(int(handler.headers["Content-Length"]))
        self.asks += 1
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.end_headers()
        choice = {"index": 0, "text": "x", "token_ids": [4], "finish_reason": None}
        handler.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        handler.wfile.write(f"data: {json.dumps({'error': self.error})}\n\n".encode())
        handler.wfile.write(b"data: [DONE]\n\n")


def test_an_error_event_without_a_message_is_no_reason() -> None:
    with one_server(Failing(error={})) as failing:
        record = streamed_first([failing.url])
    assert record.stop_reason is None and record.finish_reason != "length", record
    assert any(p.startswith("lost:") for p in check_request(record, [4, 5, 6], MAX_TOKENS))


def test_a_stream_the_server_ends_with_an_error_event_ends_with_its_reason() -> None:
    """vLLM's in-stream error event (``data: {"error": ...}``), which the ``openai`` client
    raises as an ``APIError``: an end with a reason, not a lost stream, never resumed."""

    with one_server(Failing()) as failing, one_server(Server()) as other:
        record = streamed_first([failing.url, other.url])
    assert (record.finish_reason, record.stop_reason) == ("error", "poison request: re-run alone")
    assert record.tokens == [4] and record.resumes == 0 and record.error is None
    assert check_request(record, [4, 5, 6], MAX_TOKENS) == []  # ended with its reason


def test_a_cut_stream_with_no_other_server_keeps_its_error() -> None:
    with one_server(Server(cut_after=1)) as killed:
        record = streamed_first([killed.url])
    assert not answered(record) and record.resumes == 0 and len(record.tokens) == 1
    assert "RemoteProtocolError" in str(record.error), record
    assert check_request(record, tokens_of(list(PROMPTS[record.prompt])), MAX_TOKENS) == [
        f"lost: ended None error {record.error!r}"
    ]


@pytest.mark.parametrize(
    ("header", "want"),
    [({"Retry-After": "0"}, 0.0), ({"Retry-After": "0.25"}, 0.25), ({}, 1.0),
     ({"Retry-After": "120"}, RETRY_AFTER_CAP_S),
     ({"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"}, RETRY_AFTER_CAP_S)],
)  # fmt: skip
def test_retry_after_is_read_in_seconds_and_capped(header: dict[str, str], want: float) -> None:
    assert retry_after_s(header) == want
