"""The adapter's Ascend path: ftengine's NPU backend (over the fake torch_npu) under a vLLM
worker; a scale-down updates vLLM's EPLB maps and FusedMoE slots in place and hands the
all2all manager the rebuilt ``elastic_info``."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from ftengine.clock import ManualClock
from ftengine.faults import FaultKind, HealthStatus
from ftengine.integrations.vllm.factory import build_worker_sentinel, npu_backend
from ftengine.integrations.vllm.hooks import DEAD_RANKS_ATTR, MASK_ATTR
from ftengine.integrations.vllm.messages import VllmMessages
from ftengine.integrations.vllm.sentinel import FtengineWorkerSentinel
from ftengine.weights import layout
from ftengine.weights.index import CheckpointIndex
from tests.fakes.npu_host import RecordingGroupFactory
from tests.fakes.npu_state import FakeNpuState
from tests.unit.npu_fixtures import TinyCheckpoints
from tests.unit.npu_fixtures import npu_state as npu_state
from tests.unit.npu_fixtures import tiny_checkpoints as tiny_checkpoints
from tests.unit.test_vllm_standin import Distributed, FusedMoE, Worker, make_worker

Request = pytest.importorskip(
    "vllm.v1.fault_tolerance.utils", reason="vllm is not installed"
).FaultToleranceRequest


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints: TinyCheckpoints) -> Path:
    return tiny_checkpoints.path(layers=2, experts=8)


def adapter_on_npu(worker: Worker, dist: Distributed) -> FtengineWorkerSentinel:
    """The adapter over ftengine's NPU backend, on the fake torch_npu with CPU tensors."""
    factory = functools.partial(
        npu_backend, group_factory=RecordingGroupFactory(), environ={}, device=torch.device("cpu")
    )
    return build_worker_sentinel(
        worker,
        backend_factory=factory,
        dist=dist,
        messages=VllmMessages.load(),
        clock=ManualClock(),
    )


def assert_slots_hold_the_checkpoints_experts(
    checkpoint: Path, p2l: torch.Tensor, layers: list[FusedMoE], slots: list[tuple[int, int]]
) -> None:
    """Each (layer, physical slot) of this rank (slots 6..8) holds the w13 of the expert the
    map names there, as the checkpoint on disk has it."""
    index = CheckpointIndex.open(checkpoint)
    for layer, slot in slots:
        expert = int(p2l[layer, slot])
        gate = index.read(f"model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight")
        up = index.read(f"model.layers.{layer}.mlp.experts.{expert}.up_proj.weight")
        assert torch.equal(layers[layer].w13_weight[slot - 6], layout.to_w13(gate, up))


def test_scale_down_rehosts_experts_into_vllms_tensors_in_place(
    npu_state: FakeNpuState, checkpoint: Path
) -> None:
    # 8 experts + 4 redundant on 4 ranks (3 slots each): rank 1 holds the only copies of
    # experts 4 and 5, and the deterministic plan re-hosts expert 5 on rank 2's slot 8.
    worker = make_worker(v2=True, model=str(checkpoint), dp_rank=2, redundant=4)
    dist = Distributed()
    adapter = adapter_on_npu(worker, dist)
    runner = worker.model_runner
    assert runner.eplb_state is not None and runner.model is not None
    maps = runner.eplb_state.model_states["main"]
    layers = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    pointers = [maps.physical_to_logical_map.data_ptr(), *(m.w13_weight.data_ptr() for m in layers)]

    before = maps.physical_to_logical_map.clone()
    adapter.sentinel.peer_fault(FaultKind.DEAD_PEER, 1, "rank 1 exited")  # type: ignore[attr-defined]
    assert adapter.sentinel.health is HealthStatus.UNHEALTHY
    params = {"removed_dp_ranks": [1], "new_stateless_dp_group_ports": [41000]}
    result = adapter.handle_ft_command(Request("scale_down", params, "sd"))
    assert result.success, result.reason

    # vLLM's tensors were updated, not replaced
    now = [maps.physical_to_logical_map.data_ptr(), *(m.w13_weight.data_ptr() for m in layers)]
    assert now == pointers
    p2l = maps.physical_to_logical_map
    assert bool((p2l[:, 3:6] == -1).all())  # rank 1's three slots hold nothing
    assert bool((maps.logical_replica_count >= 1).all())  # every expert still served
    l2p = maps.logical_to_physical_map
    assert not bool(((l2p >= 3) & (l2p < 6)).any())
    # what moved onto this rank (slots 6..8) was read from disk into the slot tensors
    mine = range(6, 9)
    moved = [
        (layer, slot)
        for layer in range(2)
        for slot in mine
        if p2l[layer, slot] != before[layer, slot]
    ]
    assert moved == [(0, 8), (1, 8)]
    assert_slots_hold_the_checkpoints_experts(checkpoint, p2l, layers, moved)
    # the all2all manager reads the backend's elastic_info (rank 1 dead of 4, 3 slots each)
    manager = dist.manager
    assert getattr(manager, DEAD_RANKS_ATTR) == frozenset({1})
    elastic = getattr(manager, MASK_ATTR)
    assert elastic.tolist()[:8] == [1, 3, 0, 9, 0, -1, 1, 2]
    assert worker.dummy_batches == 1
