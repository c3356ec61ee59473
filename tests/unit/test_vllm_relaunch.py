"""DP rank 0 relaunches its dead worker in place (issue 28, ``engine_core/relaunch.py``): a
new executor of the dead one's class, KV caches of the scheduler's size, the prefix cache
emptied, then a returning rank (a DP group of its own, no store, no wave to lead, the agent's
peers forgotten, stale failure notices dropped and queued requests ended with the reason)
whose busy loop resumes and which announces itself to the survivors it last read; a failure
leaves it parked DEAD, saying why. The real thing in real vLLM:
``tests/integration/test_vllm_rejoin.py``."""

from __future__ import annotations

import inspect
import queue
import threading
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from ftengine.integrations.vllm.engine_core import admission as adm
from ftengine.integrations.vllm.engine_core import relaunch as rl
from ftengine.integrations.vllm.engine_core import relaunch_state as state
from ftengine.integrations.vllm.engine_core.parking import ParkableEvent
from ftengine.integrations.vllm.engine_core.scale_down import REMOVED_ATTR, STORE_ATTR
from ftengine.integrations.vllm.rejoin_flag import REJOIN_KEY, rejoining
from tests.unit.test_vllm_engine_agent import Sentinel, agent_for

engine_types = pytest.importorskip("vllm.v1.engine")
multiproc = pytest.importorskip("vllm.v1.executor.multiproc_executor")
Status = engine_types.EngineStatusType
RequestType = engine_types.EngineCoreRequestType
BLOCKS = 64


class Executor:
    """vLLM's ``MultiprocExecutor`` as a relaunch drives it (its constructor's parameters
    are checked against the real one's below)."""

    made: ClassVar[list[Executor]] = []

    def __init__(self, vllm_config: Any, monitor_workers: bool = True) -> None:
        self.vllm_config = vllm_config
        self.is_failed = False
        self.workers: list[Any] = []
        self.callbacks: list[Any] = []
        self.stopped = False
        Executor.made.append(self)

    def register_failure_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def shutdown(self) -> None:
        self.stopped = True


class Scheduler:
    def __init__(self) -> None:
        self.kv_cache_config = SimpleNamespace(num_blocks=BLOCKS)
        self.resets = 0

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        self.resets += 1
        return True


def test_the_fake_executor_takes_what_vllms_takes() -> None:
    real = inspect.signature(multiproc.MultiprocExecutor.__init__).parameters
    assert list(inspect.signature(Executor.__init__).parameters) == list(real)
    rl.check_seams()  # every vLLM name the relaunch uses, in the installed vLLM


def test_vllms_cache_config_has_the_override_the_relaunch_sets() -> None:
    config = pytest.importorskip("vllm.config")
    import dataclasses

    names = {f.name for f in dataclasses.fields(config.CacheConfig)}
    assert {"num_gpu_blocks_override", "num_gpu_blocks"} <= names


def parked_rank0(blocks: int = BLOCKS + 4) -> tuple[Any, Any]:
    """Rank 0's engine core as the patched ``on_fault`` leaves it once its worker died:
    DEAD, parked (no recovery deadline), the DP group closed, the peers known."""
    sentinel: Any = Sentinel(rank=0, world=3)
    engine = sentinel.engine
    parallel = engine.vllm_config.parallel_config
    parallel.cpu_distributed_timeout = None
    parallel.fault_tolerance_config = SimpleNamespace(engine_recovery_timeout_sec=90)
    engine.ft_sentinel = sentinel
    engine.vllm_config.cache_config = SimpleNamespace(
        num_gpu_blocks=BLOCKS, num_gpu_blocks_override=None
    )
    engine.model_executor = Executor(engine.vllm_config)
    engine.model_executor.is_failed = True  # its worker died: vLLM's monitor said so
    engine.scheduler = Scheduler()
    engine._initialize_kv_caches = lambda config: SimpleNamespace(  # vLLM's override rule
        num_blocks=config.cache_config.num_gpu_blocks_override or blocks
    )
    engine.dp_rank, engine.dp_group, engine.step_counter, engine.engines_running = 0, None, 7, True
    sentinel.engine_index = 0
    sentinel.status_type = Status.DEAD
    sentinel.fault_info = "RuntimeError"
    sentinel.resumed = ParkableEvent()
    sentinel.resumed.park()  # (coordinator_host.py)
    setattr(sentinel, STORE_ATTR, ("127.0.0.1", 1234))
    agent = agent_for(sentinel, "auto")
    setattr(sentinel, adm.AGENT_ATTR, agent)
    agent.board.api_urls.update({1: "http://rank1:8001", 2: "http://rank2:8002"})
    agent.peers.update({1: "dead", 2: "healthy"})
    agent._dying = True
    return sentinel, agent


def test_a_relaunch_makes_rank_0_a_returning_rank_and_resumes_its_busy_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sentinel, agent = parked_rank0()
    engine = sentinel.engine
    announced: list[tuple[Any, ...]] = []
    ended: list[tuple[str, str]] = []
    monkeypatch.setattr(
        "ftengine.integrations.vllm.engine_core.announce.start_announcing",
        lambda s, urls=(): announced.append(tuple(urls)),
    )
    monkeypatch.setattr(
        "ftengine.integrations.vllm.engine_core.handoff.emit",
        lambda e, request, tokens, finish, reason: ended.append((request, reason)),
    )
    dead = engine.model_executor
    engine.input_queue.put_nowait((RequestType.EXECUTOR_FAILED, b""))
    engine.input_queue.put_nowait((RequestType.ADD, ("late-request", 0)))
    engine.input_queue.put_nowait((RequestType.UTILITY, "status"))
    assert rl.start_relaunch(sentinel) is not None
    assert sentinel.resumed.wait(10)
    new = engine.model_executor
    assert (
        type(new) is Executor and new is not dead and new.callbacks
    )  # its failure reaches the queue
    assert rejoining(engine.vllm_config.parallel_config) and engine.scheduler.resets == 1
    assert engine.vllm_config.cache_config.num_gpu_blocks == BLOCKS  # the scheduler's count
    assert engine.dp_store is None and engine.dp_group is not None
    assert engine.dp_rank == 3 and engine.step_counter == 0 and not engine.engines_running
    assert sentinel.status_type == Status.HEALTHY and sentinel.fault_info is None
    assert getattr(sentinel, STORE_ATTR) is None and getattr(sentinel, REMOVED_ATTR) == set()
    assert not sentinel.resumed.parked  # its next fault has vLLM's deadline again
    assert announced == [("http://rank1:8001", "http://rank2:8002")]
    assert agent.peers == {} and not agent._dying and agent.board.api_urls == {}
    assert [r for r, _ in ended] == ["late-request"] and "rejoining" in ended[0][1]
    assert list(engine.input_queue.queue) == [(RequestType.UTILITY, "status")]
    fields = agent.status_fields()
    assert (fields["status"], fields["phase"]) == ("unhealthy", "ready")
    assert "dp_store" not in fields


def test_a_relaunch_sizes_exactly_the_schedulers_blocks_whatever_memory_it_measures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seen in the 60-fault campaign on hosts: the relaunched worker measured one block
    fewer than the scheduler's 6867 and the relaunch failed. vLLM's override sizes it."""
    sentinel, _ = parked_rank0(blocks=BLOCKS - 1)
    engine = sentinel.engine
    sized: list[object] = []
    measure = engine._initialize_kv_caches

    def sizing(config: Any) -> Any:
        sized.append(config.cache_config.num_gpu_blocks_override)
        return measure(config)

    engine._initialize_kv_caches = sizing
    engine.vllm_config.cache_config.num_gpu_blocks_override = None
    rl.start_worker(engine, Executor)
    assert sized == [BLOCKS]  # the scheduler's count, while they were sized
    assert engine.vllm_config.cache_config.num_gpu_blocks_override is None  # put back
    assert engine.vllm_config.cache_config.num_gpu_blocks == BLOCKS


def test_a_relaunch_whose_kv_cache_differs_leaves_rank_0_parked_dead_saying_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A vLLM that ignored the override (its seam moved) and measured fewer blocks: the
    relaunch fails saying so, rank 0 stays parked."""
    sentinel, agent = parked_rank0(blocks=BLOCKS // 2)
    engine = sentinel.engine
    engine._initialize_kv_caches = lambda config: SimpleNamespace(num_blocks=BLOCKS // 2)
    dead = engine.model_executor
    monkeypatch.setattr(rl, "start_alone", lambda *a: pytest.fail("must not start alone"))
    assert not rl.relaunch(sentinel, "engine 0's worker process died")
    new = Executor.made[-1]
    assert engine.model_executor is dead and new.stopped
    assert not rejoining(engine.vllm_config.parallel_config)
    assert sentinel.status_type == Status.DEAD and not sentinel.resumed.is_set()
    fields = agent.status_fields()
    assert fields["status"] == "dead" and fields["phase"] == "dead"
    assert "32 KV cache blocks, fewer than the 64 the scheduler" in str(fields["fault_info"])
    assert "engine 0's worker process died and relaunching it failed" in str(fields["fault_info"])
    assert not dead.stopped  # a dead worker's executor is vLLM's to shut down


def test_scale_up_is_refused_while_rank_0_loads_and_the_status_says_loading() -> None:
    sentinel, agent = parked_rank0()
    setattr(sentinel, state.RELAUNCH_ATTR, state.Relaunch(state.LOADING, "relaunching its worker"))
    setattr(sentinel.engine.vllm_config.parallel_config, REJOIN_KEY, 1)
    admission, found = adm.problems(sentinel, {"added_dp_ranks": [0], "dp_store": "h:1"})
    assert admission is None
    assert found == [
        "engine 0 is dead (phase loading): relaunching its worker; send scale_up once its "
        "status shows phase ready"
    ]
    fields = agent.status_fields()
    assert (fields["status"], fields["phase"]) == ("dead", "loading")


def test_only_a_dead_worker_is_relaunched() -> None:
    sentinel, _ = parked_rank0()
    sentinel.engine.model_executor = SimpleNamespace(is_failed=False)  # policy gave up: alive
    assert rl.start_relaunch(sentinel) is None
    assert getattr(sentinel, state.RELAUNCH_ATTR, None) is None
    no_agent, _ = parked_rank0()
    setattr(no_agent, adm.AGENT_ATTR, None)
    assert rl.start_relaunch(no_agent) is None


def test_retry_and_scale_down_to_a_rank_that_rejoins_are_refused_saying_so() -> None:
    """vLLM would judge them on DEAD (loading) or HEALTHY (ready), which say neither."""
    sentinel, _ = parked_rank0()
    sentinel.engine.output_queue = queue.Queue()
    body = {"instruction": "retry", "params": {}, "request_id": "r1"}
    assert not adm.refuse_while_rejoining(sentinel, 0, 5, body)  # parked DEAD: vLLM's words
    setattr(sentinel, state.RELAUNCH_ATTR, state.Relaunch(state.LOADING, "relaunching"))
    assert adm.refuse_while_rejoining(sentinel, 0, 5, body)
    client, outputs = sentinel.engine.output_queue.get_nowait()
    result = outputs.utility_output.result.result
    assert (client, result["request_id"], result["success"]) == (0, "r1", False)
    assert "Rejecting retry on engine 0: it is rejoining (phase loading)" in result["reason"]


def test_a_minority_relaunch_shuts_its_live_worker_down_first_and_ends_the_partition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A partition's minority (``minority.py``) relaunches a worker that is alive: it
    belongs to the DP and EP groups the majority rebuilt without it, so it is shut down
    (vLLM's ``MultiprocExecutor.shutdown``) before the new one starts; the returning rank
    is no longer cut off and stops refusing late arrivals."""
    sentinel, agent = parked_rank0()
    engine = sentinel.engine
    monkeypatch.setattr(
        "ftengine.integrations.vllm.engine_core.announce.start_announcing", lambda s, urls=(): None
    )
    old = engine.model_executor
    old.is_failed = False  # cut off, alive
    agent._dying = False
    agent.fenced, agent.cut_off = "network partition: ...", "rejoining"
    agent._refusing = threading.Event()
    assert rl.relaunch(sentinel, "engine 0 was cut off by a network partition")
    assert old.stopped and engine.model_executor is not old and sentinel.resumed.is_set()
    assert agent.fenced is None and agent.cut_off is None and agent._refusing.is_set()
    assert sentinel.status_type == Status.HEALTHY  # a returning rank: unhealthy, ready
    assert agent.status_fields()["phase"] == "ready"
