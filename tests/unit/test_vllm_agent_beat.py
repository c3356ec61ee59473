"""The engine-core agent's beat is cheap: it writes its status only when it changes (and
every ``PUBLISH_S`` as a sign of life) and reads every peer in one DP-store round trip."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from ftengine.integrations.vllm.engine_core import agent as engine_agent
from ftengine.integrations.vllm.engine_core import dp_board
from ftengine.integrations.vllm.engine_core.agent import STALE_S
from ftengine.integrations.vllm.engine_core.dp_board import KEY, PUBLISH_S
from tests.unit.test_vllm_engine_agent import Sentinel, Status, Store, agent_for, markers

pytest.importorskip(engine_agent.UTILS_MODULE, reason="vllm is not installed")


class CountingStore(Store):
    """The stand-in DP store, counting the calls of each kind (round trips to rank 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {"set": 0, "check": 0, "get": 0, "multi_get": 0}

    def set(self, key: str, value: str) -> None:
        self.calls["set"] += 1
        super().set(key, value)

    def check(self, keys: list[str]) -> bool:
        self.calls["check"] += 1
        return super().check(keys)

    def get(self, key: str) -> bytes:
        self.calls["get"] += 1
        return super().get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.calls["multi_get"] += 1
        return [Store.get(self, key) for key in keys]


def counting(sentinel: Sentinel) -> CountingStore:
    store = CountingStore()
    sentinel.engine.dp_store = store
    return store


def published(store: Store, rank: int = 0) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(store.data[KEY.format(rank=rank)])
    return value


def test_an_unchanged_status_is_written_once_per_publish_interval() -> None:
    sentinel = Sentinel(world=3)
    store = counting(sentinel)
    agent = agent_for(sentinel)
    for _ in range(10):
        agent._watch_peers()
    assert store.calls["set"] == 1 and published(store)["beat"] == 1
    agent.board.published_at -= PUBLISH_S  # the interval has passed
    agent._watch_peers()  # the sign of life: the beat count moves on
    assert store.calls["set"] == 2 and published(store)["beat"] == 11
    assert PUBLISH_S < STALE_S / 2  # a live peer is never taken for stale


def test_a_status_change_is_written_at_once() -> None:
    sentinel = Sentinel()
    store = counting(sentinel)
    agent = agent_for(sentinel)
    agent._watch_peers()
    sentinel.status_type = Status.UNHEALTHY
    agent._watch_peers()
    assert store.calls["set"] == 2 and published(store)["status"] == "unhealthy"
    sentinel._dp_reinit_epoch = 1  # a retry: same status word, new epoch, written too
    agent._watch_peers()
    assert store.calls["set"] == 3 and published(store)["epoch"] == 1


def test_peers_are_read_in_one_round_trip_once_all_have_published() -> None:
    sentinel = Sentinel(world=4)
    store = counting(sentinel)
    agent = agent_for(sentinel)
    store.peer(1, "healthy")
    agent._watch_peers()  # ranks 2 and 3 not there yet: key by key (multi_get would block)
    assert store.calls["multi_get"] == 0 and store.calls["get"] == 1
    store.peer(2, "healthy")
    store.peer(3, "healthy")
    before = dict(store.calls)
    for _ in range(5):
        agent._watch_peers()
    assert store.calls["multi_get"] - before["multi_get"] == 5
    assert store.calls["check"] - before["check"] == 1  # once, to learn all keys are there
    assert store.calls["get"] == before["get"]
    assert agent.peers == {1: "healthy", 2: "healthy", 3: "healthy"}
    store.peer(3, "dead", beat=2)
    agent._watch_peers()
    assert agent.peers[3] == "dead" and len(markers(sentinel)) == 1


def test_a_replaced_dp_store_is_read_key_by_key_until_every_peer_is_on_it() -> None:
    sentinel = Sentinel()
    first = counting(sentinel)
    agent = agent_for(sentinel)
    first.peer(1, "healthy")
    agent._watch_peers()
    agent._watch_peers()
    assert first.calls["multi_get"] == 2  # peer 1 was there from the first beat
    second = counting(sentinel)  # a retry's new DP group and store: peer 1 not on it yet
    agent._watch_peers()
    assert second.calls["multi_get"] == 0 and second.calls["set"] == 1
    second.peer(1, "healthy")
    agent._watch_peers()
    assert second.calls["multi_get"] == 1


def test_the_board_works_on_a_real_tcpstore() -> None:
    """What vLLM's DP store is: the stand-in's ``check`` / ``get`` / ``multi_get`` are
    torch's (a multi_get of a missing key would block, so the board checks first)."""
    from datetime import timedelta

    from torch._C._distributed_c10d import TCPStore

    from ftengine.integrations.vllm.engine_core.agreement import Proposal
    from ftengine.integrations.vllm.engine_core.dp_board import Entry, PeerStatus, StatusBoard

    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    zero, one = StatusBoard(0, 3), StatusBoard(1, 3)
    assert zero.read(store, skip=frozenset({2})) == {}  # rank 1 not there: no blocking multi_get
    one.publish(store, Entry("healthy", 0), 1, 0.0)
    assert zero.read(store, skip=frozenset({2})) == {1: PeerStatus(Entry("healthy", 0), 1)}
    assert zero.complete == (store, frozenset({1}))  # rank 2 is removed: never waited for
    proposing = Entry("unhealthy", 0, Proposal("scale_down", frozenset({2}), 0), blame=2)
    one.publish(store, proposing, 2, 0.0)
    assert zero.read(store, skip=frozenset({2})) == {1: PeerStatus(proposing, 2)}
    # Rank 2 admitted back, not published yet: not waited for either (a multi_get of its
    # missing key would raise at the store's timeout).
    assert zero.read(store) == {1: PeerStatus(proposing, 2)}


def watched_pair(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[Sentinel, CountingStore, engine_agent.EngineCoreAgent, list[bool]]:
    """Engine 0 of two (its peer healthy on a counting store) whose worker's exit is
    ``dying[0]``."""
    sentinel = Sentinel()
    store = counting(sentinel)
    store.peer(1, "healthy")
    dying = [False]
    monkeypatch.setattr(engine_agent, "worker_dying", lambda executor: dying[0])
    return sentinel, store, agent_for(sentinel), dying


def test_a_tick_reads_the_peers_every_read_interval_and_at_once_on_its_own_news(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sentinel, store, agent, dying = watched_pair(monkeypatch)

    def reads() -> int:
        return store.calls["multi_get"] + store.calls["get"]

    agent._tick()  # the first tick publishes and reads
    assert (store.calls["set"], reads()) == (1, 1)
    for _ in range(5):
        agent._tick()  # within PEER_READ_S: the worker's exit checked, no round trip
    assert (store.calls["set"], reads()) == (1, 1)
    agent._read_at -= dp_board.PEER_READ_S
    agent._tick()
    assert reads() == 2
    sentinel.status_type = Status.UNHEALTHY  # news of its own: written and read at once
    agent._tick()
    assert (store.calls["set"], reads()) == (2, 3) and published(store)["status"] == "unhealthy"
    sentinel.status_type = Status.HEALTHY
    agent._tick()
    dying[0] = True  # the worker began to exit: "dead" on the next tick
    agent._tick()
    assert published(store)["status"] == "dead" and reads() == 5
    agent._tick()
    assert reads() == 5  # said once; the tick goes back to the read interval


def test_a_status_change_rings_the_peers_doorbells_and_they_read_at_once() -> None:
    store = CountingStore()
    zero, one = Sentinel(rank=0), Sentinel(rank=1)
    zero.engine.dp_store = one.engine.dp_store = store
    agents = agent_for(zero), agent_for(one)
    for agent in (*agents, agents[0]):
        agent._read_at -= dp_board.PEER_READ_S
        agent._tick()  # each publishes (with its doorbell's address) and reads the other
    assert agents[0].board.doorbells == {1: agents[1].doorbell.address}
    assert not agents[0].doorbell.wait(0.0)  # first publishes are no news to anyone
    reads = store.calls["multi_get"] + store.calls["get"]
    one.status_type = Status.UNHEALTHY
    agents[1]._tick()  # its own news: written, and engine 0's doorbell rung
    assert agents[0].doorbell.wait(5.0)
    agents[0]._tick(rung=True)  # well within PEER_READ_S: read because rung
    assert store.calls["multi_get"] + store.calls["get"] == reads + 2
    assert agents[0].peers == {1: "unhealthy"} and len(markers(zero)) == 1
    assert not agents[0].doorbell.wait(0.0)  # every ring was taken


def test_the_beat_interval_knob_takes_positive_seconds_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(engine_agent.BEAT_ENV, raising=False)
    assert dp_board.beat_interval() == engine_agent.BEAT_S
    monkeypatch.setenv(engine_agent.BEAT_ENV, "86400")
    assert agent_for(Sentinel()).beat_s == 86400.0
    for bad, why in (("soon", r"\(a number\)"), ("0", "> 0"), ("nan", "> 0")):
        monkeypatch.setenv(engine_agent.BEAT_ENV, bad)
        with pytest.raises(ValueError, match=f"FTENGINE_VLLM_BEAT_S: expected seconds {why}"):
            dp_board.beat_interval()


def test_the_overhead_only_bench_refuses_an_unknown_baseline(tmp_path: Any) -> None:
    from ftengine.testbed.bench.vllm import BenchConfig, run_overhead

    config = BenchConfig(tmp_path, overhead_only=True, baseline="vllm")
    with pytest.raises(ValueError, match=r"baseline: expected one of \('off', 'inert'\)"):
        run_overhead(config)  # before anything is launched


def test_the_watch_step_wakes_the_agent_only_on_news_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one thread that wakes every beat checks the worker and the status; the agent
    thread sleeps on its doorbell until that news (or a peer's ring, or the read interval)."""
    sentinel, store, agent, dying = watched_pair(monkeypatch)
    agent._tick()  # published: healthy
    for _ in range(3):
        agent.watch_step()
    assert not agent.doorbell.wait(0.0)  # nothing new: the agent sleeps on
    sentinel.status_type = Status.UNHEALTHY
    agent.watch_step()
    assert agent.doorbell.wait(0.0)  # its own doorbell rung
    agent._tick(rung=True)
    assert published(store)["status"] == "unhealthy"
    agent.watch_step()
    assert not agent.doorbell.wait(0.0)  # said: no ring again
    dying[0] = True
    agent.watch_step()
    assert agent._dying and agent.doorbell.wait(0.0)
    agent._tick(rung=True)
    assert published(store)["status"] == "dead"
    agent.stop()


def test_the_watch_step_runs_the_probes_and_the_quorum(monkeypatch: pytest.MonkeyPatch) -> None:
    agent = agent_for(Sentinel())
    calls: list[str] = []
    monkeypatch.setattr(agent.reach, "step", lambda: calls.append("probe"))
    monkeypatch.setattr(agent, "guard_step", lambda: calls.append("quorum"))
    agent.watch_step()
    assert calls == ["probe", "quorum"]
    agent.stop()
    agent.reach.close()


def test_a_single_rank_engine_starts_no_watch_thread() -> None:
    """With no peers nothing is probed or published: DP=1 keeps the agent's own beat."""
    alone, pair = agent_for(Sentinel(world=1)), agent_for(Sentinel(world=2))
    for agent in (alone, pair):
        agent.start()
    try:
        assert not alone.watch.is_alive() and alone.thread.is_alive()
        assert pair.watch.is_alive() and pair.thread.is_alive()
    finally:
        for agent in (alone, pair):
            agent.stop()
    pair.watch.join(5.0)
    assert not pair.watch.is_alive()  # it stops at the next beat and closes the probes
    assert pair.reach.sock.fileno() == -1


def test_the_watch_thread_outlives_a_failing_step(monkeypatch: pytest.MonkeyPatch) -> None:
    agent = agent_for(Sentinel(world=2))
    steps: list[int] = []

    def failing() -> None:
        steps.append(1)
        raise RuntimeError("one bad step")

    monkeypatch.setattr(agent, "watch_step", failing)
    agent.beat_s = 0.01
    agent.watch.start()
    deadline = time.monotonic() + 5.0
    while len(steps) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    agent.stop()
    agent.watch.join(5.0)
    assert len(steps) >= 3 and not agent.watch.is_alive()
