"""``scale_up`` through vLLM's own path, piece by piece (``engine_core/admission.py``): the
router's shape check, the orchestrator's bodies, a survivor's refusals, the admission at
vLLM's DP-state sync (a real gloo group) relayed to a worker's FSM, the returning rank's
join on a real TCPStore, and the experts a survivor took for the returning rank unrouted,
kept, and routed again by the next scale-down without growing the layer."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ftengine.errors import CommandRejected
from ftengine.integrations.vllm.engine_core import admission as adm
from ftengine.integrations.vllm.engine_core import reinference
from ftengine.integrations.vllm.engine_core import scale_down as sd
from ftengine.integrations.vllm.messages import DP_PORTS_KEY
from ftengine.integrations.vllm.patches.api_server import SCALE_DOWN_PATCHES
from ftengine.integrations.vllm.patches.engine_core import ENGINE_CORE_PATCHES
from ftengine.integrations.vllm.rejoin_flag import REJOIN_KEY
from ftengine.integrations.vllm.scale_up_bodies import scale_up_bodies
from ftengine.integrations.vllm.worker.experts_rehost import CpuExpertRehoster
from ftengine.weights.index import CheckpointIndex
from tests.unit.test_vllm_plugin import answer
from tests.unit.test_vllm_scale_down import Layer, command, scale_down_core
from tests.vllm_support import free_port_run, write_tiny_qwen3_moe

utils = pytest.importorskip("vllm.distributed.utils", reason="vllm is not installed")
router = pytest.importorskip("vllm.entrypoints.serve.fault_tolerance.api_router")
EngineStatusType = pytest.importorskip("vllm.v1.engine").EngineStatusType
HTTPException = pytest.importorskip("fastapi").HTTPException


def test_the_router_takes_scale_up_and_answers_a_malformed_one_with_400(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(router, "_validate_payload", router._validate_payload)
    (patch,) = SCALE_DOWN_PATCHES
    validate = patch.make(patch.target()[1])
    survivor = {"added_dp_ranks": [2]}
    returning = {"added_dp_ranks": [2], "dp_store": "10.0.0.3:41234"}
    assert validate({"instruction": "scale_up", "params": survivor}) == ("scale_up", survivor)
    assert validate({"instruction": "scale_up", "params": returning}) == ("scale_up", returning)
    for bad, why in (
        ({}, "added_dp_ranks"),
        ({"added_dp_ranks": "2"}, "added_dp_ranks"),
        ({"added_dp_ranks": [2], "dp_store": "nohost"}, "host:port"),
        ({"added_dp_ranks": [2], "dp_store": "h:99999"}, "host:port"),
        ({"added_dp_ranks": [2], "extra": 1}, "scale_up takes params"),
    ):
        with pytest.raises(HTTPException, match=why) as refused:
            validate({"instruction": "scale_up", "params": bad})
        assert refused.value.status_code == 400


def test_the_orchestrators_bodies_carry_the_survivors_dp_store() -> None:
    status = {"engines": [{"id": 0, "status": "healthy", "dp_store": "127.0.0.1:5000"}]}
    survivor, returning = scale_up_bodies([2], status)
    assert survivor == {"instruction": "scale_up", "params": {"added_dp_ranks": [2]}}
    assert returning["params"] == {"added_dp_ranks": [2], "dp_store": "127.0.0.1:5000"}
    with pytest.raises(CommandRejected, match="names no 'dp_store'"):
        scale_up_bodies([2], {"engines": [{"id": 0, "status": "healthy"}]})


@pytest.fixture
def solo_group() -> Iterator[Any]:
    group = utils.stateless_init_torch_distributed_process_group(
        "127.0.0.1", free_port_run(1), 0, 1, backend="gloo", timeout=timedelta(seconds=30)
    )
    yield group
    utils.stateless_destroy_torch_distributed_process_group(group)


class JoinKeys:
    """The survivors' DP store as a survivor reads it: has every returning rank joined?"""

    def __init__(self) -> None:
        self.joined = False
        self.values: dict[str, bytes] = {}

    def check(self, keys: list[str]) -> bool:
        return self.joined and all(k.startswith("ft_join_") for k in keys)

    def set(self, key: str, value: bytes) -> None:
        self.values[key] = value


def survivor(monkeypatch: pytest.MonkeyPatch, solo_group: Any) -> tuple[Any, Any, Any]:
    """DP rank 1 of 4 after scaling down rank 3, with a DP group of one (its all-reduce is
    real) and the rebuild recorded."""
    core, standin, worker = scale_down_core(monkeypatch)
    engine: Any = standin
    core.on_fault(RuntimeError("peer died"))
    command(core, {"removed_dp_ranks": [3]})
    assert answer(engine)["success"] is True
    engine.ft_sentinel, engine.dp_group, engine.dp_store = core, solo_group, JoinKeys()
    engine.input_queue = queue.Queue()
    engine.engines_running, engine.current_wave = False, 7
    setattr(core, sd.STORE_ATTR, ("127.0.0.1", 5000))
    rebuilt: list[tuple[list[int], int | None]] = []

    def reinit(sentinel: Any, alive: list[int], *, publisher: int | None = None) -> dict[str, Any]:
        rebuilt.append((alive, publisher))
        return {DP_PORTS_KEY: [29501]}

    monkeypatch.setattr(adm, "reinit_dp_group", reinit)
    engine.rebuilt = rebuilt
    return core, engine, worker


def scale_up(core: Any, params: dict[str, Any], request_id: str = "u1") -> threading.Thread:
    body = {"instruction": "scale_up", "params": params, "request_id": request_id}
    thread = threading.Thread(target=adm.handle_scale_up, args=(core, 0, 11, body), daemon=True)
    thread.start()
    return thread


def answered(engine: Any, timeout_s: float = 10.0) -> dict[str, Any]:
    """The next FaultToleranceResult queued for the client (an admission answers from a
    thread of its own, once it ends)."""
    while True:  # status pushes come between
        _, outputs = engine.output_queue.get(timeout=timeout_s)
        utility = outputs.utility_output
        if utility is not None and utility.call_id == 11:
            result: dict[str, Any] = utility.result.result
            return result


def test_a_survivor_refuses_what_it_cannot_admit_saying_why(
    monkeypatch: pytest.MonkeyPatch, solo_group: Any
) -> None:
    core, engine, _ = survivor(monkeypatch, solo_group)
    for params, why in (
        ({"added_dp_ranks": [2]}, "ranks [2] are not removed (removed: [3])"),
        ({"added_dp_ranks": [9]}, "not DP ranks 0..3"),
        ({"added_dp_ranks": []}, "is empty"),
        ({"added_dp_ranks": [3], "epoch": 7}, "epoch 7 is not this engine's epoch"),
        ({"added_dp_ranks": "3"}, "added_dp_ranks"),
    ):
        scale_up(core, params).join(10)
        result = answered(engine)
        assert result["success"] is False and why in result["reason"], (params, result)
        assert "Rejecting scale_up on engine 1" in result["reason"]
    core.status_type = EngineStatusType.UNHEALTHY
    scale_up(core, {"added_dp_ranks": [3]}).join(10)
    assert "status is UNHEALTHY; a survivor admits while HEALTHY" in answered(engine)["reason"]
    assert engine.input_queue.empty()  # nothing reached the busy loop


def test_survivors_admit_at_the_dp_sync_once_the_returning_rank_joined(
    monkeypatch: pytest.MonkeyPatch, solo_group: Any
) -> None:
    core, engine, worker = survivor(monkeypatch, solo_group)
    thread = scale_up(core, {"added_dp_ranks": [3]})
    thread.join(10)  # vLLM's input thread is free again at once: requests keep coming in
    assert not thread.is_alive()
    with pytest.raises(queue.Empty):  # answered at the end
        answered(engine, timeout_s=0.2)
    mark, marker = engine.input_queue.get(timeout=10)
    assert mark == adm.ADMIT_MARK
    marker.run()  # the busy loop, between two steps
    assert engine.engines_running is True  # it steps (dummy batches when idle) until agreed
    # A sync before rank 3 wrote its join key: no admission, and an idle engine stops.
    assert adm.at_dp_sync(engine, False) is False and engine.rebuilt == []
    engine.dp_store.joined = True
    engine.step_counter = 16
    assert adm.at_dp_sync(engine, False) is True  # every member agreed: admitted here
    assert answered(engine) == {"request_id": "u1", "success": True, "reason": None}
    assert engine.rebuilt == [([0, 1, 2, 3], 0)]  # with rank 3, ports from the lowest survivor
    assert getattr(core, sd.REMOVED_ATTR) == frozenset() and engine.step_counter == 0
    assert engine.dp_rank == 1  # dense rank among all four again
    status = worker.worker_sentinel.ft.commands.status()
    assert (status["removed_ranks"], status["phase"]) == ([], "healthy")
    assert core.status_type == EngineStatusType.HEALTHY  # it never faulted
    assert engine.dp_store.values == {}  # only the lowest survivor (rank 0) publishes facts


def test_an_admission_nobody_completes_ends_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, solo_group: Any
) -> None:
    core, engine, _ = survivor(monkeypatch, solo_group)
    monkeypatch.setattr(adm, "_wait_s", lambda sentinel: 0.2)
    scale_up(core, {"added_dp_ranks": [3]}).join(10)
    result = answered(engine)
    assert result["success"] is False and "did not start within" in result["reason"]
    assert getattr(core, adm.ADMISSION_ATTR) is None
    assert adm.at_dp_sync(engine, False) is False and engine.rebuilt == []  # cancelled


def test_the_same_command_again_replaces_a_pending_admission_another_is_refused(
    monkeypatch: pytest.MonkeyPatch, solo_group: Any
) -> None:
    """An orchestrator that re-sends ``scale_up`` (the survivors' store changed, so the
    returning rank needs the new one) replaces the admission that has not started; one that
    names other ranks waits for the first."""
    core, engine, _ = survivor(monkeypatch, solo_group)
    scale_up(core, {"added_dp_ranks": [3]}).join(10)
    first = getattr(core, adm.ADMISSION_ATTR)
    scale_up(core, {"added_dp_ranks": [3]}, request_id="u2").join(10)
    replaced = answered(engine)
    assert replaced["request_id"] == "u1" and replaced["success"] is False
    assert "replaced by scale_up request u2" in replaced["reason"]
    second = getattr(core, adm.ADMISSION_ATTR)
    assert second is not first and second.request_id == "u2"
    setattr(core, sd.REMOVED_ATTR, frozenset({2, 3}))
    scale_up(core, {"added_dp_ranks": [2]}, request_id="u3").join(10)
    other = answered(engine)
    assert other["request_id"] == "u3" and "already admitting ranks [3]" in other["reason"]
    setattr(core, sd.REMOVED_ATTR, frozenset({3}))
    engine.dp_store.joined = True
    assert adm.at_dp_sync(engine, False) is True
    assert answered(engine) == {"request_id": "u2", "success": True, "reason": None}
    assert engine.rebuilt == [([0, 1, 2, 3], 0)]  # admitted once


def test_a_returning_rank_told_to_join_with_others_takes_over_its_announcers_join() -> None:
    """The campaign's race: the returning rank's announcer saw its admission key and started
    its own join when the orchestrator's ``scale_up`` naming it and another rank arrived;
    refused ("already admitting"), the orchestrator re-sent against survivors that had
    admitted both meanwhile. The command now replaces the join not started (or answers with
    the one under way)."""
    parallel = SimpleNamespace(data_parallel_rank=2, data_parallel_size=3)
    setattr(parallel, REJOIN_KEY, 1)
    engine = SimpleNamespace(
        vllm_config=SimpleNamespace(parallel_config=parallel),
        input_queue=queue.Queue(), output_queue=queue.Queue(),
    )  # fmt: skip
    sentinel = SimpleNamespace(engine=engine, engine_index=2, status_type=EngineStatusType.HEALTHY)
    own = adm.Admission(frozenset({2}), adm.policy_request_id(), ("127.0.0.1", 1))
    setattr(sentinel, adm.ADMISSION_ATTR, own)
    params = {"added_dp_ranks": [1, 2], "dp_store": "127.0.0.1:2"}
    adm.handle_scale_up(sentinel, 0, 7, {"instruction": "scale_up", "params": params,
                                         "request_id": "u9"})  # fmt: skip
    with pytest.raises(adm.NotAdmitted, match="replaced by scale_up request u9"):
        own.done.result(timeout=5)
    taken = getattr(sentinel, adm.ADMISSION_ATTR)
    assert (taken.added, taken.store, taken.request_id) == ({1, 2}, ("127.0.0.1", 2), "u9")
    assert engine.input_queue.get_nowait()[0] == adm.ADMIT_MARK  # the busy loop joins


def test_a_fault_before_the_admission_ends_it_saying_to_send_it_again(
    monkeypatch: pytest.MonkeyPatch, solo_group: Any
) -> None:
    """A survivor that faults while its admission waits (its recovery rebuilds the group at a
    new store) answers at once instead of at the deadline."""
    core, engine, _ = survivor(monkeypatch, solo_group)
    scale_up(core, {"added_dp_ranks": [3]}).join(10)
    (patch,) = [p for p in ENGINE_CORE_PATCHES if p.name == "on_fault"]
    # vLLM's own fault path after ftengine's (re-inference needs a real scheduler)
    monkeypatch.setattr(reinference, "hold_or_abort", lambda s, exc, vllms, peers: vllms(s, exc))
    patch.make(type(core).on_fault)(core, RuntimeError("op timed out"))  # ftengine's on_fault
    result = answered(engine)
    assert result["success"] is False and "faulted before the admission started" in result["reason"]
    assert "send scale_up again" in result["reason"]
    assert getattr(core, adm.ADMISSION_ATTR) is None
    assert adm.at_dp_sync(engine, False) is False and engine.rebuilt == []


def test_the_returning_rank_joins_through_the_survivors_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port_run(1)
    # The lowest survivor's group and store, as vLLM's stateless rendezvous hands them back.
    group, lead = utils.stateless_init_torch_distributed_process_group(
        "127.0.0.1", port, 0, 1, backend="gloo", return_store=True,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    facts = {"epoch": 4, "removed_dp_ranks": [3], "worker_epoch": 2, "wave": 9}
    lead.set(adm.admit_key(3), json.dumps(facts).encode())
    parallel = type("Parallel", (), {})()
    parallel.data_parallel_rank, parallel.data_parallel_size = 3, 4
    parallel.cpu_distributed_timeout = timedelta(seconds=10)
    setattr(parallel, REJOIN_KEY, 1)
    relayed: list[Any] = []
    executor = type("Executor", (), {"collective_rpc": lambda s, m, args: relayed.append(args)})
    engine = type("Engine", (), {})()
    engine.vllm_config = type("Config", (), {"parallel_config": parallel})()
    engine.model_executor, engine.dp_rank, engine.step_counter = executor(), 3, 40
    sentinel = type("Sentinel", (), {"_push_status": lambda s: None})()
    sentinel.engine = engine
    seen: list[tuple[list[int], int | None, int]] = []

    def reinit(s: Any, alive: list[int], *, publisher: int | None, store: Any) -> dict[str, Any]:
        seen.append((alive, publisher, getattr(s, sd.EPOCH_ATTR)))
        return {DP_PORTS_KEY: [29502]}

    monkeypatch.setattr(adm, "reinit_dp_group", reinit)
    adm.join(sentinel, adm.Admission(frozenset({3}), "u2", ("127.0.0.1", port)))
    assert lead.check([adm.join_key(3)])  # it announced itself to the survivors
    assert seen == [([0, 1, 2, 3], 0, 4)]  # the survivors' epoch-4 keys, their publisher
    (request,) = relayed[0]
    assert request.instruction == "scale_up" and request.request_id == "u2"
    assert request.params == {
        DP_PORTS_KEY: [29502], "added_dp_ranks": [3], "removed_dp_ranks": [3], "epoch": 2
    }  # fmt: skip
    assert getattr(parallel, REJOIN_KEY) == 0  # a member now: its server serves
    assert (engine.current_wave, engine.step_counter, engine.dp_rank) == (9, 0, 3)
    assert engine.engines_running is True
    assert getattr(sentinel, sd.REMOVED_ATTR) == frozenset()
    utils.stateless_destroy_torch_distributed_process_group(group)


def test_the_dp_sync_patch_counts_only_on_vllms_sync_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    (patch,) = [p for p in ENGINE_CORE_PATCHES if p.name == "_has_global_unfinished_reqs"]
    calls: list[bool] = []

    def at_dp_sync(engine: Any, running: bool) -> bool:
        calls.append(running)
        return True

    monkeypatch.setattr(adm, "at_dp_sync", at_dp_sync)

    def vllms(self: Any, local_unfinished: bool) -> bool:
        self.step_counter += 1
        return local_unfinished

    patched = patch.make(vllms)
    engine = type("Engine", (), {"step_counter": 0, "dp_sync_interval": 16})()
    results = [patched(engine, False) for _ in range(32)]
    assert calls == [False, False, False]  # steps 1, 16 and 32, vLLM's sync steps
    assert [i + 1 for i, r in enumerate(results) if r] == [1, 16, 32]


class MoeLayer(Layer):
    """A RoutedExperts stand-in as vLLM's start-up placement reads it (8 experts, EP 2)."""

    global_num_experts = 8
    expert_placement_strategy = "linear"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_moe(tmp_path_factory.mktemp("ckpt") / "qwen3-moe")


def test_a_survivor_unroutes_the_returning_ranks_experts_and_reuses_them_next_time(
    checkpoint: Path,
) -> None:
    layer = MoeLayer(torch.randn(4, 128, 128), torch.randn(4, 128, 64))
    index = CheckpointIndex.open(checkpoint)
    rehoster = CpuExpertRehoster(lambda: [layer], lambda: index, ep_rank=0, ep_size=2)
    expert_map = layer.get_buffer("_expert_map")
    first = rehoster.repair(frozenset({1}))  # rank 1 lost: rank 0 grows experts 4-7
    assert first.reloads == 4 and layer.w13_weight.shape[0] == 8
    grown = layer.w13_weight.detach().clone()
    back = rehoster.admit(frozenset({1}), frozenset())
    assert back.reloads == 0 and back.bytes_reloaded == 0
    assert expert_map.tolist() == [0, 1, 2, 3, -1, -1, -1, -1]  # tokens of 4-7 go to rank 1
    assert layer.w13_weight.shape[0] == 8  # the copies stay, unrouted
    again = rehoster.repair(frozenset({1}))  # lost again: routed in place, nothing read
    assert (again.reloads, again.bytes_reloaded) == (0, 0)
    assert expert_map.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert torch.equal(layer.w13_weight, grown) and layer.w13_weight.shape[0] == 8


def test_a_returning_rank_that_cannot_reach_the_survivors_stays_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wrong or stale ``dp_store``: the command fails saying why, nothing of the engine
    changed (no fault into its busy loop), so a later ``scale_up`` can still admit it."""
    parallel: Any = SimpleNamespace(data_parallel_rank=2, data_parallel_size=3,
                                    cpu_distributed_timeout=timedelta(seconds=1))  # fmt: skip
    setattr(parallel, REJOIN_KEY, 1)
    engine: Any = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel))
    sentinel: Any = SimpleNamespace(engine=engine)
    admission = adm.Admission(frozenset({2}), "u3", ("127.0.0.1", free_port_run(1)))
    adm._settle(admission, lambda: adm.join(sentinel, admission))  # raises nothing
    with pytest.raises(adm.NotAdmitted, match="was not admitted through the survivors' DP store"):
        admission.done.result(timeout=0)
    assert getattr(parallel, REJOIN_KEY) == 1  # still a returning rank, still ready
