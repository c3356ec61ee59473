"""MC2 on the NPU backend: elastic_info in place, original MC2 arguments, densified ids."""

from __future__ import annotations

import pytest
import torch

from ftengine.backends.npu_mc2 import Mc2Communicator, Mc2Params
from ftengine.backends.npu_runtime import NpuRuntime
from ftengine.errors import PlacementError, PreconditionFailed
from ftengine.faults import Fault, FaultKind
from ftengine.placement.elastic import ElasticInfo
from ftengine.weights.index import CheckpointIndex
from tests.fakes.npu_host import NpuRig, make_npu_rig
from tests.fakes.npu_state import FakeNpuState, Mc2ArgumentError
from tests.unit.npu_fixtures import COMBINE, DISPATCH, TinyCheckpoints
from tests.unit.npu_fixtures import npu_state as npu_state
from tests.unit.npu_fixtures import tiny_checkpoints as tiny_checkpoints


@pytest.fixture(scope="module")
def index(tiny_checkpoints: TinyCheckpoints) -> CheckpointIndex:
    return tiny_checkpoints.index(layers=2, experts=16)


@pytest.fixture
def rig(npu_state: FakeNpuState, index: CheckpointIndex) -> NpuRig:
    """DP rank 0 of W = 4 with 8 local slots (16 logical + 16 redundant experts)."""
    return make_npu_rig(index, dp_size=4, dp_rank=0, num_redundant=16)


def scale_down(rig: NpuRig, dead: frozenset[int], epoch: int) -> None:
    rig.backend.quarantine(Fault(FaultKind.DEAD_PEER, info="ConnectionError"))
    rig.backend.mask_ranks(dead)
    rig.backend.rebuild_groups(frozenset(range(4)) - dead, epoch)
    rig.backend.repair_experts(dead)
    rig.backend.run_dummy_batch()


def values(tensor: torch.Tensor) -> list[int]:
    return [int(v) for v in tensor.tolist()]


def test_elastic_info_starts_all_zero(rig: NpuRig) -> None:
    assert values(rig.backend.elastic.tensor) == [0] * 12
    assert rig.backend.elastic.tensor.dtype == torch.int32


def test_masking_rank_1_gives_the_reference_example_in_place(rig: NpuRig) -> None:
    tensor = rig.backend.elastic.tensor
    ptr = tensor.data_ptr()
    rig.backend.quarantine(Fault(FaultKind.DEAD_PEER))
    rig.backend.mask_ranks(frozenset({1}))
    assert rig.backend.elastic.tensor is tensor and tensor.data_ptr() == ptr
    assert values(tensor) == [1, 3, 0, 24, 0, -1, 1, 2, 0, 2, 3, -1]
    rig.backend.mask_ranks(frozenset({1, 2}))  # cumulative: 4 -> 3 -> 2
    assert tensor.data_ptr() == ptr
    assert values(tensor) == [1, 2, 0, 16, 0, -1, -1, 1, 0, 3, -1, -1]


def test_the_op_docs_example_passes_the_fake_ops_validation(npu_state: FakeNpuState) -> None:
    # W = 8, ranks 2..5 dead, 1 shared-expert rank, 1 expert per MoE rank.
    elastic = ElasticInfo(8, 1, shared_expert_rank_num=1)
    elastic.update({2, 3, 4, 5})
    assert values(elastic.tensor) == [1, 4, 1, 3, 0, 1, -1, -1, -1, -1, 2, 3, 0, 1, 6, 7] + [-1] * 4
    params = Mc2Params(
        group_ep="ep", ep_world_size=8, ep_rank_id=6, moe_expert_num=7, shared_expert_rank_num=1
    )
    mc2 = Mc2Communicator(NpuRuntime.load(), params, elastic)
    x = torch.ones(1, 32, dtype=torch.bfloat16)
    out = mc2.dispatch(x, torch.tensor([[0, 1]]))
    assert out.expert_ids.tolist() == [[0, 1]]
    assert npu_state.of(DISPATCH)[0].kwargs["elastic_info"] is elastic.tensor


def test_dispatch_keeps_the_original_arguments_and_densifies_ids(
    rig: NpuRig, npu_state: FakeNpuState
) -> None:
    scale_down(rig, frozenset({3}), 1)
    npu_state.clear_calls()
    rig.host.step(rig.host.tokens(6))
    (dispatch,) = npu_state.of(DISPATCH)
    kw = dispatch.kwargs
    assert (kw["ep_world_size"], kw["ep_rank_id"], kw["moe_expert_num"], kw["global_bs"]) == (
        4,
        0,
        32,
        0,
    )
    assert kw["elastic_info"] is rig.backend.elastic.tensor
    assert kw["tp_world_size"] == 1
    ids = kw["expert_ids"]
    assert isinstance(ids, torch.Tensor) and ids.dtype == torch.int32
    physical = rig.host.physical_ids(6)
    assert not bool((physical // 8 == 3).any())  # the maps no longer route to rank 3
    assert torch.equal(ids.long(), physical)  # ranks 0..2 keep their dense numbers
    assert int(ids.max()) < 24
    (combine,) = npu_state.of(COMBINE)
    assert combine.kwargs["expert_ids"] is ids
    assert combine.kwargs["elastic_info"] is rig.backend.elastic.tensor


def test_ids_above_a_dead_rank_are_shifted_down(rig: NpuRig, npu_state: FakeNpuState) -> None:
    scale_down(rig, frozenset({1}), 1)
    mc2 = rig.host.mc2
    assert mc2 is not None
    physical = torch.tensor([[0, 16], [24, 31]])
    assert mc2.routing_ids(physical).tolist() == [[0, 8], [16, 23]]
    with pytest.raises(PlacementError, match=r"\[8\]"):
        mc2.routing_ids(torch.tensor([[0, 8]]))  # a slot of dead rank 1


def test_reference_densify_example(npu_state: FakeNpuState) -> None:
    elastic = ElasticInfo(4, 4)
    elastic.update({1})
    params = Mc2Params(group_ep="ep", ep_world_size=4, ep_rank_id=0, moe_expert_num=16)
    mc2 = Mc2Communicator(NpuRuntime.load(), params, elastic)
    assert mc2.routing_ids(torch.tensor([[0, 8, 12]])).tolist() == [[0, 4, 8]]


def test_healthy_path_passes_ids_unchanged(rig: NpuRig, npu_state: FakeNpuState) -> None:
    rig.host.step(rig.host.tokens(4))
    (dispatch,) = npu_state.of(DISPATCH)
    ids = dispatch.kwargs["expert_ids"]
    assert isinstance(ids, torch.Tensor)
    assert torch.equal(ids.long(), rig.host.physical_ids(4))
    assert values(rig.backend.elastic.tensor) == [0] * 12


def test_the_fake_rejects_routing_to_a_masked_rank(rig: NpuRig, npu_state: FakeNpuState) -> None:
    scale_down(rig, frozenset({2}), 1)
    mc2 = rig.host.mc2
    assert mc2 is not None
    kwargs = mc2.dispatch_kwargs(rig.host.tokens(1), torch.tensor([[0, 1]]))
    kwargs["expert_ids"] = torch.tensor([[0, 31]], dtype=torch.int32)  # not densified
    with pytest.raises(Mc2ArgumentError, match="expert_ids must be < 24"):
        NpuRuntime.load().dispatch_v2(kwargs)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("moe_expert_num", 30, "moe_expert_num % "),
        ("elastic_info", torch.zeros(11, dtype=torch.int32), "4 \\+ 2W"),
        ("elastic_info", torch.zeros(12, dtype=torch.int64), "int32"),
        ("ep_rank_id", 4, "ep_rank_id"),
        ("quant_mode", 1, "quant_mode"),
    ],
)
def test_the_fake_validates_like_the_op_docs(
    rig: NpuRig, npu_state: FakeNpuState, field: str, value: object, message: str
) -> None:
    mc2 = rig.host.mc2
    assert mc2 is not None
    kwargs = mc2.dispatch_kwargs(rig.host.tokens(2), rig.host.physical_ids(2))
    kwargs[field] = value
    with pytest.raises(Mc2ArgumentError, match=message):
        NpuRuntime.load().dispatch_v2(kwargs)


def test_mc2_params_validate_divisibility() -> None:
    with pytest.raises(PlacementError, match="divisible"):
        Mc2Params(group_ep="ep", ep_world_size=4, ep_rank_id=0, moe_expert_num=30)
    with pytest.raises(PlacementError, match="ep_rank_id"):
        Mc2Params(group_ep="ep", ep_world_size=4, ep_rank_id=4, moe_expert_num=32)


def test_mc2_refuses_an_elastic_info_of_another_shape(npu_state: FakeNpuState) -> None:
    params = Mc2Params(group_ep="ep", ep_world_size=4, ep_rank_id=0, moe_expert_num=32)
    with pytest.raises(PlacementError, match="elastic_info was built for"):
        Mc2Communicator(NpuRuntime.load(), params, ElasticInfo(4, 4))


def test_masking_refuses_this_rank_and_a_shrinking_dead_set(rig: NpuRig) -> None:
    with pytest.raises(PreconditionFailed, match="mask itself"):
        rig.backend.mask_ranks(frozenset({0}))
    rig.backend.mask_ranks(frozenset({1, 2}))
    with pytest.raises(PreconditionFailed, match="cumulative"):
        rig.backend.mask_ranks(frozenset({1}))


def test_dead_dp_columns_are_neutralized(rig: NpuRig) -> None:
    rig.backend.mask_ranks(frozenset({2}))
    tokens = torch.tensor([5, 6, 7, 8])
    rig.backend.neutralize_dp_columns(tokens, 0)
    assert tokens.tolist() == [5, 6, 0, 8]
