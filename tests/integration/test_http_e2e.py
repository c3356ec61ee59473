"""The HTTP API end to end: a real ``ftengine serve`` (uvicorn, loopback, ephemeral port)
over a real DP=4 CPU cluster, driven purely through HTTP in vLLM's dialect: injected fault +
retry and SIGKILL + scale-down, auth, bad input, /health flipping during recovery and
/metrics counters moving. Answers are decoded with vLLM's own message types and completions
go through the official ``openai`` client. Each server is stopped with SIGTERM by pid, and
every process it started must be gone afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ftengine.testbed.cluster import reference_generate
from ftengine.weights.checkpoint_gen import make_checkpoint
from tests.integration.serve_support import (
    APPLY,
    MODEL,
    SIZES,
    Server,
    Starter,
    clean_env,
    metric,
)

pytestmark = pytest.mark.integration

engine_protocol = pytest.importorskip(
    "vllm.entrypoints.serve.engine.protocol", reason="vllm is not installed"
)
EngineStatusType = pytest.importorskip("vllm.v1.engine").EngineStatusType

PROMPTS = ([1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14])
MAX_TOKENS = 5
KEY = "test-key-123"
HEALTHY, DEAD, UNHEALTHY = (s.name.lower() for s in (EngineStatusType.HEALTHY,
                            EngineStatusType.DEAD, EngineStatusType.UNHEALTHY))  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("http-ckpt") / "model", **SIZES)


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    return [list(g.token_ids) for g in reference_generate(checkpoint, PROMPTS, MAX_TOKENS)]


@pytest.fixture
def serve(tmp_path: Path, checkpoint: Path) -> Iterator[Callable[..., Server]]:
    starter = Starter(tmp_path, checkpoint)
    yield starter
    starter.stop_all()


def client(server: Server, key: str | None = None) -> openai.OpenAI:
    """The official OpenAI client on the server (no retries: every answer is seen)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key or "none", max_retries=0)


def complete(server: Server, prompt: list[int], key: str | None = None) -> list[int]:
    """A greedy completion's token ids, through the openai client (vLLM's extra fields)."""
    answer = client(server, key).completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "length", choice
    return list((choice.model_extra or {})["token_ids"])  # a vLLM field, not OpenAI's


def raw_completion(server: Server, prompt: list[int]) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    return server.http.post("/v1/completions", json=body)


def assert_outputs_match(server: Server, expected: list[list[int]], key: str | None = None) -> None:
    for prompt, want in zip(PROMPTS[: len(expected)], expected, strict=True):
        assert complete(server, prompt, key) == want


def _complete_until_held(server: Server, answers: list[list[int]], limit_s: float = 60.0) -> None:
    """Complete PROMPTS[1] again and again until one completion lived through a fault (the
    engines went unhealthy while it ran); every answer goes to ``answers``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        answers.append(complete(server, PROMPTS[1]))
        if any(e["epoch"] > 0 for e in server.engines().values()):
            return


def vllm_error(answer: httpx.Response) -> Any:
    """The answer as vLLM's ErrorResponse (fails if it is not one)."""
    error = engine_protocol.ErrorResponse.model_validate(answer.json()).error
    assert error.code == answer.status_code
    return error


BAD_COMMANDS: list[tuple[object, str]] = [
    ({"instruction": "reboot", "params": {}}, "Invalid instruction: 'reboot'."),
    ({"params": {}}, "'instruction' is required."),
    ({"instruction": "retry", "params": []}, "'params' must be an object."),
    ({"instruction": "scale_down", "params": {}}, "removed_dp_ranks"),
    ({"instruction": "scale_down", "params": {"removed_dp_ranks": [9]}}, "out of range"),
    (
        {"instruction": "scale_down", "params": {"removed_dp_ranks": [0, 1, 2, 3]}},
        "every one",
    ),
    ({"instruction": "retry", "params": {"x": 1}}, "retry takes no params"),
]


@pytest.mark.timeout(300)
def test_injected_fault_retry_over_http(
    serve: Callable[..., Server], expected: list[list[int]]
) -> None:
    server = serve("--inject-fault", "rank=3,step=8,kind=raise")
    assert server.http.get("/health").status_code == 200
    assert_outputs_match(server, expected[:1])
    before = server.engines()
    for body, needle in BAD_COMMANDS:
        answer = server.http.post(APPLY, json=body)
        assert answer.status_code == 400 and needle in vllm_error(answer).message, answer.text
    assert server.engines() == before
    # The injected fault fires at step 8. With re-inference on (the default) the completion
    # then in flight is held, not aborted: it finishes after the retry with its fault-free
    # tokens, so the client only waits.
    answers: list[list[int]] = []
    traffic = threading.Thread(target=_complete_until_held, args=(server, answers), daemon=True)
    traffic.start()
    server.wait(lambda e: all(x["status"] == UNHEALTHY for x in e.values()), 30)
    assert server.engines()[3]["fault_info"], "rank 3 must carry fault_info"
    assert server.http.get("/health").status_code == 503
    unavailable = raw_completion(server, PROMPTS[0])
    assert unavailable.status_code == 503
    assert vllm_error(unavailable).type == "ServiceUnavailableError"
    accepted = server.http.post(
        APPLY, json={"instruction": "retry", "params": {}, "request_id": "retry-1"}
    )
    assert accepted.status_code == 202 and accepted.json()["request_id"] == "retry-1"
    assert accepted.json()["message"].startswith("Request accepted")
    assert server.result("retry-1") == {"request_id": "retry-1", "success": True, "reason": None}
    server.wait(lambda e: all(x["status"] == HEALTHY for x in e.values()), 30)
    assert all("fault_info" not in x for x in server.engines().values())
    replay = server.http.post(
        APPLY, json={"instruction": "retry", "params": {}, "request_id": "retry-1"}
    )
    assert replay.status_code == 200 and replay.json()["success"] is True
    assert all(e["epoch"] == 1 for e in server.engines().values()), "a replay must not act again"
    assert server.http.get("/health").status_code == 200
    traffic.join(60)
    assert not traffic.is_alive(), "the held completion never finished after the retry"
    assert answers and all(tokens == expected[1] for tokens in answers), answers
    assert_outputs_match(server, expected)
    samples = server.metrics()
    assert metric(samples, "ftengine_faults_total", kind="transient") >= 1
    assert metric(samples, "ftengine_recoveries_total", kind="retry", outcome="healthy") == 4
    assert (
        metric(
            samples, "ftengine_recovery_duration_seconds_count", kind="retry", step="comm_rebuild"
        )
        == 4
    )
    assert metric(samples, "ftengine_commands_total", instruction="retry", outcome="success") == 1
    assert metric(samples, "ftengine_completions_total", finish_reason="abort") == 0
    assert metric(samples, "ftengine_completions_total", finish_reason="length") >= 5


@pytest.mark.timeout(300)
def test_sigkill_scale_down_over_http_with_auth(
    serve: Callable[..., Server], expected: list[list[int]]
) -> None:
    server = serve(FTENGINE_API_KEY=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    for key in (None, "wrong"):
        with pytest.raises(openai.AuthenticationError):
            complete(server, PROMPTS[0], key)
    assert_outputs_match(server, expected, KEY)
    victim = server.engines()[3]["pid"]
    assert victim in server.descendants  # we only ever signal our own server's workers
    health = HealthProbe(server).start()
    os.kill(victim, signal.SIGKILL)
    server.wait(
        lambda e: e[3]["status"] == DEAD and all(e[r]["status"] == UNHEALTHY for r in (0, 1, 2)),
        30,
    )
    unauthorized = server.http.post(APPLY, json={"instruction": "retry", "params": {}})
    assert unauthorized.status_code == 401 and vllm_error(unauthorized).type == "Unauthorized"
    # vLLM's client: no request_id, the server makes one and the status reports the refusal.
    retry = server.http.post(APPLY, json={"instruction": "retry", "params": {}}, headers=auth)
    assert retry.status_code == 202
    made = retry.json()["request_id"]
    rejected = server.result(made)
    assert rejected["success"] is False and "status is DEAD" in rejected["reason"]
    shown = server.engines()[3]
    assert shown["last_ft_request_id"] == made and "status is DEAD" in shown["ft_error"]
    body = {"instruction": "scale_down", "params": {"removed_dp_ranks": [3]}, "request_id": "sd-1"}
    assert server.http.post(APPLY, json=body, headers=auth).status_code == 202
    assert server.result("sd-1")["success"] is True
    server.wait(
        lambda e: all(
            e[r]["status"] == HEALTHY and e[r]["removed_ranks"] == [3] for r in (0, 1, 2)
        ),
        30,
    )
    codes = health.stop()
    assert codes[0] == 200 and 503 in codes and codes[-1] == 200, codes
    assert_outputs_match(server, expected, KEY)
    samples = server.metrics()
    assert metric(samples, "ftengine_faults_total", kind="dead_peer") >= 3
    assert metric(samples, "ftengine_recoveries_total", kind="scale_down", outcome="healthy") == 3
    assert metric(samples, "ftengine_engine_phase", engine="3", phase="dead") == 1
    assert metric(samples, "ftengine_commands_total", instruction="retry", outcome="failure") == 1
    # Rank 3 held only redundant copies; rank 1 holds the last live copies of its experts,
    # so the second scale-down (4 -> 3 -> 2, cumulative ranks) must reload weights.
    assert metric(samples, "ftengine_experts_reloaded_total") == reloads(server, "reloads")
    second_scale_down(server, auth)
    assert_outputs_match(server, expected, KEY)
    samples = server.metrics()
    assert metric(samples, "ftengine_recoveries_total", kind="scale_down", outcome="healthy") == 5
    added = reloads(server, "reloads")
    assert added > 0
    assert metric(samples, "ftengine_experts_reloaded_total") >= added
    assert metric(samples, "ftengine_bytes_reloaded_total") >= reloads(server, "bytes_reloaded") > 0
    assert (
        metric(
            samples,
            "ftengine_recovery_duration_seconds_count",
            kind="scale_down",
            step="expert_repair",
        )
        == 5
    )


def reloads(server: Server, key: str) -> int:
    """Sum of ``key`` over the live engines' last repair reports."""
    total = 0
    for engine in server.engines().values():
        repair = (engine["timeline"] or {}).get("repair") if engine["status"] != DEAD else None
        total += int((repair or {}).get(key) or 0)
    return total


def second_scale_down(server: Server, auth: dict[str, str]) -> None:
    victim = server.engines()[1]["pid"]
    assert victim in server.descendants
    os.kill(victim, signal.SIGKILL)
    server.wait(
        lambda e: e[1]["status"] == DEAD and e[0]["status"] == e[2]["status"] == UNHEALTHY, 30
    )
    body = {
        "instruction": "scale_down",
        "params": {"removed_dp_ranks": [3, 1]},
        "request_id": "sd-2",
    }
    assert server.http.post(APPLY, json=body, headers=auth).status_code == 202
    assert server.result("sd-2")["success"] is True
    server.wait(
        lambda e: all(
            e[r]["status"] == HEALTHY and e[r]["removed_ranks"] == [1, 3] for r in (0, 2)
        ),
        30,
    )


class HealthProbe:
    """Samples GET /health every 20 ms until stopped; keeps the distinct code sequence."""

    def __init__(self, server: Server) -> None:
        self._client = httpx.Client(base_url=server.url, timeout=10.0)
        self._codes: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> HealthProbe:
        self._codes.append(self._client.get("/health").status_code)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            code = self._client.get("/health").status_code
            if code != self._codes[-1]:
                self._codes.append(code)

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join(timeout=10)
        self._codes.append(self._client.get("/health").status_code)
        self._client.close()
        return self._codes


@pytest.mark.timeout(240)
def test_demo_json_end_to_end(tmp_path: Path, checkpoint: Path) -> None:
    """``ftengine demo --cluster --json`` (the CPU-cluster demo, for machines): one JSON object."""
    command = [sys.executable, "-m", "ftengine", "demo", "--cluster", "--json"]
    command += ["--checkpoint", str(checkpoint)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=220, env=clean_env())
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["scenario"] == "sigkill-scale-down" and report["ok"] is True
    assert report["recovered"] is True and report["outputs_match"] is True
    assert report["removed_ranks"] == [3]
    assert [c["dest"] for c in report["phases"]["3"]] == ["dead"]
    for rank in ("0", "1", "2"):
        assert [c["dest"] for c in report["phases"][rank]][-1] == "healthy"
    assert {row["name"] for row in report["breakdown"]} >= {
        "detect", "quarantine", "comm rebuild", "expert repair", "validate", "first correct token"
    }  # fmt: skip


@pytest.mark.timeout(60)
def test_serve_refuses_a_public_bind_without_a_key(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "ftengine", "serve", "--host", "0.0.0.0", "--port", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=50, env=clean_env())
    assert done.returncode == 2
    assert "refusing to bind '0.0.0.0' without an API key" in done.stderr
