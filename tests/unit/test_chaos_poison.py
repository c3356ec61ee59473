"""The real-vLLM campaign's poison request: how it must end (alone, with a reason naming
the poison; never answered, never hanging), judged from a real HTTP exchange."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler

import pytest

from ftengine.testbed.chaos.poison import POISON_PROMPT, PoisonRequest, fault_file_text
from ftengine.testbed.chaos.traffic import PROMPTS
from tests.unit.test_chaos_traffic import Server, one_server


class Aborting(Server):
    """Streams one token, then ends the request with ``finish`` and ``reason``."""

    finish: str = "abort"
    reason: str | None = None

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        body = json.loads(handler.rfile.read(int(handler.headers["Content-Length"])))
        self.prompts.append(list(body["prompt"]))
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.end_headers()
        for finish, tokens in ((None, [3]), (self.finish, [])):
            choice = {"index": 0, "text": "x", "token_ids": tokens, "finish_reason": finish,
                      "stop_reason": self.reason if finish else None}  # fmt: skip
            handler.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        handler.wfile.write(b"data: [DONE]\n\n")


def ended(server: Server) -> PoisonRequest:
    with one_server(server):
        poison = PoisonRequest(4, 1, server.url, 8, 20.0)
        assert poison.done.wait(20.0)
    return poison


def test_a_poison_request_aborted_alone_naming_it_is_no_problem() -> None:
    server = Aborting()
    server.reason = "poison request: re-run alone on rank 1 after a fault, it faulted again"
    poison = ended(server)
    assert server.prompts == [list(POISON_PROMPT)]
    assert poison.problems() == []
    assert poison.to_dict()["rank"] == 1 and poison.to_dict()["tokens"] == 1
    assert fault_file_text() == f"token:{POISON_PROMPT[1]}"
    assert not any(POISON_PROMPT[1] in p for p in PROMPTS)


@pytest.mark.parametrize(
    ("finish", "reason", "problem"),
    [("length", None, "answered in full"), ("abort", "engine 1 is DEAD", "without naming"),
     ("abort", None, "without naming")],
)  # fmt: skip
def test_a_poison_request_answered_or_ended_without_its_reason_is_a_problem(
    finish: str, reason: str | None, problem: str
) -> None:
    server = Aborting()
    server.finish, server.reason = finish, reason
    [found] = ended(server).problems()
    assert found.startswith("poison_request: ") and problem in found, found


def test_a_poison_request_still_running_is_a_hang() -> None:
    poison = ended(Aborting())
    poison.done.clear()
    assert poison.problems() == ["hang: the poison request of fault #4 never ended"]
