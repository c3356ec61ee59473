"""The control API end to end: a real ``ftengine serve`` (uvicorn, loopback, ephemeral port)
over a real DP=4 CPU cluster, driven purely through HTTP: injected fault + retry and SIGKILL
+ scale-down, auth, bad input, /health flipping during recovery and /metrics counters moving.
Each server is stopped with SIGTERM by pid, and every process it started must be gone
afterwards."""

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
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ftengine.cluster import reference_generate
from ftengine.weights.checkpoint_gen import make_checkpoint

pytestmark = pytest.mark.integration

PROMPTS = ([1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14])
MAX_TOKENS = 5
SIZES: dict[str, Any] = {"layers": 2, "experts": 8, "hidden": 64, "intermediate": 32}
SIZE_FLAGS = ["--layers", "2", "--experts", "8", "--hidden", "64", "--intermediate", "32"]
START_TIMEOUT_S = 120.0
KEY = "test-key-123"


class Server:
    """One ``ftengine serve`` subprocess and the processes it started."""

    def __init__(self, tmp: Path, checkpoint: Path, *extra: str, env: dict[str, str]) -> None:
        port_file = tmp / "port"
        command = [sys.executable, "-m", "ftengine", "serve", "--port", "0"]
        command += ["--port-file", str(port_file), "--checkpoint", str(checkpoint), *SIZE_FLAGS]
        command += ["--op-timeout", "2", "--log-level", "warning", *extra]
        self.log = (tmp / "serve.log").open("wb")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists():
            assert self.process.poll() is None, f"serve exited early: {self.logs()}"
            assert time.monotonic() < deadline, f"serve not ready in time: {self.logs()}"
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"
        self.http = httpx.Client(base_url=self.url, timeout=60.0)
        self.descendants = {p.pid for p in psutil.Process(self.process.pid).children(True)}

    def logs(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def engines(self) -> dict[int, dict[str, Any]]:
        status = self.http.get("/v1/fault_tolerance/status")
        assert status.status_code == 200, status.text
        return {engine["id"]: engine for engine in status.json()["engines"]}

    def wait(self, predicate: Callable[[dict[int, dict[str, Any]]], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(engines := self.engines()):
            assert time.monotonic() < deadline, f"timed out; engines: {engines}"
            time.sleep(0.05)

    def result(self, request_id: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + 90
        while True:
            record = self.http.get(f"/v1/fault_tolerance/requests/{request_id}", headers=headers)
            assert record.status_code == 200, record.text
            if record.json()["state"] == "done":
                return dict(record.json()["result"])
            assert time.monotonic() < deadline, f"command {request_id} never finished"
            time.sleep(0.05)

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        text = self.http.get("/metrics").text
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def stop(self) -> None:
        """SIGTERM by pid; every process the server started must be gone afterwards."""
        self.http.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.log.close()
        # Helpers of the server (multiprocessing's resource tracker) exit on their own once
        # the server is gone, a moment later under load: give them a bounded grace period.
        _wait_gone(self.descendants, timeout=15.0)
        leftovers = [pid for pid in self.descendants if _running(pid)]
        for pid in leftovers:  # only ever our own server's children
            os.kill(pid, signal.SIGKILL)
        assert not leftovers, f"serve left processes behind: {leftovers}"


def _wait_gone(pids: set[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def metric(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("http-ckpt") / "model", **SIZES)


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    return [list(g.token_ids) for g in reference_generate(checkpoint, PROMPTS, MAX_TOKENS)]


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("FTENGINE_API_KEY", "FTENGINE_INJECT_FAULT")
    }
    return {**env, **extra}


@pytest.fixture
def serve(tmp_path: Path, checkpoint: Path) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(*extra: str, **env: str) -> Server:
        home = tmp_path / f"server-{len(servers)}"
        home.mkdir()
        server = Server(home, checkpoint, *extra, env=_env(**env))
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def generate(
    server: Server, prompt: list[int], headers: dict[str, str] | None = None
) -> httpx.Response:
    body = {"prompt_token_ids": prompt, "max_tokens": MAX_TOKENS}
    return server.http.post("/v1/generate", json=body, headers=headers)


def assert_outputs_match(
    server: Server, expected: list[list[int]], headers: dict[str, str] | None = None
) -> None:
    for prompt, want in zip(PROMPTS[: len(expected)], expected, strict=True):
        answer = generate(server, prompt, headers)
        assert answer.status_code == 200, answer.text
        assert answer.json()["token_ids"] == want


BAD_COMMANDS: list[tuple[object, str]] = [
    ({"instruction": "reboot", "params": {}, "request_id": "b1"}, "unknown instruction"),
    ({"instruction": "scale_down", "params": {}, "request_id": "b2"}, "removed_dp_ranks"),
    (
        {"instruction": "scale_down", "params": {"removed_dp_ranks": [9]}, "request_id": "b3"},
        "out of range",
    ),
    (
        {
            "instruction": "scale_down",
            "params": {"removed_dp_ranks": [0, 1, 2, 3]},
            "request_id": "b4",
        },
        "every one",
    ),
    ({"instruction": "retry", "params": {"x": 1}, "request_id": "b5"}, "retry takes no params"),
    ({"instruction": "retry", "params": {}}, "request_id"),
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
        answer = server.http.post("/v1/fault_tolerance/apply", json=body)
        assert answer.status_code == 422 and needle in answer.json()["detail"], answer.text
    assert server.engines() == before
    deadline = time.monotonic() + 60
    while generate(server, PROMPTS[1]).status_code == 200:  # the injected fault fires at step 8
        assert time.monotonic() < deadline, "the injected fault never fired"
    server.wait(lambda e: all(x["status"] == 2 for x in e.values()), 30)
    assert server.engines()[3]["fault_info"], "rank 3 must carry fault_info"
    assert server.http.get("/health").status_code == 503
    accepted = server.http.post(
        "/v1/fault_tolerance/apply",
        json={"instruction": "retry", "params": {}, "request_id": "retry-1"},
    )
    assert accepted.status_code == 202 and accepted.json()["request_id"] == "retry-1"
    assert server.result("retry-1") == {"request_id": "retry-1", "success": True, "reason": None}
    server.wait(lambda e: all(x["status"] == 0 for x in e.values()), 30)
    replay = server.http.post(
        "/v1/fault_tolerance/apply",
        json={"instruction": "retry", "params": {}, "request_id": "retry-1"},
    )
    assert replay.status_code == 200 and replay.json()["success"] is True
    assert all(e["epoch"] == 1 for e in server.engines().values()), "a replay must not act again"
    assert server.http.get("/health").status_code == 200
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


@pytest.mark.timeout(300)
def test_sigkill_scale_down_over_http_with_auth(
    serve: Callable[..., Server], expected: list[list[int]]
) -> None:
    server = serve(FTENGINE_API_KEY=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    assert generate(server, PROMPTS[0]).status_code == 401
    assert generate(server, PROMPTS[0], {"Authorization": "Bearer wrong"}).status_code == 401
    assert_outputs_match(server, expected, auth)
    victim = server.engines()[3]["pid"]
    assert victim in server.descendants  # we only ever signal our own server's workers
    health = HealthProbe(server).start()
    os.kill(victim, signal.SIGKILL)
    server.wait(lambda e: e[3]["status"] == 1 and all(e[r]["status"] == 2 for r in (0, 1, 2)), 30)
    unauthorized = server.http.post(
        "/v1/fault_tolerance/apply", json={"instruction": "retry", "params": {}, "request_id": "r"}
    )
    assert unauthorized.status_code == 401
    retry = server.http.post(
        "/v1/fault_tolerance/apply",
        json={"instruction": "retry", "params": {}, "request_id": "retry-1"},
        headers=auth,
    )
    assert retry.status_code == 202
    rejected = server.result("retry-1")
    assert rejected["success"] is False and "status is DEAD" in rejected["reason"]
    body = {"instruction": "scale_down", "params": {"removed_dp_ranks": [3]}, "request_id": "sd-1"}
    assert server.http.post("/v1/fault_tolerance/apply", json=body, headers=auth).status_code == 202
    assert server.result("sd-1")["success"] is True
    server.wait(
        lambda e: all(e[r]["status"] == 0 and e[r]["removed_ranks"] == [3] for r in (0, 1, 2)), 30
    )
    codes = health.stop()
    assert codes[0] == 200 and 503 in codes and codes[-1] == 200, codes
    assert_outputs_match(server, expected, auth)
    samples = server.metrics()
    assert metric(samples, "ftengine_faults_total", kind="dead_peer") >= 3
    assert metric(samples, "ftengine_recoveries_total", kind="scale_down", outcome="healthy") == 3
    assert metric(samples, "ftengine_engine_phase", engine="3", phase="dead") == 1
    assert metric(samples, "ftengine_commands_total", instruction="retry", outcome="failure") == 1
    # Rank 3 held only redundant copies; rank 1 holds the last live copies of its experts,
    # so the second scale-down (4 -> 3 -> 2, cumulative ranks) must reload weights.
    assert metric(samples, "ftengine_experts_reloaded_total") == reloads(server, "reloads")
    second_scale_down(server, auth)
    assert_outputs_match(server, expected, auth)
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
        repair = (engine["timeline"] or {}).get("repair") if engine["status"] != 1 else None
        total += int((repair or {}).get(key) or 0)
    return total


def second_scale_down(server: Server, auth: dict[str, str]) -> None:
    victim = server.engines()[1]["pid"]
    assert victim in server.descendants
    os.kill(victim, signal.SIGKILL)
    server.wait(lambda e: e[1]["status"] == 1 and e[0]["status"] == e[2]["status"] == 2, 30)
    body = {
        "instruction": "scale_down",
        "params": {"removed_dp_ranks": [3, 1]},
        "request_id": "sd-2",
    }
    assert server.http.post("/v1/fault_tolerance/apply", json=body, headers=auth).status_code == 202
    assert server.result("sd-2")["success"] is True
    server.wait(
        lambda e: all(e[r]["status"] == 0 and e[r]["removed_ranks"] == [1, 3] for r in (0, 2)), 30
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
    """``ftengine demo --json`` (what ``make demo`` runs, for machines): one JSON object."""
    command = [sys.executable, "-m", "ftengine", "demo", "--json", "--checkpoint", str(checkpoint)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=220, env=_env())
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
    done = subprocess.run(command, capture_output=True, text=True, timeout=50, env=_env())
    assert done.returncode == 2
    assert "refusing to bind '0.0.0.0' without an API key" in done.stderr
