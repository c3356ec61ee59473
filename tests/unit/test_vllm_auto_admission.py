"""Admission without a command (issue 28, ``engine_core/announce.py`` and the policy's vote
in ``engine_core/admission.py``): the returning rank announces itself on the survivors'
store (found in rank 0's status), each survivor's policy decides, and the members admit
exactly the ranks every one of them votes for, at the same DP sync (a real two-member gloo
group); the announcer hands the busy loop the join once the survivors published it."""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from ftengine.integrations.vllm.engine_core import admission as adm
from ftengine.integrations.vllm.engine_core import announce
from ftengine.integrations.vllm.engine_core.scale_down import REMOVED_ATTR
from ftengine.integrations.vllm.messages import API_KEY_ENV
from ftengine.integrations.vllm.rejoin_flag import REJOIN_KEY
from ftengine.policies import AutoRecovery, OrchestratorDriven
from tests.vllm_support import free_port_run

utils = pytest.importorskip("vllm.distributed.utils", reason="vllm is not installed")
EngineStatusType = pytest.importorskip("vllm.v1.engine").EngineStatusType


def store_at(port: int) -> Any:
    """A DP store as vLLM's stateless rendezvous makes it (the lowest member hosts it)."""
    dist: Any = torch.distributed
    return dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=10),
    )  # fmt: skip


def survivor(store: Any, removed: set[int], status: str = "HEALTHY") -> Any:
    sentinel = SimpleNamespace(engine=SimpleNamespace(dp_store=store), engine_index=1)
    sentinel.status_type = EngineStatusType[status]
    setattr(sentinel, REMOVED_ATTR, frozenset(removed))
    return sentinel


def test_a_survivors_policy_admits_the_removed_ranks_that_joined_its_store() -> None:
    store = store_at(free_port_run(1))
    sentinel = survivor(store, {2, 3})
    auto, orchestrator = AutoRecovery(), OrchestratorDriven()
    assert adm.offer(sentinel, auto, 1, 4, store) == frozenset()  # nobody announced yet
    store.set(adm.join_key(3), b"1")
    assert adm.offer(sentinel, auto, 1, 4, store) == {3}  # rank 2 has not announced itself
    assert adm.offer(sentinel, orchestrator, 1, 4, store) == frozenset()  # waits for scale_up
    assert adm.offer(sentinel, AutoRecovery(admit_ready=False), 1, 4, store) == frozenset()
    assert adm.offer(survivor(store, {2, 3}, "UNHEALTHY"), auto, 1, 4, store) == frozenset()
    assert adm.offer(survivor(store, set()), auto, 1, 4, store) == frozenset()  # nothing removed


def member(rank: int, group: Any, admissible: set[int], world: int = 4) -> Any:
    """A survivor's engine core at the DP sync: its agent's vote, ``admit`` recorded."""
    parallel = SimpleNamespace(data_parallel_size=world, data_parallel_rank=rank)
    engine = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel), dp_group=group)
    sentinel = SimpleNamespace(engine=engine, engine_index=rank)
    setattr(sentinel, adm.AGENT_ATTR, SimpleNamespace(admissible=frozenset(admissible)))
    engine.ft_sentinel = sentinel
    return engine


def vote(votes: dict[int, set[int]], monkeypatch: pytest.MonkeyPatch) -> dict[int, Any]:
    """Each of two members (real gloo group) at the same DP sync: what each admitted and
    whether it keeps running."""
    port = free_port_run(1)
    admitted: dict[int, list[tuple[frozenset[int], str]]] = {0: [], 1: []}
    monkeypatch.setattr(
        adm, "admit",
        lambda s, a: admitted[s.engine_index].append((a.added, a.request_id)),
    )  # fmt: skip
    running: dict[int, bool] = {}

    def run(rank: int) -> None:
        group = utils.stateless_init_torch_distributed_process_group(
            "127.0.0.1", port, rank, 2, backend="gloo", timeout=timedelta(seconds=30)
        )
        try:
            running[rank] = adm.at_dp_sync(member(rank, group, votes[rank]), False)
        finally:
            utils.stateless_destroy_torch_distributed_process_group(group)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return {r: (admitted[r], running[r]) for r in (0, 1)}


def test_members_admit_exactly_what_every_one_votes_for(monkeypatch: pytest.MonkeyPatch) -> None:
    both = vote({0: {2, 3}, 1: {2}}, monkeypatch)
    for rank in (0, 1):
        ((added, request_id),), running = both[rank]
        assert added == {2} and running is True  # rank 3: not everyone's vote yet
        assert request_id.startswith(adm.POLICY_REQUEST)
    none = vote({0: {3}, 1: set()}, monkeypatch)
    assert none == {0: ([], True), 1: ([], True)}  # a member votes: all step to the next sync
    idle = vote({0: set(), 1: set()}, monkeypatch)
    assert idle == {0: ([], False), 1: ([], False)}  # nobody votes: idle engines stop


class RankZero:
    """DP rank 0's server as the announcer reads it: its engine's status with ``dp_store``."""

    def __init__(self, store: str) -> None:
        self.store, self.status = store, "healthy"
        self.auth: list[str | None] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/fault_tolerance/status"
        self.auth.append(request.headers.get("authorization"))
        engine = {"id": 0, "status": self.status, "dp_store": self.store}
        return httpx.Response(200, json={"engines": [engine]})


def returning(rank: int = 2) -> Any:
    parallel = SimpleNamespace(data_parallel_rank=rank, data_parallel_size=3)
    setattr(parallel, REJOIN_KEY, 1)
    engine = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel))
    engine.input_queue = queue.Queue()
    return SimpleNamespace(engine=engine, engine_index=rank)


def test_the_returning_rank_announces_on_the_current_store_and_joins_once_admitted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(API_KEY_ENV, "k1")
    first, second = free_port_run(1), free_port_run(1)
    lead = store_at(first)
    rank0 = RankZero(f"127.0.0.1:{first}")
    sentinel = returning()
    http = httpx.Client(transport=httpx.MockTransport(rank0.handle))
    announcer = announce.Announcer(sentinel, ["http://rank0:8000"], http=http)
    announcer.step()
    assert lead.check([adm.join_key(2)]) and rank0.auth == ["Bearer k1"]
    assert sentinel.engine.input_queue.empty()  # not admitted yet
    # The survivors recovered meanwhile: their new store gets the announcement too.
    moved = store_at(second)
    rank0.store = f"127.0.0.1:{second}"
    announcer.step()
    assert moved.check([adm.join_key(2)])
    rank0.status = "unhealthy"  # rank 0 recovering: no store to trust
    with pytest.raises(LookupError, match="no healthy engine's 'dp_store'"):
        announcer.step()
    rank0.status = "healthy"
    joined: list[Any] = []

    def join(s: Any, admission: Any) -> None:
        joined.append((admission.added, admission.store, admission.request_id))
        setattr(s.engine.vllm_config.parallel_config, REJOIN_KEY, 0)

    monkeypatch.setattr(adm, "join", join)
    moved.set(adm.admit_key(2), b"{}")  # the lowest survivor published the admission
    marker = sentinel.engine.input_queue
    busy_loop = threading.Thread(target=lambda: marker.get(timeout=10)[1].run())
    busy_loop.start()
    announcer.step()  # hands the join to the busy loop and waits for it
    busy_loop.join(10)
    ((added, store, request_id),) = joined
    assert added == {2} and store == ("127.0.0.1", second)
    assert request_id.startswith(adm.POLICY_REQUEST)
    assert getattr(sentinel, adm.ADMISSION_ATTR) is None and not announcer.waiting
