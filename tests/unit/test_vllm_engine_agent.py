"""The engine-core agent with a stand-in engine core and DP store: peer faults become a
fault of this engine (once, and never from a stale state), the policy's retry runs the
engine core's own retry once every peer is faulted and proposes it too."""

from __future__ import annotations

import json
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ftengine.backends.npu_config import NpuFtConfig
from ftengine.errors import PeerDead
from ftengine.faults import Fault, FaultKind
from ftengine.integrations.vllm.config import VllmFtSettings
from ftengine.integrations.vllm.engine_core import agent as engine_agent
from ftengine.integrations.vllm.engine_core.agent import FAULT_MARK, UTILS_MODULE, EngineCoreAgent
from ftengine.integrations.vllm.engine_core.dp_board import KEY
from ftengine.integrations.vllm.status_file import StatusFile

# Imported here, as in a real engine core: the agent's retry thread builds vLLM's request.
pytest.importorskip(UTILS_MODULE, reason="vllm is not installed")


Status = pytest.importorskip("vllm.v1.engine").EngineStatusType  # what the agent sets too


class Store:
    """vLLM's DP store (a TCPStore) as far as the agent uses it."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.broken = False

    def set(self, key: str, value: str) -> None:
        if self.broken:
            raise RuntimeError("Connection refused")
        self.data[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key].encode()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def peer(
        self,
        rank: int,
        status: str,
        beat: int = 1,
        epoch: int = 0,
        proposal: list[object] | None = None,
        blame: int | None = None,
    ) -> None:
        """Peer ``rank``'s entry as its agent publishes it (``proposal``: ``[instruction,
        removed ranks]``; ``blame``: the rank its fault points at)."""
        value = {"status": status, "beat": beat, "epoch": epoch}
        if proposal is not None or blame is not None:
            value |= {"proposal": proposal, "blame": blame}
        self.data[KEY.format(rank=rank)] = json.dumps(value)


class Sentinel:
    """vLLM's ``EngineCoreSentinel`` and its engine core, reduced to what the agent reads."""

    def __init__(self, rank: int = 0, world: int = 2) -> None:
        parallel = SimpleNamespace(data_parallel_rank=rank, data_parallel_size=world)
        self.engine = SimpleNamespace(
            vllm_config=SimpleNamespace(parallel_config=parallel),
            dp_store=Store(),
            input_queue=queue.Queue(),
            model_executor=SimpleNamespace(is_failed=False, collective_rpc=self.rpc),
        )
        self.status_type = Status.HEALTHY
        self.fault_info: str | None = None
        self._dp_reinit_epoch = 0
        self.retries: list[Any] = []
        self.scale_downs: list[Any] = []
        self.rpcs: list[tuple[Any, ...]] = []
        self.pushes = 0

    def rpc(self, method: Any, timeout: float, args: tuple[Any, ...]) -> None:
        self.rpcs.append((method, args))

    def retry(self, request: Any) -> None:
        self.retries.append(request)
        self._dp_reinit_epoch += 1
        self.status_type = Status.HEALTHY

    def scale_down(self, request: Any) -> SimpleNamespace:
        """ftengine's ``EngineCoreSentinel.scale_down``: its preconditions, then healthy."""
        from ftengine.integrations.vllm.engine_core.scale_down import REMOVED_ATTR, problems

        removed, found = problems(self, dict(request.params))
        if found:
            return SimpleNamespace(success=False, reason="; ".join(found))
        self.scale_downs.append(request)
        setattr(self, REMOVED_ATTR, removed)
        self._dp_reinit_epoch += 1
        self.status_type = Status.HEALTHY
        return SimpleNamespace(success=True, reason=None)

    def _push_status(self) -> None:
        self.pushes += 1


def agent_for(sentinel: Sentinel, policy: str = "orchestrator") -> EngineCoreAgent:
    settings = VllmFtSettings(enabled=True, npu=NpuFtConfig(policy=policy))
    agent = EngineCoreAgent(sentinel, settings)
    agent.status_file = StatusFile(Path(tempfile.mkdtemp()) / "status.json")  # not /tmp's
    return agent


def on_fault(agent: EngineCoreAgent, exc: BaseException) -> None:
    """What the patched ``on_fault`` runs around vLLM's own (busy-loop thread)."""
    agent.note_fault(exc)
    agent.after_fault()
    agent.release_commands()


def wait_until(done: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def markers(sentinel: Sentinel) -> list[Any]:
    found = []
    while not sentinel.engine.input_queue.empty():
        kind, marker = sentinel.engine.input_queue.get_nowait()
        assert kind == FAULT_MARK
        found.append(marker)
    return found


def test_an_unhealthy_peer_faults_a_healthy_engine_once() -> None:
    sentinel = Sentinel()
    agent = agent_for(sentinel)
    sentinel.engine.dp_store.peer(1, "dead")
    agent._watch_peers()
    agent._watch_peers()  # the same news twice: one marker
    (marker,) = markers(sentinel)
    assert json.loads(sentinel.engine.dp_store.data[KEY.format(rank=0)])["status"] == "healthy"
    with pytest.raises(PeerDead, match="engine 1 is dead"):
        marker.raise_pending()
    marker.raise_pending()  # raised once only


def test_a_marker_from_before_a_handled_fault_does_nothing() -> None:
    sentinel = Sentinel()
    agent = agent_for(sentinel)
    sentinel.engine.dp_store.peer(1, "unhealthy")
    agent._watch_peers()
    (marker,) = markers(sentinel)
    agent.note_fault(RuntimeError("Timed out waiting 5000ms for recv operation to complete"))
    assert sentinel.rpcs == []  # nothing may delay vLLM's own status push
    agent.after_fault()  # vLLM's on_fault ran: this engine is faulted already
    # the worker adopts it as the verdict names it: a peer's timeout while every peer still
    # beats is a transient fault (a retry can rebuild the groups)
    assert sentinel.rpcs and sentinel.rpcs[0][1] == ("transient",)
    marker.raise_pending()  # later, after a retry: stale, so nothing is raised


def test_a_peer_still_finishing_the_same_recovery_is_not_news() -> None:
    sentinel = Sentinel()
    agent = agent_for(sentinel)
    sentinel._dp_reinit_epoch = 1
    agent._was_healthy = False  # this engine has just come back
    sentinel.engine.dp_store.peer(1, "unhealthy", epoch=1)
    agent._watch_peers()
    assert markers(sentinel) == []
    sentinel.engine.dp_store.peer(1, "unhealthy", epoch=0)  # from before our recovery
    agent._healthy_since = time.monotonic() - 60
    agent._watch_peers()
    assert markers(sentinel) == []
    sentinel.engine.dp_store.peer(1, "unhealthy", beat=2, epoch=1)  # settled: real news
    agent._watch_peers()
    assert len(markers(sentinel)) == 1


def test_a_dp_store_that_stops_answering_is_a_fault_of_rank_0() -> None:
    sentinel = Sentinel(rank=1)
    agent = agent_for(sentinel)
    sentinel.engine.dp_store.broken = True
    for _ in range(engine_agent.STORE_FAILURES):
        agent._watch_peers()
    (marker,) = markers(sentinel)
    with pytest.raises(PeerDead, match="DP store"):
        marker.raise_pending()


def test_the_policy_sees_a_peer_side_error_among_live_peers_as_transient() -> None:
    agent = agent_for(Sentinel())
    fault = Fault(FaultKind.HUNG_PEER, info="RuntimeError", at=1.0)
    agent.peers = {1: "unhealthy"}
    assert agent.verdict(fault).kind is FaultKind.TRANSIENT
    agent.peers = {1: "dead"}
    dead = agent.verdict(fault)
    assert (dead.kind, dead.rank) == (FaultKind.DEAD_PEER, 1)


def tick(agent: EngineCoreAgent) -> None:
    """One peer watch and decision, then the publish of what it decided."""
    agent._watch_peers()
    agent._maybe_recover()
    agent._watch_peers()
    agent._maybe_recover()


def test_auto_retries_through_the_engine_core_once_every_peer_is_faulted() -> None:
    sentinel = Sentinel()
    store = sentinel.engine.dp_store
    agent = agent_for(sentinel, "auto")
    on_fault(agent, RuntimeError("Timed out waiting 5000ms for recv operation to complete"))
    sentinel.status_type = Status.UNHEALTHY
    store.peer(1, "healthy")
    tick(agent)
    assert sentinel.retries == []  # a healthy peer cannot join the DP group's rebuild
    store.peer(1, "unhealthy", beat=2)
    tick(agent)
    assert sentinel.retries == []  # it has not proposed the retry (yet)
    assert json.loads(store.data[KEY.format(rank=0)])["proposal"] == ["retry", [], 0]
    store.peer(1, "unhealthy", beat=3, proposal=["retry", [], 0])
    tick(agent)
    wait_until(lambda: bool(sentinel.retries))
    (request,) = sentinel.retries
    assert request.instruction == "retry" and request.request_id.startswith("ftengine-auto-")


def test_the_orchestrator_policy_never_retries_by_itself() -> None:
    sentinel = Sentinel()
    agent = agent_for(sentinel)
    on_fault(agent, RuntimeError("boom"))
    sentinel.status_type = Status.UNHEALTHY
    agent.peers = {1: "unhealthy"}
    agent._maybe_recover()
    time.sleep(0.05)
    assert sentinel.retries == []


def test_a_command_waits_while_on_fault_runs_even_without_an_early_report() -> None:
    """vLLM's executor hands ``collective_rpc`` answers out in the order it reads them, not
    per caller: a retry on the input thread beside the busy loop's ``after_fault`` call
    could take that call's answer and report HEALTHY before the worker ran it."""
    sentinel = Sentinel()
    agent = agent_for(sentinel)
    agent.note_fault(RuntimeError("[FT] fault injected on DP rank 0"))
    sentinel.status_type = Status.UNHEALTHY  # vLLM's on_fault: an orchestrator may act now
    waiter = threading.Thread(target=agent.await_fault)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "the command did not wait for on_fault"
    agent.after_fault()  # the worker call a command must not run beside
    waiter.join(0.3)
    assert waiter.is_alive(), "released before on_fault's last status push"
    agent.release_commands()
    waiter.join(5.0)
    assert not waiter.is_alive()


def test_the_agents_own_recovery_waits_for_on_fault() -> None:
    sentinel = Sentinel()
    store = sentinel.engine.dp_store
    agent = agent_for(sentinel, "auto")
    agent.note_fault(RuntimeError("Timed out waiting 5000ms for recv operation to complete"))
    sentinel.status_type = Status.UNHEALTHY
    store.peer(1, "unhealthy", beat=3, proposal=["retry", [], 0])
    tick(agent)
    tick(agent)
    time.sleep(0.05)
    assert sentinel.retries == [] and agent.proposal is None  # on_fault still runs
    agent.after_fault()
    agent.release_commands()
    store.peer(1, "unhealthy", beat=4, proposal=["retry", [], 0])
    tick(agent)
    wait_until(lambda: bool(sentinel.retries))
