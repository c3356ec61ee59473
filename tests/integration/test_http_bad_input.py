"""Bad input against a real ``ftengine serve`` (uvicorn, loopback, a key, DP=2): a body
declared over the bound is a 413 before a byte of it is sent, malformed and wrong-typed
bodies are 400s, wrong keys 401s, eight concurrent applies run one at a time;
every engine's status, phase, epoch and removed ranks are what they were, and the server
still serves the reference's tokens afterwards."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from ftengine.testbed.cluster import reference_generate
from ftengine.testbed.control.bodies import MAX_BODY_BYTES
from ftengine.weights.checkpoint_gen import make_checkpoint
from tests.integration.serve_support import APPLY, MODEL, SIZES, Server, Starter

pytestmark = pytest.mark.integration

KEY = "bad-input-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [1, 2, 3, 4]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bad-input-ckpt") / "model", **SIZES)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[Server]:
    starter = Starter(tmp_path_factory.mktemp("bad-input-serve"), checkpoint)
    try:
        yield starter("--dp-size", "2", FTENGINE_API_KEY=KEY)
    finally:
        starter.stop_all()


def shape(server: Server) -> dict[int, tuple[Any, ...]]:
    """What bad input must not change, per engine."""
    return {
        rank: (e["status"], e["phase"], e["epoch"], tuple(e["removed_ranks"]), e["pid"])
        for rank, e in server.engines().items()
    }


def raw_post(server: Server, path: str, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """Send only the request head (no body) on a raw socket; the status and JSON answer."""
    host, port = server.url.removeprefix("http://").split(":")
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), msgspec.json.decode(body)


def complete(server: Server, **fields: object) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "return_token_ids": True}
    return server.http.post("/v1/completions", json={**body, **fields}, headers=AUTH)


@pytest.mark.timeout(300)
def test_bad_input_over_real_http_changes_nothing(server: Server, checkpoint: Path) -> None:
    [want] = [list(g.token_ids) for g in reference_generate(checkpoint, [PROMPT], MAX_TOKENS)]
    assert complete(server).json()["choices"][0]["token_ids"] == want
    before = shape(server)
    json_head = {"Content-Type": "application/json", **AUTH}
    for path in (APPLY, "/v1/completions"):
        huge = {**json_head, "Content-Length": str(10 * MAX_BODY_BYTES)}
        status, body = raw_post(server, path, huge)
        assert status == 413 and "the limit is" in body["error"]["message"], body
        status, body = raw_post(server, path, {"Content-Length": "0", "Authorization": "x"})
        assert status == 401 and body["error"]["type"] == "Unauthorized", body
    for content in (b"{oops", b"[" * 100_000 + b"]" * 100_000, b'{"instruction": 7}'):
        answer = server.http.post(APPLY, content=content, headers=json_head)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["type"] == "Bad Request"
    scale_down = {"instruction": "scale_down", "params": {"removed_dp_ranks": [True]}}
    assert server.http.post(APPLY, json=scale_down, headers=AUTH).status_code == 400
    for fields in ({"prompt": [1] * 5000}, {"max_tokens": 10**9}, {"n": "2"}, {"stream": 1}):
        answer = complete(server, **fields)
        assert answer.status_code == 400 and answer.json()["error"]["param"], answer.text
    assert shape(server) == before
    concurrent_applies_start_one(server)
    assert shape(server) == before, "a retry on HEALTHY engines is refused and changes nothing"
    assert server.http.get("/health").status_code == 200
    assert complete(server).json()["choices"][0]["token_ids"] == want


def concurrent_applies_start_one(server: Server) -> None:
    answers: list[httpx.Response] = []
    gate = threading.Barrier(8)

    def send(index: int) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            gate.wait()
            body = {"instruction": "retry", "params": {}, "request_id": f"c{index}"}
            answers.append(http.post(APPLY, json=body, headers=AUTH))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    # A retry on HEALTHY engines is refused at once, so a later one may start after it: the
    # in-process tests pin "exactly one" with a command that holds; here, every answer is
    # a start or a 409 naming a command that did start, and each started one is refused.
    assert len(answers) == 8 and {a.status_code for a in answers} <= {202, 409}
    accepted = {a.json()["request_id"] for a in answers if a.status_code == 202}
    assert accepted, [a.text for a in answers]
    for request_id in accepted:
        result = server.result(request_id, headers=AUTH)
        assert result["success"] is False and "HEALTHY" in (result["reason"] or ""), result
    for answer in answers:
        if answer.status_code == 409:
            message = answer.json()["error"]["message"]
            assert any(f"command {rid!r} is still running" in message for rid in accepted)
