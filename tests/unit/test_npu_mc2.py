"""MC2 on the NPU backend: elastic_info in place, original MC2 arguments, routing tables
densified once in place; the fake ops take exactly the published schemas and SoC limits."""

from __future__ import annotations

import pytest
import torch

from ftengine.backends.npu_mc2 import Mc2Communicator, Mc2Params, densify_routing_table
from ftengine.backends.npu_runtime import NpuRuntime
from ftengine.errors import PlacementError, PreconditionFailed
from ftengine.faults import Fault, FaultKind
from ftengine.placement.elastic import ElasticInfo, densify_routing_ids
from ftengine.weights.index import CheckpointIndex
from tests.fakes.npu_host import NpuRig, make_npu_rig
from tests.fakes.npu_routing import build_routing_table
from tests.fakes.npu_state import AclnnMissing, FakeNpuState, Mc2ArgumentError
from tests.unit.npu_fixtures import COMBINE, DISPATCH, MC2_HIDDEN, TinyCheckpoints
from tests.unit.npu_fixtures import npu_state as npu_state
from tests.unit.npu_fixtures import tiny_checkpoints as tiny_checkpoints


@pytest.fixture(scope="module")
def index(tiny_checkpoints: TinyCheckpoints) -> CheckpointIndex:
    return tiny_checkpoints.index(layers=2, experts=16, hidden=MC2_HIDDEN)


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
    npu_state.add_hccl_group("ep")
    mc2 = Mc2Communicator(NpuRuntime.load(), params, elastic)
    x = torch.ones(1, MC2_HIDDEN, dtype=torch.bfloat16)
    out = mc2.dispatch(x, torch.tensor([[0, 1]]))
    assert out.expert_ids.tolist() == [[0, 1]]
    assert npu_state.of(DISPATCH)[0].kwargs["elastic_info"] is elastic.tensor


def test_dispatch_keeps_the_original_arguments_and_reads_the_densified_table(
    rig: NpuRig, npu_state: FakeNpuState
) -> None:
    tables = [table.data_ptr() for table in rig.host.routing]
    scale_down(rig, frozenset({1}), 1)
    assert [table.data_ptr() for table in rig.host.routing] == tables  # densified in place
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
    assert torch.equal(ids, rig.host.expert_ids(6))
    # the table is the maps' routing (which no longer name rank 1) renumbered densely
    placement = rig.host.placement()
    physical = build_routing_table(
        placement.logical_to_physical_map[0], placement.logical_replica_count[0], 0
    )
    assert not bool((physical // 8 == 1).any())
    assert torch.equal(rig.host.routing[0], densify_routing_ids(physical, [0, -1, 1, 2], 8))
    assert int(ids.max()) < 24
    (combine,) = npu_state.of(COMBINE)
    assert combine.kwargs["expert_ids"] is ids
    assert combine.kwargs["elastic_info"] is rig.backend.elastic.tensor


def test_a_routing_table_is_densified_in_place_ids_above_a_dead_rank_shifted_down() -> None:
    table = torch.tensor([[0, 16], [24, 31]], dtype=torch.int32)
    ptr = table.data_ptr()
    densify_routing_table(table, torch.tensor([0, -1, 1, 2]), 8)  # rank 1 of 4 dead
    assert table.tolist() == [[0, 8], [16, 23]] and table.data_ptr() == ptr
    assert table.dtype == torch.int32
    with pytest.raises(PlacementError, match=r"\[8\]"):
        densify_routing_table(torch.tensor([[0, 8]]), torch.tensor([0, -1, 1, 2]), 8)


def test_reference_densify_example() -> None:
    table = torch.tensor([[0, 8, 12]])
    densify_routing_table(table, torch.tensor([0, -1, 1, 2]), 4)
    assert table.tolist() == [[0, 4, 8]]


def test_a_table_naming_a_dead_rank_is_left_unchanged() -> None:
    table = torch.tensor([[0, 5]])
    with pytest.raises(PlacementError):
        densify_routing_table(table, torch.tensor([0, -1]), 4)
    assert table.tolist() == [[0, 5]]


def test_healthy_path_passes_the_tables_physical_ids(rig: NpuRig, npu_state: FakeNpuState) -> None:
    rig.host.step(rig.host.tokens(4))
    (dispatch,) = npu_state.of(DISPATCH)
    ids = dispatch.kwargs["expert_ids"]
    assert isinstance(ids, torch.Tensor)
    placement = rig.host.placement()
    physical = build_routing_table(
        placement.logical_to_physical_map[0], placement.logical_replica_count[0], 0
    )
    rows = torch.arange(4).unsqueeze(1) % physical.shape[0]
    assert torch.equal(ids, physical[rows, rig.host.logical_ids(4)])
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
    kwargs = mc2.dispatch_kwargs(rig.host.tokens(2), rig.host.expert_ids(2))
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


def test_a_misspelt_keyword_to_an_mc2_op_fails(rig: NpuRig, npu_state: FakeNpuState) -> None:
    mc2 = rig.host.mc2
    assert mc2 is not None
    runtime = NpuRuntime.load()
    kwargs = mc2.dispatch_kwargs(rig.host.tokens(2), rig.host.expert_ids(2))
    kwargs["elastic_infos"] = kwargs.pop("elastic_info")
    with pytest.raises(TypeError, match="unexpected keyword argument 'elastic_infos'"):
        runtime.dispatch_v2(kwargs)
    dispatched = mc2.dispatch(rig.host.tokens(2), rig.host.expert_ids(2))
    scales = torch.full((2, 2), 0.5)
    combine = mc2.combine_kwargs(dispatched, dispatched.expand_x, scales)
    combine["quant_mode"] = 0  # a dispatch-only parameter: combine_v2 has comm_quant_mode
    with pytest.raises(TypeError, match="unexpected keyword argument 'quant_mode'"):
        runtime.combine_v2(combine)


def test_keyword_only_parameters_cannot_be_passed_positionally(npu_state: FakeNpuState) -> None:
    import torch_npu

    npu_state.add_hccl_group("ep")
    x = torch.ones(1, MC2_HIDDEN, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1]], dtype=torch.int32)
    out = torch_npu.npu_moe_distribute_dispatch_v2(x, ids, "ep", 4, 0, 32)
    assert len(out) == 7
    with pytest.raises(TypeError, match="positional argument"):
        torch_npu.npu_moe_distribute_dispatch_v2(x, ids, "ep", 4, 0, 32, None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"x": torch.ones(2, 512, dtype=torch.bfloat16)}, "A3: H must be in \\[1024, 8192\\]"),
        ({"x": torch.ones(2, 9216, dtype=torch.bfloat16)}, "A3: H must be in"),
        ({"expert_scales": torch.ones(2, 2)}, "A3: expert_scales is not supported"),
    ],
)
def test_the_fake_enforces_atlas_a3_limits(
    rig: NpuRig, npu_state: FakeNpuState, change: dict[str, object], message: str
) -> None:
    mc2 = rig.host.mc2
    assert mc2 is not None
    kwargs = mc2.dispatch_kwargs(rig.host.tokens(2), rig.host.expert_ids(2))
    kwargs.update(change)
    with pytest.raises(Mc2ArgumentError, match=message):
        NpuRuntime.load().dispatch_v2(kwargs)


def test_a3_takes_at_most_512_tokens(rig: NpuRig, npu_state: FakeNpuState) -> None:
    mc2 = rig.host.mc2
    assert mc2 is not None
    rig.host.step(rig.host.tokens(512))
    kwargs = mc2.dispatch_kwargs(rig.host.tokens(513), rig.host.expert_ids(513))
    with pytest.raises(Mc2ArgumentError, match="A3: BS must be in \\(0, 512\\]"):
        NpuRuntime.load().dispatch_v2(kwargs)


def test_a2_refuses_elastic_info(rig: NpuRig, npu_state: FakeNpuState) -> None:
    mc2 = rig.host.mc2
    assert mc2 is not None
    npu_state.soc = "A2"
    kwargs = mc2.dispatch_kwargs(rig.host.tokens(2), rig.host.expert_ids(2))
    with pytest.raises(Mc2ArgumentError, match="A2: elastic_info must be None"):
        NpuRuntime.load().dispatch_v2(kwargs)
    kwargs["elastic_info"] = None
    assert len(NpuRuntime.load().dispatch_v2(kwargs)) == 7


def test_elastic_info_needs_the_aclnn_v3_kernels(rig: NpuRig, npu_state: FakeNpuState) -> None:
    mc2 = rig.host.mc2
    assert mc2 is not None
    npu_state.aclnn.clear()
    kwargs = mc2.dispatch_kwargs(rig.host.tokens(2), rig.host.expert_ids(2))
    with pytest.raises(AclnnMissing, match="aclnnMoeDistributeDispatchV3"):
        NpuRuntime.load().dispatch_v2(kwargs)
    kwargs["elastic_info"] = None
    assert len(NpuRuntime.load().dispatch_v2(kwargs)) == 7
