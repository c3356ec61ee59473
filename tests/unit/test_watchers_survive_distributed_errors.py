"""The second seed's review point: fault-watching threads survive distributed errors. The
engine-core agent's watch thread (a real thread, started as vLLM's engine core starts it)
meets torch's distributed errors in its own steps (the DP group refusing its timeout, the DP
store failing) and keeps watching: it retries what failed, and the store's failures still
end as a fault it hands to the busy loop."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch.distributed as dist

from ftengine.backends.npu_config import NpuFtConfig
from ftengine.errors import PeerDead
from ftengine.integrations.vllm.config import VllmFtSettings
from ftengine.integrations.vllm.engine_core import agent as engine_agent
from tests.unit.test_vllm_engine_agent import Sentinel, markers

pytest.importorskip(engine_agent.UTILS_MODULE, reason="vllm is not installed")


class FlakyGroup:
    """A DP group whose ``set_timeout`` raises torch's backend error the first times."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0
        self.timeout: Any = None

    def set_timeout(self, timeout: Any) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise dist.DistBackendError(f"gloo: connection reset (call {self.calls})")
        self.timeout = timeout


class FailingStore:
    """The DP store once its host died: every call is torch's store error."""

    def set(self, key: str, value: str) -> None:
        raise dist.DistStoreError(f"failed to set {key}: Connection reset by peer")

    def check(self, keys: list[str]) -> bool:
        raise dist.DistStoreError("check: Connection reset by peer")

    def multi_get(self, keys: list[str]) -> list[bytes]:
        raise dist.DistStoreError("multi_get: Connection reset by peer")


def wait_until(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the watch thread stopped acting"
        time.sleep(engine_agent.BEAT_S)


def test_the_agents_watch_thread_outlives_distributed_errors_and_still_faults() -> None:
    sentinel = Sentinel(rank=1)
    group = FlakyGroup(failures=3)
    sentinel.engine.dp_group = group
    sentinel.engine.dp_store = FailingStore()
    settings = VllmFtSettings(enabled=True, npu=NpuFtConfig(cpu_distributed_timeout_s=5.0))
    agent = engine_agent.EngineCoreAgent(sentinel, settings)
    agent.start()
    try:
        # Three beats' steps raised DistBackendError; the fourth sets the timeout.
        wait_until(lambda: group.timeout is not None)
        assert group.calls == 4 and agent.thread.is_alive()
        # Every beat's store call raised DistStoreError: after STORE_FAILURES of them the
        # agent faults its engine (as a fault of rank 0, the store's host).
        wait_until(lambda: not sentinel.engine.input_queue.empty())
        (marker,) = markers(sentinel)
        with pytest.raises(PeerDead, match="DP store"):
            marker.raise_pending()
        beats = agent._store_failures
        wait_until(lambda: agent._store_failures > beats)  # and it goes on watching
        assert agent.thread.is_alive()
    finally:
        agent.stop()
        agent.thread.join(5.0)
    assert not agent.thread.is_alive()


def test_the_stand_ins_raise_what_torch_raises() -> None:
    """torch's distributed errors are RuntimeErrors (what the agent's step guard catches),
    not BaseExceptions that would slip past it."""
    for error in (dist.DistBackendError, dist.DistStoreError, dist.DistNetworkError):
        assert issubclass(error, RuntimeError)


def test_a_recovery_that_finishes_mid_beat_does_not_take_a_peer_still_finishing_it_for_news() -> (
    None
):
    """The race seen in a real DP=2 retry: a beat begins while this engine is still
    UNHEALTHY, its retry finishes during the beat's store calls, and the peer (same epoch,
    finishing the same retry) still reads ``unhealthy``: that is not a new fault."""
    sentinel = Sentinel(rank=1)
    agent = engine_agent.EngineCoreAgent(sentinel, VllmFtSettings(enabled=True, npu=NpuFtConfig()))
    store = sentinel.engine.dp_store
    agent._watch_peers()  # healthy, long ago (the settle clock starts here)
    agent._healthy_since -= 10 * engine_agent.SETTLE_S
    sentinel.status_type = type(sentinel.status_type).UNHEALTHY
    sentinel._dp_reinit_epoch = 1  # vLLM's retry counts its epoch first
    agent._watch_peers()  # a beat while faulted
    store.peer(0, "unhealthy", beat=2, epoch=1)
    recovered = store.multi_get

    def read_then_recover(keys: list[str]) -> list[bytes]:
        sentinel.status_type = type(sentinel.status_type).HEALTHY  # the retry ends mid-beat
        values: list[bytes] = recovered(keys)
        return values

    store.multi_get = read_then_recover
    agent._watch_peers()
    assert store.multi_get is read_then_recover and sentinel.status_type.name == "HEALTHY"
    assert markers(sentinel) == []
    store.multi_get = recovered
    agent._watch_peers()  # the next beat starts the settle clock: still not news
    assert markers(sentinel) == []
