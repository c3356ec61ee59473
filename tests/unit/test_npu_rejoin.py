"""admit_ranks on the NPU backend, over the fake torch_npu (the published MC2 schemas and SoC
limits): elastic_info un-masked in place back to the full physical width, routing tables
rebuilt in place, the returning rank's experts back, no survivor reload."""

from __future__ import annotations

import pytest
import torch

from ftengine.backends.npu_config import NpuFtConfig
from ftengine.errors import PreconditionFailed
from ftengine.faults import Fault, FaultKind
from ftengine.weights.index import CheckpointIndex
from tests.fakes.npu_host import NpuRig, make_npu_rig
from tests.fakes.npu_state import FakeNpuState, Mc2ArgumentError
from tests.unit.npu_fixtures import DISPATCH, MC2_HIDDEN, TinyCheckpoints
from tests.unit.npu_fixtures import npu_state as npu_state
from tests.unit.npu_fixtures import tiny_checkpoints as tiny_checkpoints

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def index(tiny_checkpoints: TinyCheckpoints) -> CheckpointIndex:
    return tiny_checkpoints.index(layers=2, experts=16, hidden=MC2_HIDDEN)


def rig_of(index: CheckpointIndex, rank: int, placement: str = "default") -> NpuRig:
    """DP rank ``rank`` of W = 4 with 8 local slots (16 logical + 16 redundant experts)."""
    config = NpuFtConfig(placement=placement)
    return make_npu_rig(index, dp_size=4, dp_rank=rank, num_redundant=16, config=config)


def scale_down(rig: NpuRig, dead: frozenset[int], epoch: int) -> None:
    rig.backend.quarantine(Fault(FaultKind.DEAD_PEER, info="ConnectionError"))
    rig.backend.mask_ranks(dead)
    rig.backend.rebuild_groups(frozenset(range(4)) - dead, epoch)
    rig.backend.repair_experts(dead)
    rig.backend.run_dummy_batch()


def values(tensor: torch.Tensor) -> list[int]:
    return [int(v) for v in tensor.tolist()]


def test_a_survivor_unmasks_in_place_and_routes_to_the_returning_rank_again(
    npu_state: FakeNpuState, index: CheckpointIndex
) -> None:
    rig = rig_of(index, 0)
    original = rig.host.placement().physical_to_logical_map.clone()
    tensor = rig.backend.elastic.tensor
    ptr, tables = tensor.data_ptr(), [t.data_ptr() for t in rig.host.routing]
    scale_down(rig, frozenset({2}), 1)
    assert values(tensor)[:4] == [1, 3, 0, 24]  # masked: 24 MoE experts after the shrink
    mc2 = rig.host.mc2
    assert mc2 is not None
    to_rank_2 = mc2.dispatch_kwargs(rig.host.tokens(1), torch.tensor([[0, 31]]))
    with pytest.raises(Mc2ArgumentError, match="expert_ids must be < 24"):
        rig.backend.runtime.dispatch_v2(to_rank_2)

    rig.backend.rebuild_groups(frozenset(range(4)), 2)
    report = rig.backend.admit_ranks(frozenset({2}), frozenset())
    assert report.reloads == 0  # a survivor reloads nothing
    assert tensor.data_ptr() == ptr and rig.backend.elastic.tensor is tensor
    assert values(tensor) == [0] * 12  # un-masked: the full physical width again
    assert [t.data_ptr() for t in rig.host.routing] == tables
    p2l = rig.host.placement().physical_to_logical_map
    assert torch.equal(p2l[:, 16:24], original[:, 16:24])  # rank 2's own experts back
    rig.host.placement().validate(require_every_expert=True)
    # The published schema takes the full width again (ids up to 31, undensified).
    again = mc2.dispatch_kwargs(rig.host.tokens(1), torch.tensor([[0, 31]]))
    rig.backend.runtime.dispatch_v2(again)
    rig.backend.run_dummy_batch()
    assert npu_state.of(DISPATCH)
    assert rig.backend.dead_dp_ranks == frozenset()


def test_the_returning_rank_adopts_the_survivors_maps_and_reloads_nothing(
    npu_state: FakeNpuState, index: CheckpointIndex
) -> None:
    survivor = rig_of(index, 0)
    scale_down(survivor, frozenset({2}), 1)
    returning = rig_of(index, 2)
    with pytest.raises(PreconditionFailed, match="must be the survivors'"):
        returning.backend.admit_ranks(frozenset({2}), frozenset())
    # The host copies a survivor's maps (the vLLM side's job), then the admission runs.
    survivors_map = survivor.host.placement().physical_to_logical_map
    mine = returning.host.placement()
    mine.physical_to_logical_map.copy_(survivors_map)
    mine.logical_to_physical_map.copy_(survivor.host.placement().logical_to_physical_map)
    mine.logical_replica_count.copy_(survivor.host.placement().logical_replica_count)
    returning.backend.rebuild_groups(frozenset(range(4)), 2)
    report = returning.backend.admit_ranks(frozenset({2}), frozenset())
    assert report.reloads == 0  # it holds its original experts since start-up
    survivor.backend.rebuild_groups(frozenset(range(4)), 2)
    survivor.backend.admit_ranks(frozenset({2}), frozenset())
    assert torch.equal(
        returning.host.placement().physical_to_logical_map,
        survivor.host.placement().physical_to_logical_map,
    )
    returning.backend.run_dummy_batch()


def test_a_wrong_admission_changes_nothing(npu_state: FakeNpuState, index: CheckpointIndex) -> None:
    rig = rig_of(index, 0)
    scale_down(rig, frozenset({1, 2}), 1)
    before = values(rig.backend.elastic.tensor)
    with pytest.raises(PreconditionFailed, match="not masked here"):
        rig.backend.admit_ranks(frozenset({3}), frozenset({1, 2}))
    with pytest.raises(PreconditionFailed, match="must be \\[1\\]"):
        rig.backend.admit_ranks(frozenset({2}), frozenset())
    assert values(rig.backend.elastic.tensor) == before
    rig.backend.admit_ranks(frozenset({2}), frozenset({1}))  # one of two comes back
    assert values(rig.backend.elastic.tensor)[:4] == [1, 3, 0, 24]
    assert rig.backend.dead_dp_ranks == frozenset({1})
