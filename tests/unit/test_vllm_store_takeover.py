"""Rank 0's host lost: the survivors take over its DP store (each engine core's standby
store, the lowest survivor's used alike by all) and step without its DP coordinator (each
engine core's wave bell, rung when a wave begins with DP rank 0 removed); the agent's store
calls bounded, so one across a cut never keeps the board from moving. Real TCPStores and
UDP sockets; vLLM's own ``DPEngineCoreProc._handle_client_request`` decides on a ring."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from ftengine.integrations.vllm.engine_core import scale_down as sd
from ftengine.integrations.vllm.engine_core.dp_board import KEY
from ftengine.integrations.vllm.engine_core.standby_store import (
    BOARD_TIMEOUT_S,
    STORE_RANK_ATTR,
    BoundedStore,
    StandbyUnknown,
    StoreStuck,
    connect,
    stand_in,
)
from ftengine.integrations.vllm.engine_core.wave_bell import WaveBell, decode, import_start_wave
from ftengine.integrations.vllm.patches.engine_core import ENGINE_CORE_PATCHES
from tests.unit.test_vllm_engine_agent import Sentinel, Store, agent_for

core = pytest.importorskip("vllm.v1.engine.core", reason="vllm is not installed")


OPENED: list[Any] = []  # every agent a test opened, stopped after it


@pytest.fixture(autouse=True)
def _stop_agents() -> Iterator[None]:
    yield
    while OPENED:
        OPENED.pop().stop()  # its wave bell's thread and socket


def pair(world: int = 3) -> tuple[Store, dict[int, Any]]:
    """Agents of ranks 1..world-1 on one stand-in DP store (rank 0's), each having read the
    others' entries (their standby stores and wave bells)."""
    store = Store()
    agents = {}
    for rank in range(1, world):
        sentinel = Sentinel(rank=rank, world=world)
        sentinel.engine.dp_store = store
        agents[rank] = agent_for(sentinel)
        agents[rank].open_takeover()  # as start() does
        OPENED.append(agents[rank])
    for _ in range(2):
        for agent in agents.values():
            agent._watch_peers()
    return store, agents


def test_every_engine_advertises_a_standby_store_that_takes_writes() -> None:
    _, agents = pair()
    for rank, agent in agents.items():
        others = {r: a.standby.address for r, a in agents.items() if r != rank}
        assert {r: agent.board.standbys[r] for r in others} == others
        client = agent.standby.client(agents[1].standby.address)
        client.set(f"from-{rank}", b"x")
    assert agents[1].standby.server.get("from-2") == b"x"


def test_the_board_moves_to_the_lowest_survivors_standby_once_rank_0_is_gone() -> None:
    """Rank 0's store would fail every call (its host lost): once the probes take rank 0 for
    gone, ranks 1 and 2 publish and read each other on rank 1's standby store instead,
    where a policy's proposal can be agreed."""
    store, agents = pair()
    store.broken = True
    writes = dict(store.data)
    for agent in agents.values():
        agent.gone = frozenset({0})
    for _ in range(2):
        for agent in agents.values():
            agent._watch_peers()
    standby = agents[1].standby.server
    assert standby.check([KEY.format(rank=1), KEY.format(rank=2)])
    assert store.data == writes  # nothing more on rank 0's
    assert agents[2].peers[1] == "healthy" and agents[1].peers[2] == "healthy"
    assert agents[2]._store_failures == 0


def test_while_rank_0_lives_the_board_stays_on_its_store() -> None:
    store, agents = pair()
    for agent in agents.values():
        agent.gone = frozenset({2}) if agent.rank == 1 else frozenset({1})  # another rank
        agent._watch_peers()
    assert not agents[1].standby.server.check([KEY.format(rank=1)])
    assert KEY.format(rank=1) in store.data


def test_the_rebuild_past_the_store_host_meets_on_the_lowest_members_standby() -> None:
    """``keys_store``: rank 0 (hosting the DP store) left out of the new group, rank 2 gets a
    client of rank 1's standby store (a key it writes lands there); with rank 0 still a
    member, its own DP store."""
    store, agents = pair()
    sentinel = agents[2].sentinel
    setattr(sentinel, sd.AGENT_ATTR, agents[2])  # as the patched __init__ leaves it
    timeout = timedelta(seconds=5)
    assert sd.keys_store(sentinel, [0, 1, 2], timeout) is store
    client = sd.keys_store(sentinel, [1, 2], timeout)
    client.set("ft_engine_dp_port_0", b"1234")
    assert agents[1].standby.server.get("ft_engine_dp_port_0") == b"1234"
    setattr(sentinel, STORE_RANK_ATTR, 1)  # after that rebuild: rank 1 hosts the store
    assert sd.keys_store(sentinel, [1, 2], timeout) is store


def test_a_standby_never_read_is_named() -> None:
    with pytest.raises(StandbyUnknown, match="DP rank 1 should host the DP store"):
        stand_in(2, [1, 2], {2: ("10.0.0.3", 4000)})
    assert stand_in(2, [2, 1], {1: ("10.0.0.2", 5000)}) == (1, ("10.0.0.2", 5000))


def bell(received: queue.Queue[Any]) -> WaveBell:
    found = WaveBell("127.0.0.1", received.put_nowait)
    found.start()
    return found


def test_a_ring_reaches_vllms_own_start_dp_wave_handling() -> None:
    """A ring arrives as vLLM's ``START_DP_WAVE`` with ``(wave, exclude)``; vLLM's own
    handler then starts an idle engine at that wave, ignores a stale one, and leaves the
    engine that rang alone."""
    received: queue.Queue[Any] = queue.Queue()
    listener, ringer = bell(received), bell(queue.Queue())
    try:
        ringer.ring([listener.address], 7, 1)
        kind, request = received.get(timeout=5)
    finally:
        listener.close()
        ringer.close()
    assert kind == import_start_wave() and request == (7, 1)
    handle = core.DPEngineCoreProc._handle_client_request

    def engine(index: int, wave: int) -> SimpleNamespace:
        return SimpleNamespace(
            engine_index=index, current_wave=wave, engines_running=False,
            ignore_start_dp_wave=False,
        )  # fmt: skip

    idle = engine(2, 7)
    handle(idle, kind, request)
    assert idle.engines_running and idle.current_wave == 7
    ahead = engine(2, 8)  # finished wave 7 already
    handle(ahead, kind, request)
    assert not ahead.engines_running
    ringer_itself = engine(1, 7)
    handle(ringer_itself, kind, request)
    assert not ringer_itself.engines_running


def test_decode_takes_only_a_wave_and_an_engine() -> None:
    assert decode(b"[3, 1]") == (3, 1)
    for raw in (b"", b"!", b"[3]", b'["3", 1]', b"[3, 1.5]", b"{}"):
        assert decode(raw) is None, raw


def listening(agents: dict[int, Any]) -> dict[int, queue.Queue[Any]]:
    """Each agent's wave bell delivering to a queue of its own (the test's input queue)."""
    found: dict[int, queue.Queue[Any]] = {}
    for rank, agent in agents.items():
        found[rank] = queue.Queue()
        agent.wave_bell._put = found[rank].put_nowait
    return found


def test_an_engine_rings_its_members_only_once_rank_0_is_removed() -> None:
    _, agents = pair(world=4)
    inboxes = listening(agents)
    agents[1].ring_wave(3, 1)  # rank 0 a member: its coordinator wakes the others
    time.sleep(0.3)
    assert all(box.empty() for box in inboxes.values())
    for agent in agents.values():
        setattr(agent.sentinel, sd.REMOVED_ATTR, frozenset({0, 3}))
    agents[1].ring_wave(4, 1)
    assert inboxes[2].get(timeout=5)[1] == (4, 1)
    time.sleep(0.3)
    assert inboxes[1].empty() and inboxes[3].empty()  # not itself, not the removed


def test_the_patched_add_request_rings_when_a_wave_begins_on_an_idle_engine() -> None:
    (patch,) = [p for p in ENGINE_CORE_PATCHES if p.name == "add_request"]
    rung: list[tuple[int, int]] = []
    agent = SimpleNamespace(ring_wave=lambda wave, exclude: rung.append((wave, exclude)))

    def add(self: Any, request: Any, request_wave: int = 0) -> None:
        self.engines_running = True  # vLLM's own path for a request of a finished wave

    add_request = patch.make(add)
    engine = SimpleNamespace(
        engines_running=False, current_wave=5, engine_index=2,
        ft_sentinel=SimpleNamespace(_ftengine_agent=agent),
    )  # fmt: skip
    add_request(engine, object(), 4)
    add_request(engine, object(), 5)  # running now: the wave has its members
    assert rung == [(5, 2)]


def test_a_call_on_a_store_that_stopped_answering_gives_up_at_its_bound() -> None:
    """A real TCPStore server SIGSTOPped (as one across a cut link: the connection open, no
    answer): torch's client waits in ``check`` for good whatever its timeout; the bounded
    store gives up after its bound, then fails at once."""
    server = subprocess.Popen(
        [sys.executable, "-c", STOPPED_SERVER], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        bounded = BoundedStore(connect(("127.0.0.1", port), 5.0), timeout_s=0.5)
        bounded.set("k", b"v")
        assert bounded.check(["k"]) and bounded.get("k") == b"v"
        os.kill(server.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(StoreStuck, match=r"check did not return within 0\.5 s"):
            bounded.check(["k"])
        assert time.monotonic() - started < 5.0
        started = time.monotonic()
        with pytest.raises(StoreStuck):
            bounded.multi_get(["k"])
        assert time.monotonic() - started < 0.1  # stuck: no second wait
    finally:
        server.kill()
        server.wait(timeout=10)


STOPPED_SERVER = """
import datetime, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))
print(store.port, flush=True)
time.sleep(600)
"""


def test_a_replaced_store_lets_its_thread_go() -> None:
    """Each rebuild replaces the DP store: the bounded view of the old one ends its thread
    (one idle thread per rebuild would pile up over a long run)."""
    _, agents = pair()
    agent = agents[1]
    old = agent._dp_store()
    agent.engine.dp_store = Store()  # a rebuild's new store
    assert agent._dp_store() is not old
    old._thread.join(timeout=5)
    assert not old._thread.is_alive()


class HangingStore(Store):
    """Rank 0's DP store across a cut: every call waits (until the test ends)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def check(self, keys: list[str]) -> bool:
        self.release.wait(60)
        return False

    def set(self, key: str, value: str) -> None:
        self.release.wait(60)


def test_a_board_call_across_a_cut_does_not_keep_the_board_from_moving() -> None:
    """Rank 0's store stops answering mid-call: the agent thread's call gives up at the
    bound instead of waiting for good, and once the probes take rank 0 for gone the board
    is on rank 1's standby store."""
    _, agents = pair()
    hanging = HangingStore()
    try:
        for agent in agents.values():
            agent.engine.dp_store = hanging
        started = time.monotonic()
        agents[2]._watch_peers()  # its publish waits in vain, for the bound only
        assert time.monotonic() - started < BOARD_TIMEOUT_S + 1.0
        assert agents[2]._store_failures == 1
        for agent in agents.values():
            agent.gone = frozenset({0})
            agent._watch_peers()
            agent._watch_peers()
        assert agents[1].standby.server.check([KEY.format(rank=1), KEY.format(rank=2)])
        assert agents[2].peers[1] == "healthy"
    finally:
        hanging.release.set()
