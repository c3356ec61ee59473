"""No request lost, through HTTP: concurrent streaming clients (the official ``openai``
client) on a real ``ftengine serve`` (DP=4) keep streaming through a fault and its recovery,
and each ends with exactly the single-process reference's tokens, every token streamed once
(no gap, no repeat): an injected fault + ``retry``, SIGKILL of a rank + ``scale_down``, and
SIGSTOP of a rank + the supervisor's fence + ``scale_down``.

One server per module (a DP=4 launch is the expensive part): the injected fault fires once,
so the retry test has its own server; the rank-loss tests share one and each picks its
victim among the ranks still live and removes it with the ranks removed before, so either
runs alone or after the other. Servers are stopped by pid (serve_support.Server.stop)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from ftengine.testbed.cluster import reference_generate
from ftengine.weights.checkpoint_gen import make_checkpoint
from tests.integration.serve_support import APPLY, MODEL, SIZES, Server, Starter

pytestmark = pytest.mark.integration

PROMPTS = ([1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [3, 1, 4, 1, 5, 9], [100, 7])
TOKENS = 40
FAULT_STEP = 10  # the injected fault: mid-generation of the first batch of streams
STREAM_TIMEOUT_S = 150.0


class Stream(threading.Thread):
    """One streaming completion in its own thread: the token ids of each chunk as they
    came, the last finish reason, the usage's completion token count, or the error."""

    def __init__(self, client: openai.OpenAI, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.prompt = prompt
        self.chunks: list[list[int]] = []
        self.finish_reason: str | None = None
        self.completion_tokens: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            chunks = self.client.completions.create(
                model=MODEL,
                prompt=self.prompt,
                max_tokens=TOKENS,
                stream=True,
                stream_options={"include_usage": True},
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            for chunk in chunks:
                if chunk.usage is not None:
                    self.completion_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    self.chunks.append(list((choice.model_extra or {})["token_ids"]))
                    self.finish_reason = choice.finish_reason or self.finish_reason
        except BaseException as exc:  # reported by check(), in the test's thread
            self.error = exc

    @property
    def tokens(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk]

    def check(self, want: list[int]) -> None:
        """Finished with the reference: its chunks concatenate to exactly ``want`` (no
        token missing, none repeated) and the usage counts them."""
        self.join(STREAM_TIMEOUT_S)
        assert not self.is_alive(), f"stream {self.prompt} never finished"
        assert self.error is None, f"stream {self.prompt} failed: {self.error!r}"
        assert self.finish_reason == "length", (self.prompt, self.finish_reason, self.tokens)
        assert self.tokens == want, f"prompt {self.prompt}: {self.chunks}"
        assert all(len(chunk) <= 1 for chunk in self.chunks), self.chunks
        assert self.completion_tokens == len(want)


def start_streams(server: Server) -> list[Stream]:
    client = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=STREAM_TIMEOUT_S
    )
    streams = [Stream(client, prompt) for prompt in PROMPTS]
    for stream in streams:
        stream.start()
    return streams


def wait_streaming(streams: list[Stream], at_least: int) -> None:
    """Every stream has received ``at_least`` tokens (and none has finished)."""
    deadline = time.monotonic() + 60
    while not all(len(s.tokens) >= at_least or s.error for s in streams):
        assert time.monotonic() < deadline, [len(s.tokens) for s in streams]
        time.sleep(0.01)
    assert all(s.error is None and s.finish_reason is None for s in streams)


def in_flight(streams: list[Stream]) -> list[int]:
    """How many tokens each stream had; some must be strictly mid-generation."""
    counts = [len(s.tokens) for s in streams]
    assert any(0 < n < TOKENS for n in counts), f"no stream was mid-generation: {counts}"
    return counts


def command(server: Server, instruction: str, params: dict[str, Any], request_id: str) -> None:
    body = {"instruction": instruction, "params": params, "request_id": request_id}
    accepted = server.http.post(APPLY, json=body)
    assert accepted.status_code == 202, accepted.text
    result = server.result(request_id)
    assert result["success"] is True, result


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("reinference-http-ckpt") / "model", **SIZES)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> list[list[int]]:
    return [list(g.token_ids) for g in reference_generate(checkpoint, PROMPTS, TOKENS)]


@pytest.fixture(scope="module")
def starter(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[Starter]:
    starter = Starter(tmp_path_factory.mktemp("reinference-http-serve"), checkpoint)
    try:
        yield starter
    finally:
        starter.stop_all()


@pytest.fixture(scope="module")
def rank_loss_server(starter: Starter) -> Server:
    return starter()


@pytest.mark.timeout(300)
def test_injected_fault_and_retry_keep_every_stream_exact(
    starter: Starter, reference: list[list[int]]
) -> None:
    server = starter("--inject-fault", f"rank=1,step={FAULT_STEP},kind=raise")
    streams = start_streams(server)
    server.wait(lambda e: all(x["status"] == "unhealthy" for x in e.values()), 60)
    in_flight(streams)
    assert server.engines()[1]["fault_info"], "rank 1 raised: it must carry fault_info"
    command(server, "retry", {}, "reinference-retry")
    for stream, want in zip(streams, reference, strict=True):
        stream.check(want)
    assert all(e["status"] == "healthy" for e in server.engines().values())


def pick_victim(server: Server) -> tuple[int, int, list[int]]:
    """The highest live rank, its pid, and the ranks a scale-down must name once it is gone
    (the ones removed before plus it: vLLM's ``removed_dp_ranks`` are cumulative)."""
    engines = server.engines()
    live = [rank for rank, e in engines.items() if e["status"] == "healthy"]
    victim = max(live)
    pid = engines[victim]["pid"]
    assert pid in server.descendants  # we only ever signal our own server's workers
    return victim, pid, sorted({*engines[live[0]]["removed_ranks"], victim})


def run_rank_loss(
    server: Server, reference: list[list[int]], how: signal.Signals, request_id: str
) -> int:
    """Streams run; the highest live rank gets ``how``; once it is DEAD (SIGSTOP: fenced by
    the supervisor for missing heartbeats) ``scale_down`` removes it; every stream ends exact.
    Returns the victim's pid."""
    victim, pid, removed = pick_victim(server)
    streams = start_streams(server)
    wait_streaming(streams, 2)
    os.kill(pid, how)
    server.wait(lambda e: e[victim]["status"] == "dead", 60)
    in_flight(streams)
    command(server, "scale_down", {"removed_dp_ranks": removed}, request_id)
    for stream, want in zip(streams, reference, strict=True):
        stream.check(want)
    engines = server.engines()
    assert all(engines[r]["removed_ranks"] == removed for r in engines if r not in removed)
    return pid


@pytest.mark.timeout(300)
def test_sigkill_and_scale_down_keep_every_stream_exact(
    rank_loss_server: Server, reference: list[list[int]]
) -> None:
    run_rank_loss(rank_loss_server, reference, signal.SIGKILL, "reinference-sigkill")


@pytest.mark.timeout(300)
def test_sigstop_fence_and_scale_down_keep_every_stream_exact(
    rank_loss_server: Server, reference: list[list[int]]
) -> None:
    pid = run_rank_loss(rank_loss_server, reference, signal.SIGSTOP, "reinference-sigstop")
    # A stopped process never exits by itself: it is gone because the supervisor fenced it.
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.timeout(240)
def test_a_request_over_the_reinference_limit_is_aborted_with_the_reason(
    starter: Starter, reference: list[list[int]]
) -> None:
    """``--max-reinference 0``: a request whose step faults (the poison injector's token)
    is aborted at its first fault, and the HTTP client reads why in ``stop_reason``; the
    server goes on serving. (With N >= 1 a request that faults every re-run is found by
    the poison probe first and ends as ``error``; test_serving_reinference covers that.)"""
    used = {t for p in PROMPTS for t in p} | {t for r in reference for t in r}
    token = min(set(range(1, 512)) - used)
    server = starter(
        "--dp-size", "2", "--policy", "auto", "--max-reinference", "0",
        "--inject-fault", f"kind=poison,token={token}",
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    answer = client.completions.create(
        model=MODEL, prompt=[token, 5, 6], max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    [choice] = answer.choices
    assert str(choice.finish_reason) == "abort" and (choice.model_extra or {})["token_ids"] == []
    reason = str((choice.model_extra or {})["stop_reason"])
    assert reason.startswith("re-inference limit reached: the request was in 1 faulted"), reason
    assert "at most 0 times (max_reinference)" in reason
    server.wait(lambda e: all(x["status"] == "healthy" for x in e.values()), 60)
    good = Stream(client, PROMPTS[0])
    good.start()
    good.check(reference[0])
