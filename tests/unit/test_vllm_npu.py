"""Recovery on the vLLM-Ascend stand-in, driven as vLLM drives a worker: scale-down and retry,
unquantised and W8A8, TP = 1 and TP = 2, checking what vLLM-Ascend's kernels and forward read
(the manager's elastic_info, the densified routing tables, the per-expert weight lists), and
faults on the async output path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ftengine.backends.npu_env import ASYNC_ERROR_HANDLING_NAMES, TASK_QUEUE_ENABLE
from ftengine.errors import PreconditionFailed
from ftengine.faults import HealthStatus
from ftengine.integrations.vllm.worker.adapter import CommandFailed
from ftengine.integrations.vllm_ascend import hooks as ascend_hooks
from ftengine.integrations.vllm_ascend.plugin import unregister
from ftengine.placement.elastic import densify_routing_ids, elastic_info_values
from ftengine.weights.index import CheckpointIndex, Quant
from ftengine.weights.nz import ACL_FORMAT_FRACTAL_NZ
from ftengine.weights.reload import load_experts_into_slots
from ftengine.weights.slots import ExpertSlots
from tests.fakes.npu_routing import build_routing_table
from tests.fakes.npu_state import DISPATCH, FakeDeviceError, FakeNpuState
from tests.fakes.vllm_ascend_rig import AscendWorker, SchedulerOutput, start_worker
from tests.unit.npu_fixtures import MC2_HIDDEN, TinyCheckpoints
from tests.unit.npu_fixtures import npu_state as npu_state
from tests.unit.npu_fixtures import tiny_checkpoints as tiny_checkpoints

Request = pytest.importorskip(
    "vllm.v1.fault_tolerance.utils", reason="vllm is not installed"
).FaultToleranceRequest
EMPTY = pytest.importorskip("vllm.v1.outputs").EMPTY_MODEL_RUNNER_OUTPUT

DP = 4
FT_ENV = (
    TASK_QUEUE_ENABLE,
    *ASYNC_ERROR_HANDLING_NAMES,
    "HCCL_EVENT_TIMEOUT",
    "HCCL_EXEC_TIMEOUT",
)
RESET = ["npu.set_device", "npu.stop_device", "npu.restart_device"]


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The FT environment the glue writes and its WorkerWrapperBase patch end with the test."""
    for name in FT_ENV:
        monkeypatch.delenv(name, raising=False)
    yield
    unregister()


def checkpoint_for(tiny: TinyCheckpoints, quant: Quant) -> Path:
    return tiny.path(layers=2, experts=8, hidden=MC2_HIDDEN, quant=quant)


def survivors(path: Path, *, tp: int, redundant: int, dead_dp: int) -> list[AscendWorker]:
    """Every EP rank of the DP ranks that survive, started and loaded."""
    return [
        start_worker(path, dp_rank=d, dp_size=DP, tp_size=tp, tp_rank=t, redundant=redundant)
        for d in range(DP)
        if d != dead_dp
        for t in range(tp)
    ]


def command(rig: AscendWorker, instruction: str, params: dict[str, object], rid: str) -> Any:
    """What vLLM's engine core sends every worker (``collective_rpc("handle_ft_command")``),
    with one fresh DP-group port per worker of the engine."""
    ports = [41000 + t for t in range(rig.worker.parallel_config.world_size)]
    request = Request(instruction, {**params, "new_stateless_dp_group_ports": ports}, rid)
    return rig.worker.handle_ft_command(request)


def health(rig: AscendWorker) -> HealthStatus:
    """The worker's health as ftengine's engine reports it (its sentinel must be built)."""
    assert rig.sentinel.ft is not None
    return rig.sentinel.ft.sentinel.health


def model_state(rig: AscendWorker) -> Any:
    return rig.worker.model_runner.eplb_state.model_states["main"]


def moe_layers(rig: AscendWorker) -> list[Any]:
    return list(rig.worker.model_runner.model.moe_layers)


def checkpoint_slot(index: CheckpointIndex, layer: int, expert: int) -> dict[str, torch.Tensor]:
    """One expert as the loader lays a slot out (w13 [H, 2I], w2 [I, H], W8A8 scales)."""
    slots = ExpertSlots.allocate(index, index.num_layers, 1)
    load_experts_into_slots(index, slots, [(layer, 0, expert)])
    return {name: tensor[layer, 0] for name, tensor in slots.tensors().items()}


def assert_forward_reads_the_maps_experts(rig: AscendWorker, index: CheckpointIndex) -> None:
    """Every slot the forward reads holds the checkpoint expert the maps name there."""
    p2l = model_state(rig).physical_to_logical_map
    local = p2l.shape[1] // rig.worker.ep_group.world_size
    first = rig.worker.ep_group.rank_in_group * local
    for layer, moe in enumerate(moe_layers(rig)):
        for name, tensors in moe.forward_weights().items():
            for slot in range(local):
                expected = checkpoint_slot(index, layer, int(p2l[layer, first + slot]))
                assert torch.equal(tensors[slot], expected[name]), (layer, slot, name)


def dense_table1(world: int, dead: list[int]) -> list[int]:
    alive = [rank for rank in range(world) if rank not in dead]
    return [alive.index(rank) if rank in alive else -1 for rank in range(world)]


@pytest.mark.parametrize("quant", ["none", "w8a8_dynamic"])
@pytest.mark.parametrize(("tp", "redundant"), [(1, 4), (2, 8)])
def test_scale_down_writes_what_the_kernels_and_the_forward_read(
    npu_state: FakeNpuState,
    tiny_checkpoints: TinyCheckpoints,
    quant: Quant,
    tp: int,
    redundant: int,
) -> None:
    # DP 4 x TP tp, 8 experts + redundant slots: 3 per EP rank (TP 1) or 2 (TP 2). DP rank
    # 1 dies with its tp EP ranks; each survivor re-hosts what it is assigned, from disk.
    path = checkpoint_for(tiny_checkpoints, quant)
    index = CheckpointIndex.open(path)
    ep_world, dead_ep = DP * tp, list(range(tp, 2 * tp))
    local = (8 + redundant) // ep_world
    moved = 0
    for rig in survivors(path, tp=tp, redundant=redundant, dead_dp=1):
        info = rig.manager.get_elastic_info()
        tables = [moe.eplb_state.expert_replica_routing_table for moe in moe_layers(rig)]
        pointers = [info.data_ptr(), *(table.data_ptr() for table in tables)]
        before = model_state(rig).physical_to_logical_map.clone()
        npu_state.clear_calls()
        result = command(rig, "scale_down", {"removed_dp_ranks": [1]}, "sd")
        assert result.success, result.reason
        assert health(rig) is HealthStatus.HEALTHY
        # the mask went through the manager's own accessor and was rebuilt in place
        assert rig.manager.updates == [(rank, True) for rank in dead_ep]
        assert info.tolist() == elastic_info_values(ep_world, dead_ep, local)
        assert [info.data_ptr(), *(table.data_ptr() for table in tables)] == pointers
        # the maps no longer name the dead ranks; each routing table is their dense form
        state = model_state(rig)
        assert bool((state.physical_to_logical_map[:, tp * local : 2 * tp * local] == -1).all())
        for layer, table in enumerate(tables):
            physical = build_routing_table(
                state.logical_to_physical_map[layer],
                state.logical_replica_count[layer],
                rig.worker.ep_group.rank_in_group,
            )
            assert torch.equal(
                table, densify_routing_ids(physical, dense_table1(ep_world, dead_ep), local)
            )
        assert_forward_reads_the_maps_experts(rig, index)
        moved += int((state.physical_to_logical_map != before).sum())
        # the dummy batch ran through MC2 with the manager's elastic_info, then synchronized
        dispatches = npu_state.of(DISPATCH)
        assert dispatches and all(call.kwargs["elastic_info"] is info for call in dispatches)
        assert npu_state.names()[-1] == "npu.synchronize"
        # the engine's gloo DP group rebuilt among the 3 survivors, on this worker's port
        alive = [d for d in range(DP) if d != 1]
        rank = alive.index(rig.worker.parallel_config.data_parallel_rank)
        assert rig.dist.inits[-1][1:4] == (41000 + rig.worker.rank, rank, DP - 1)
    assert moved > 0  # something was re-hosted, and every re-hosted slot was checked above


def test_a_reload_into_the_old_parameter_names_fails(
    npu_state: FakeNpuState, tiny_checkpoints: TinyCheckpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM-Ascend's W8A8 loader replaced w13_weight / w13_weight_scale by per-expert lists
    # (and deleted them): writing the old names cannot reach what the forward reads. Rank
    # 2 (the second survivor) is the one the plan gives rank 1's lone experts.
    rig = survivors(checkpoint_for(tiny_checkpoints, "w8a8_dynamic"), tp=1, redundant=4, dead_dp=1)[
        1
    ]
    old = {
        "w13": "w13_weight",
        "w2": "w2_weight",
        "w13_scale": "w13_weight_scale",
        "w2_scale": "w2_weight_scale",
    }
    monkeypatch.setattr(ascend_hooks, "SLOT_LISTS", {})
    monkeypatch.setattr(ascend_hooks, "SLOT_TENSORS", old)
    with pytest.raises(CommandFailed, match="no w13, w2, w13_scale, w2_scale storage"):
        command(rig, "scale_down", {"removed_dp_ranks": [1]}, "sd")


@pytest.mark.parametrize("quant", ["none", "w8a8_dynamic"])
def test_reloaded_weights_keep_their_storage_and_nz_format(
    npu_state: FakeNpuState, tiny_checkpoints: TinyCheckpoints, quant: Quant
) -> None:
    import torch_npu

    rig = survivors(checkpoint_for(tiny_checkpoints, quant), tp=1, redundant=4, dead_dp=1)[1]
    before = [[t.data_ptr() for t in moe.forward_weights()["w13"]] for moe in moe_layers(rig)]
    npu_state.clear_calls()
    result = command(rig, "scale_down", {"removed_dp_ranks": [1]}, "sd")
    assert result.success, result.reason
    assert [
        [t.data_ptr() for t in moe.forward_weights()["w13"]] for moe in moe_layers(rig)
    ] == before
    casts = [
        call for call in npu_state.of("npu_format_cast") if call.args[1] == ACL_FORMAT_FRACTAL_NZ
    ]
    for moe in moe_layers(rig):
        formats = {torch_npu.get_npu_format(w) for w in moe.forward_weights()["w13"]}
        if quant == "w8a8_dynamic":
            assert not hasattr(moe, "w13_weight") and not hasattr(moe, "w13_weight_scale_fp32")
            assert formats == {ACL_FORMAT_FRACTAL_NZ}
        else:  # weight_nz_mode 1: bf16 expert weights stay ND
            assert formats == {2}
    # rank 2 re-hosts the experts rank 1 held alone: int8 ones are cast to NZ first
    assert bool(casts) is (quant == "w8a8_dynamic")


@pytest.mark.parametrize("quant", ["none", "w8a8_dynamic"])
@pytest.mark.parametrize(("tp", "redundant"), [(1, 4), (2, 8)])
def test_a_device_error_resets_once_fences_the_worker_and_retry_recovers(
    npu_state: FakeNpuState,
    tiny_checkpoints: TinyCheckpoints,
    quant: Quant,
    tp: int,
    redundant: int,
) -> None:
    rig = start_worker(
        checkpoint_for(tiny_checkpoints, quant),
        dp_rank=2,
        dp_size=DP,
        tp_size=tp,
        tp_rank=tp - 1,
        redundant=redundant,
    )
    npu_state.clear_calls()
    npu_state.poison()
    npu_state.fail(DISPATCH, FakeDeviceError("EZ9999: device error, stream poisoned"))
    with pytest.raises(FakeDeviceError):
        rig.worker.execute_model(SchedulerOutput(["r1", "r2"]))
    assert npu_state.names()[1:4] == RESET  # reset at once, inside the failing step
    assert rig.sentinel.worker_faulted  # what vLLM-Ascend's own barrier reads
    assert health(rig) is HealthStatus.UNHEALTHY
    calls = len(npu_state.calls)
    assert rig.worker.execute_model(SchedulerOutput(["r3"])) is EMPTY
    assert len(npu_state.calls) == calls  # fenced: nothing reaches the device
    result = command(rig, "retry", {}, "retry-1")
    assert result.success, result.reason
    assert npu_state.names().count("npu.stop_device") == 2  # the barrier's, then the retry's
    assert health(rig) is HealthStatus.HEALTHY
    assert rig.worker.model_runner.req_states.req_id_to_index == {}  # requests dropped
    # the engine's gloo DP group re-made among all four, on this worker's port
    assert rig.dist.inits[-1][1:4] == (41000 + rig.worker.rank, 2, DP)
    rig.worker.execute_model(SchedulerOutput(["r4"]))
    assert rig.worker.sample_tokens(None).get_output().req_ids == ["r4"]


def test_a_fault_surfacing_in_the_async_output_is_quarantined(
    npu_state: FakeNpuState, tiny_checkpoints: TinyCheckpoints
) -> None:
    rig = start_worker(checkpoint_for(tiny_checkpoints, "none"), dp_rank=0, dp_size=DP)
    rig.worker.execute_model(SchedulerOutput(["r1"]))
    output = rig.worker.sample_tokens(None)
    npu_state.clear_calls()
    npu_state.poison()  # the step's kernels fail after execute_model returned
    with pytest.raises(FakeDeviceError, match="poisoned"):
        output.get_output()
    assert npu_state.names()[1:4] == RESET
    assert health(rig) is HealthStatus.UNHEALTHY
    assert output.get_output() is EMPTY and output.calls == 1  # fenced, device untouched
    result = command(rig, "retry", {}, "retry-1")
    assert result.success, result.reason
    rig.worker.execute_model(SchedulerOutput(["r2"]))
    assert rig.worker.sample_tokens(None).get_output().req_ids == ["r2"]


@pytest.mark.parametrize(
    ("additional", "soc", "reason"),
    [
        ({"enable_fused_mc2": 1}, "A3", "fused MC2"),
        ({"enable_mc2_hierarchy_comm": True}, "A3", "hierarchical"),
        ({}, "A2", "Atlas A3, found 'A2'"),
    ],
)
def test_scale_down_preconditions_read_vllm_ascends_config(
    npu_state: FakeNpuState,
    tiny_checkpoints: TinyCheckpoints,
    additional: dict[str, object],
    soc: str,
    reason: str,
) -> None:
    npu_state.soc = soc
    with pytest.raises(PreconditionFailed, match=reason):
        start_worker(checkpoint_for(tiny_checkpoints, "none"), additional=additional)


def test_retry_only_runs_where_scale_down_cannot(
    npu_state: FakeNpuState, tiny_checkpoints: TinyCheckpoints
) -> None:
    rig = start_worker(
        checkpoint_for(tiny_checkpoints, "none"),
        additional={"enable_fused_mc2": 1, "ftengine": {"scale_down": False}},
    )
    rig.sentinel.report_exception(RuntimeError("HCCL timeout"))
    result = command(rig, "retry", {}, "retry-1")
    assert result.success, result.reason
