"""The NPU backend behind the shared RankSentinel: DP=4 scale-downs and a retry on rank 0."""

from __future__ import annotations

import pytest
import torch

from ftengine.clock import ManualClock
from ftengine.context import RedundancyFacts
from ftengine.faults import FaultKind, HealthStatus, Phase
from ftengine.policies import OrchestratorDriven
from ftengine.sentinel import HostedBackend, RankSentinel
from ftengine.weights.index import CheckpointIndex
from tests.fakes.npu_host import NpuRig, SentinelHooks, make_npu_rig
from tests.fakes.npu_state import FakeDeviceError, FakeNpuState
from tests.unit.npu_fixtures import DISPATCH, MC2_HIDDEN, TinyCheckpoints
from tests.unit.npu_fixtures import npu_state as npu_state
from tests.unit.npu_fixtures import tiny_checkpoints as tiny_checkpoints


@pytest.fixture(scope="module")
def index(tiny_checkpoints: TinyCheckpoints) -> CheckpointIndex:
    return tiny_checkpoints.index(layers=2, experts=8, hidden=MC2_HIDDEN)


def sentinel_for(
    rig: NpuRig, *, world_size: int = 4, tp_size: int = 1
) -> tuple[RankSentinel, SentinelHooks]:
    placement = rig.host.placement()
    hooks = SentinelHooks(rig.host)
    sentinel = RankSentinel(
        OrchestratorDriven(),
        HostedBackend(rig.backend, hooks),
        rank=0,
        world_size=world_size,
        clock=ManualClock(),
        redundancy=RedundancyFacts(
            ep_size=world_size * tp_size,
            local_slots=placement.local_slots,
            num_logical=placement.num_logical,
            tp_size=tp_size,
        ),
    )
    return sentinel, hooks


def test_scale_down_of_rank_3_then_rank_2(npu_state: FakeNpuState, index: CheckpointIndex) -> None:
    rig = make_npu_rig(index, dp_size=4, dp_rank=0, num_redundant=8)
    sentinel, hooks = sentinel_for(rig)
    for dead, epoch, info in (({3}, 1, [1, 3, 0, 12, 0, 1, 2, -1]), ({2, 3}, 2, [1, 2, 0, 8])):
        sentinel.peer_fault(
            FaultKind.DEAD_PEER, rank=max(dead - rig.backend.dead_dp_ranks), info="EOF"
        )
        assert sentinel.health is HealthStatus.UNHEALTHY
        assert rig.host.step(rig.host.tokens(2)).numel() == 0  # fenced until recovered
        npu_state.clear_calls()
        result = sentinel.run_command(
            "scale_down", {"removed_dp_ranks": sorted(dead)}, f"sd{epoch}"
        )
        assert result.success, result.reason
        assert (sentinel.phase, sentinel.engine.epoch) == (Phase.HEALTHY, epoch)
        assert rig.backend.elastic.tensor.tolist()[: len(info)] == info
        (dispatch,) = npu_state.of(DISPATCH)  # the dummy batch went through MC2
        ids = dispatch.kwargs["expert_ids"]
        assert isinstance(ids, torch.Tensor) and int(ids.max()) < info[3]
    assert hooks.cleaned == 2
    assert rig.backend.dead_dp_ranks == frozenset({2, 3})
    out = rig.host.step(rig.host.tokens(3))
    assert out.shape == (3, MC2_HIDDEN)


def test_device_error_then_retry(npu_state: FakeNpuState, index: CheckpointIndex) -> None:
    rig = make_npu_rig(index, dp_size=4, dp_rank=0, num_redundant=8)
    sentinel, _ = sentinel_for(rig)
    npu_state.poison()
    npu_state.fail(DISPATCH, FakeDeviceError("EZ9999: device error, stream poisoned"))
    with pytest.raises(FakeDeviceError) as caught:
        rig.host.step(rig.host.tokens(2))
    fault = sentinel.report_fault(caught.value, step=7)
    assert (fault.kind, fault.step) == (FaultKind.TRANSIENT, 7)
    assert npu_state.names().count("npu.stop_device") == 1  # reset once, by the barrier
    result = sentinel.run_command("retry", {}, "retry-1")
    assert result.success, result.reason
    assert sentinel.health is HealthStatus.HEALTHY
    assert rig.host.step(rig.host.tokens(2)).shape == (2, MC2_HIDDEN)


def test_tp_2_scale_down_masks_both_ep_ranks_of_the_dead_dp_rank(
    npu_state: FakeNpuState, index: CheckpointIndex
) -> None:
    # DP 2 x TP 2: EP world 4; 8 experts + 8 redundant give 4 slots per EP rank, and DP
    # rank 1 owns EP ranks 2 and 3 (slots 8..15).
    rig = make_npu_rig(index, dp_size=2, dp_rank=0, tp_size=2, num_redundant=8)
    sentinel, _ = sentinel_for(rig, world_size=2, tp_size=2)
    sentinel.peer_fault(FaultKind.DEAD_PEER, rank=1, info="EOF")
    result = sentinel.run_command("scale_down", {"removed_dp_ranks": [1]}, "sd")
    assert result.success, result.reason
    assert rig.backend.elastic.tensor.tolist() == [1, 2, 0, 8, 0, 1, -1, -1, 0, 1, -1, -1]
    placement = rig.host.placement()
    assert bool((placement.physical_to_logical_map[:, 8:] == -1).all())
    assert bool((placement.logical_replica_count >= 1).all())
    assert all(int(table.max()) < 8 for table in rig.host.routing)  # dense ids of EP 0, 1
    assert rig.host.step(rig.host.tokens(3)).shape == (3, MC2_HIDDEN)
