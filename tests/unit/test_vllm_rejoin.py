"""A restarted DP rank's start (issue 28), each piece against vLLM's real code where it runs
in one process: DP rank 0's server answers the start-up handshake after start-up (vLLM's own
``EngineCoreProc.startup_handshake`` against the responder, over ZMQ), the flag that reaches
``ParallelConfig``, the engine core's DP group of its own (a real one-member gloo group), the
worker's one-rank view and widened groups, and the status and the guard of a rank waiting
for admission."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ftengine.integrations.vllm.api_server import rejoin_responder
from ftengine.integrations.vllm.api_server.dead_rank import all_dead
from ftengine.integrations.vllm.api_server.rejoin_responder import (
    RejoinResponder,
    answering_rejoins,
    init_message,
    serves_rejoins,
)
from ftengine.integrations.vllm.engine_core.rejoin import init_data_parallel, rejoin_status
from ftengine.integrations.vllm.messages import API_URL_ENV
from ftengine.integrations.vllm.rejoin_flag import REJOIN_KEY, rank0_url, rejoining
from ftengine.integrations.vllm.worker import rejoin as worker_rejoin
from ftengine.integrations.vllm.worker.distributed import ALIVE_ATTR

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
core = pytest.importorskip("vllm.v1.engine.core")
engine_utils = pytest.importorskip("vllm.v1.engine.utils")
from vllm.config import ParallelConfig  # noqa: E402


def free_tcp() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def config_hash(config: ParallelConfig) -> str:
    """vLLM's ``ParallelConfig.compute_hash()`` (untyped in vLLM)."""
    compute: Any = config.compute_hash
    return str(compute())


def front_end_config(rank: int = 0, *, fault_tolerance: bool = True) -> ParallelConfig:
    """DP rank ``rank``'s ``ParallelConfig`` of a DP=3 external-LB deployment."""
    config = ParallelConfig(
        data_parallel_size=3,
        data_parallel_rank=rank,
        data_parallel_size_local=1,
        data_parallel_external_lb=True,
        enable_fault_tolerance=fault_tolerance,
    )
    return config


def addresses() -> Any:
    return engine_utils.EngineZmqAddresses(
        inputs=["ipc:///tmp/in"],
        outputs=["ipc:///tmp/out"],
        coordinator_input="tcp://127.0.0.1:41001",
        coordinator_output="tcp://127.0.0.1:41002",
        frontend_stats_publish_address="tcp://127.0.0.1:41003",
    )


def dealer(ctx: Any, endpoint: str, rank: int) -> Any:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, rank.to_bytes(2, "little"))
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def test_vllms_own_handshake_gets_the_start_up_addresses_and_the_rejoin_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(API_URL_ENV, "http://10.0.0.1:8000")  # rank 0's server exported it
    front = front_end_config()
    endpoint = free_tcp()
    responder = RejoinResponder(
        endpoint,
        [r.to_bytes(2, "little") for r in range(3)],
        init_message(addresses(), front),
        config_hash(front),
    )
    responder.start()
    ctx = zmq.Context()
    try:
        assert responder.bound.wait(10)
        sock = dealer(ctx, endpoint, 2)
        joining = ParallelConfig(data_parallel_size=3, data_parallel_rank=2)
        got = core.EngineCoreProc.startup_handshake(sock, False, False, joining)
        assert got.coordinator_input == "tcp://127.0.0.1:41001"
        assert got.frontend_stats_publish_address == "tcp://127.0.0.1:41003"
        assert rejoining(joining) and getattr(joining, REJOIN_KEY) == 1
        assert rank0_url(joining) == "http://10.0.0.1:8000"  # where it reads the survivors' store
        unflagged = ParallelConfig(data_parallel_size=3, data_parallel_rank=2)
        assert config_hash(joining) == config_hash(unflagged), "rank 0 checks this hash"
        assert responder.answered == [2]
        ready = {"status": "READY", "local": False, "headless": False}
        sock.send(msgspec.msgpack.encode({**ready, "parallel_config_hash": "other"}))
        deadline = time.monotonic() + 10
        while 2 not in responder.ready:
            assert time.monotonic() < deadline, "no READY seen"
            time.sleep(0.02)
        assert responder.ready == {2: False}  # another configuration: never to be admitted
        sock.close()
    finally:
        responder.stop()
        ctx.destroy(linger=0)


def test_an_unknown_identity_gets_no_answer() -> None:
    front = front_end_config()
    endpoint = free_tcp()
    responder = RejoinResponder(endpoint, [b"\x01\x00"], init_message(addresses(), front), None)
    responder.start()
    ctx = zmq.Context()
    try:
        assert responder.bound.wait(10)
        sock = dealer(ctx, endpoint, 7)
        sock.send(msgspec.msgpack.encode({"status": "HELLO", "local": False, "headless": False}))
        assert not sock.poll(500)
        assert responder.answered == []
    finally:
        responder.stop()
        ctx.destroy(linger=0)


def test_the_wrapper_rebinds_vllms_address_once_vllms_socket_is_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rejoin_responder, "RESPONDERS", [])
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(free_tcp())
    endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
    calls: list[tuple[Any, ...]] = []

    def wait(*args: Any) -> None:  # vLLM's wait_for_engine_startup: every engine READY
        calls.append(args)

    front = front_end_config()
    launch = SimpleNamespace(addresses=addresses())
    engines = [engine_utils.CoreEngine(index=i, local=i == 0) for i in range(3)]
    try:
        answering_rejoins(wait)(router, engines, front, True, None, launch)
        assert len(calls) == 1 and calls[0][0] is router
        router.close()  # what vLLM's zmq_socket_ctx does next
        (responder,) = rejoin_responder.RESPONDERS
        assert responder.bound.wait(10) and responder.endpoint == endpoint
        sock = dealer(ctx, endpoint, 1)
        joining = ParallelConfig(data_parallel_size=3, data_parallel_rank=1)
        core.EngineCoreProc.startup_handshake(sock, False, False, joining)
        assert rejoining(joining)
        sock.close()
    finally:
        for started in rejoin_responder.RESPONDERS:
            started.stop()
        ctx.destroy(linger=0)


@pytest.mark.parametrize(
    ("config", "endpoint", "serves"),
    [
        (front_end_config(), "tcp://127.0.0.1:5000", True),
        (front_end_config(1), "tcp://127.0.0.1:5000", False),  # not rank 0's server
        (front_end_config(fault_tolerance=False), "tcp://127.0.0.1:5000", False),
        (front_end_config(), "ipc:///tmp/handshake", False),  # a local-only handshake
        (ParallelConfig(enable_fault_tolerance=True), "tcp://127.0.0.1:5000", False),  # DP 1
    ],
)
def test_only_rank_0s_fault_tolerant_dp_server_answers_rejoins(
    config: ParallelConfig, endpoint: str, serves: bool
) -> None:
    assert serves_rejoins(config, endpoint) is serves


def test_a_rejoining_engine_core_gets_a_dp_group_of_its_own_and_no_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ftengine.integrations.vllm.engine_core import rejoin

    monkeypatch.setattr(rejoin, "route_logs", lambda: None)  # leave this process's logging
    parallel = ParallelConfig(data_parallel_size=3, data_parallel_rank=2)
    setattr(parallel, REJOIN_KEY, 1)
    engine = SimpleNamespace()
    calls: list[object] = []
    init_data_parallel(
        engine, SimpleNamespace(parallel_config=parallel), lambda *a: calls.append(a)
    )
    assert calls == []  # vLLM's own would join the original group
    assert (engine.dp_rank, engine.dp_size, engine.dp_store) == (2, 3, None)
    assert engine.dp_group.size() == 1 and engine.dp_group.rank() == 0
    flag = torch.tensor([1])
    torch.distributed.all_reduce(flag, group=engine.dp_group)  # vLLM's unfinished-requests sum
    assert flag.item() == 1


def test_any_other_engine_core_runs_vllms_own_dp_start() -> None:
    config = SimpleNamespace(parallel_config=ParallelConfig(data_parallel_size=3))
    engine = SimpleNamespace()
    calls: list[tuple[object, ...]] = []
    init_data_parallel(engine, config, lambda *a: calls.append(a))
    assert calls == [(engine, config)] and not hasattr(engine, "dp_group")


def test_the_worker_runs_vllms_own_start_as_one_rank_and_restores_the_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parallel = ParallelConfig(data_parallel_size=3, data_parallel_rank=2)
    setattr(parallel, REJOIN_KEY, 1)
    seen: list[tuple[int, int]] = []
    groups = {
        name: SimpleNamespace(
            world_size=1,
            rank_in_group=0,
            device_communicator=SimpleNamespace(world_size=1, rank_in_group=0, all2all_manager=1),
        )
        for name in ("dp", "ep")
    }
    state = SimpleNamespace(
        _EP=groups["ep"], get_dp_group=lambda: groups["dp"], get_ep_group=lambda: groups["ep"]
    )
    monkeypatch.setattr(worker_rejoin, "import_vllm", lambda name: state)

    def vllm_init(config: Any, rank: int, method: str | None, local: int, backend: str) -> None:
        seen.append(
            (config.parallel_config.data_parallel_size, config.parallel_config.data_parallel_rank)
        )

    worker_rejoin.init_distributed(
        vllm_init, SimpleNamespace(parallel_config=parallel), 0, "tcp://127.0.0.1:1", 0, "gloo"
    )
    assert seen == [(1, 0)]  # vLLM's own start saw a one-rank deployment
    assert (parallel.data_parallel_size, parallel.data_parallel_rank) == (3, 2)
    for group in groups.values():  # the original size and this rank's place, marked alone
        assert (group.world_size, group.rank_in_group) == (3, 2)
        communicator = group.device_communicator
        assert (communicator.world_size, communicator.rank_in_group) == (3, 2)
        assert getattr(communicator, ALIVE_ATTR) == (2,)


def test_the_one_rank_view_is_restored_when_vllms_start_raises() -> None:
    parallel = ParallelConfig(data_parallel_size=3, data_parallel_rank=2)
    with pytest.raises(RuntimeError, match="boom"), worker_rejoin.one_rank_view(parallel):
        assert parallel.data_parallel_size == 1
        raise RuntimeError("boom")
    assert (parallel.data_parallel_size, parallel.data_parallel_rank) == (3, 2)


def test_a_rank_waiting_for_admission_reports_ready_and_its_server_serves_nothing() -> None:
    parallel = ParallelConfig(data_parallel_size=3, data_parallel_rank=2)
    engine = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel))
    assert rejoin_status(engine) == {}
    setattr(parallel, REJOIN_KEY, 1)
    fields = rejoin_status(engine)
    assert (fields["status"], fields["phase"]) == ("unhealthy", "ready")
    assert "DP rank 2 restarted" in str(fields["fault_info"])
    engines = [{"id": 2, "status": "unhealthy", "phase": "ready"}]
    assert all_dead({"engines": engines})
    assert not all_dead({"engines": [{"id": 2, "status": "unhealthy", "phase": "retrying"}]})


def test_engine_cores_are_spawned_through_ftengines_entry_which_patches_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pickle

    from ftengine.integrations.vllm.engine_core import entry
    from ftengine.integrations.vllm.patches.api_server import API_SERVER_PATCHES
    from ftengine.integrations.vllm.patches.engine_core import REJOIN_ENGINE_CORE_PATCHES
    from ftengine.integrations.vllm.patches.mechanism import PATCHED_MARK, apply_patches

    (entry_patch,) = [p for p in API_SERVER_PATCHES if p.name == "run_engine_core"]
    (dp_patch,) = REJOIN_ENGINE_CORE_PATCHES
    for patch in (entry_patch, dp_patch):
        owner, _ = patch.target()
        monkeypatch.setattr(owner, patch.name, owner.__dict__[patch.name])
    monkeypatch.setattr(entry.run_engine_core, PATCHED_MARK, None, raising=False)
    apply_patches([entry_patch])
    target = core.EngineCoreProc.run_engine_core  # what vLLM's process manager reads
    # The spawned process unpickles the target by name: ftengine's entry, not vLLM's.
    assert pickle.loads(pickle.dumps(target)) is entry.run_engine_core
    seen: list[object] = []

    def vllm_entry(*args: Any, dp_rank: int = 0, local_dp_rank: int = 0, **kwargs: Any) -> None:
        init = core.DPEngineCoreProc._init_data_parallel
        seen.append((args, dp_rank, local_dp_rank, kwargs, getattr(init, PATCHED_MARK, None)))

    monkeypatch.setattr(entry.run_engine_core, PATCHED_MARK, vllm_entry)
    _, vllm_init = dp_patch.target()
    target("a", dp_rank=2, local_dp_rank=0, vllm_config="c")
    assert seen == [(("a",), 2, 0, {"vllm_config": "c"}, vllm_init)]  # patched before vLLM ran


def test_a_widened_group_of_one_gathers_and_scatters_its_own_rows_with_vllms_communicator() -> None:
    from torch._C._distributed_c10d import HashStore

    from ftengine.integrations.vllm.worker.cpu_collectives import all_gatherv, reduce_scatterv

    dist = torch.distributed
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)  # the worker's world
    try:
        group = dist.new_group([0])  # what vLLM's initialize_model_parallel makes of one rank
        coordinator = SimpleNamespace(
            world_size=1,
            rank_in_group=0,
            cpu_group=group,
            device_group=group,
            device=torch.device("cpu"),
            unique_name="dp:0",
            device_communicator=None,  # vLLM makes none for a group of one
        )
        worker_rejoin.widen(coordinator, 3, 2)
        communicator = coordinator.device_communicator
        assert type(communicator).__name__ == "CpuCommunicator"
        assert (communicator.world_size, communicator.rank_in_group) == (3, 2)
        assert getattr(communicator, ALIVE_ATTR) == (2,)
        rows = torch.arange(6.0).reshape(3, 2)
        # vLLM's DP padding gave the other ranks 0 tokens: only this rank's rows come back
        gathered = all_gatherv(communicator, rows, 0, [0, 0, 3])
        assert isinstance(gathered, torch.Tensor) and torch.equal(gathered, rows)
        assert torch.equal(reduce_scatterv(communicator, rows, 0, [0, 0, 3]), rows)
    finally:
        dist.destroy_process_group()
