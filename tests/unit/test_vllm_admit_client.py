"""``testbed.vllm.admit``: the orchestrator's admission over vLLM's HTTP API, against a
stand-in of three servers that answer as vLLM does (202 with the command's request id; a
failed command's ``last_ft_request_id`` and ``ft_error`` in the rank's status)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

from ftengine.testbed.vllm import admit as admit_client
from ftengine.testbed.vllm.admit import AdmissionFailed, admit

URLS = [f"http://rank{r}" for r in range(3)]


class Servers:
    """Ranks 0 and 1 survived (rank 2 removed), rank 2 restarted and ``ready``. A returning
    rank given another store than the survivors' current one fails its command, as the real
    one does; ``moves``: how many commands find the survivors' store moved on since the
    bodies were built (a survivor's recovery in between)."""

    def __init__(self, moves: int) -> None:
        self.moves, self.store, self.sent = moves, 1, 0
        shrunk = {"status": "healthy", "phase": "healthy", "removed_ranks": [2]}
        self.engines: dict[int, dict[str, Any]] = {
            0: {"id": 0, **shrunk}, 1: {"id": 1, **shrunk},
            2: {"id": 2, "status": "unhealthy", "phase": "ready", "removed_ranks": []},
        }  # fmt: skip
        self.pending: dict[int, str] = {}

    def handle(self, request: httpx.Request) -> httpx.Response:
        rank = int(request.url.host.removeprefix("rank"))
        if request.url.path == admit_client.STATUS_PATH:
            engine = dict(self.engines[rank])
            if rank != 2:
                engine["dp_store"] = f"127.0.0.1:{self.store}"
            return httpx.Response(200, json={"engines": [engine]})
        body = json.loads(request.content)
        assert body["instruction"] == "scale_up" and body["params"]["added_dp_ranks"] == [2]
        request_id = str(uuid.uuid4())
        self.sent += 1
        if rank == 0 and self.moves > 0:
            self.moves -= 1
            self.store += 1  # the survivors rebuilt after the bodies were built
        if rank == 2:
            given = body["params"]["dp_store"]
            if given != f"127.0.0.1:{self.store}":
                self.engines[2] |= {"last_ft_request_id": request_id,
                                    "ft_error": f"not admitted through {given}"}  # fmt: skip
            else:
                for engine in self.engines.values():
                    engine.update(status="healthy", phase="healthy", removed_ranks=[])
        return httpx.Response(202, json={"request_id": request_id})


def client(servers: Servers) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(servers.handle))


def test_an_admission_that_fails_on_a_moved_store_is_sent_again_with_the_new_one() -> None:
    servers = Servers(moves=1)
    said: list[str] = []
    found = admit(URLS, [2], [0, 1], timeout_s=10, progress=said.append, http=client(servers))
    assert all(e["status"] == "healthy" and e["removed_ranks"] == [] for e in found.values())
    assert servers.sent == 6  # two attempts, three ranks each
    (line,) = said
    assert "attempt 1 of 3 failed" in line and "not admitted through 127.0.0.1:1" in line


def test_every_attempt_failing_raises_with_each_reason() -> None:
    servers = Servers(moves=5)
    with pytest.raises(AdmissionFailed, match=r"not admitted in 3 attempts") as failed:
        admit(URLS, [2], [0, 1], timeout_s=10, http=client(servers))
    assert str(failed.value).count("not admitted through") == 3


def test_a_refused_command_raises_at_once_with_the_answer() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(400, json={"detail": "scale_up takes params"})
        return Servers(moves=0).handle(request)

    http = httpx.Client(transport=httpx.MockTransport(refuse))
    with pytest.raises(AdmissionFailed, match="scale_up takes params"):
        admit(URLS, [2], [0, 1], timeout_s=10, http=http)


def test_survivors_that_never_get_healthy_end_at_the_deadline() -> None:
    servers = Servers(moves=0)
    servers.engines[1]["status"] = "unhealthy"
    with pytest.raises(AdmissionFailed, match="survivors not healthy"):
        admit(URLS, [2], [0, 1], timeout_s=0.5, http=client(servers))
    assert servers.sent == 0  # nothing sent to a survivor that is recovering
