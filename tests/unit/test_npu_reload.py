"""Expert reload on the NPU: weights-module transforms, FRACTAL_NZ casts where vllm-ascend keeps
NZ, W8A8 scales, the MoE TP shard, all in place."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ftengine.backends.npu_reload import (
    ExpertSlotsStorage,
    NpuExpertReloader,
    NzPolicy,
    TpShard,
    shard_expert,
)
from ftengine.backends.npu_runtime import NpuRuntime
from ftengine.errors import WeightLoadError
from ftengine.faults import Fault, FaultKind
from ftengine.placement.planner import plan_redistribution
from ftengine.weights import layout
from ftengine.weights.index import CheckpointIndex, expert_tensor_name
from ftengine.weights.nz import ACL_FORMAT_FRACTAL_NZ
from ftengine.weights.slots import ExpertSlots
from tests.fakes.npu_host import NpuRig, make_npu_rig
from tests.fakes.npu_state import FakeNpuState
from tests.unit.npu_fixtures import INTERMEDIATE, MC2_HIDDEN, TinyCheckpoints
from tests.unit.npu_fixtures import npu_state as npu_state
from tests.unit.npu_fixtures import tiny_checkpoints as tiny_checkpoints

CAST = "npu_format_cast"
DEAD = frozenset({1})


@pytest.fixture(scope="module")
def bf16_path(tiny_checkpoints: TinyCheckpoints) -> Path:
    return tiny_checkpoints.path(layers=2, experts=8, hidden=MC2_HIDDEN)


@pytest.fixture(scope="module")
def w8a8_path(tiny_checkpoints: TinyCheckpoints) -> Path:
    return tiny_checkpoints.path(layers=2, experts=8, hidden=MC2_HIDDEN, quant="w8a8_dynamic")


@pytest.fixture(scope="module")
def reference_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """REFERENCE §6's example: expert 0 with gate (3, 4) all 2 and up (3, 4) all 3."""
    root = tmp_path_factory.mktemp("npu-reload-ref")
    config = {
        "hidden_size": 4,
        "moe_intermediate_size": 3,
        "num_experts": 1,
        "num_hidden_layers": 1,
        "torch_dtype": "bfloat16",
    }
    (root / "config.json").write_text(json.dumps(config))
    tensors = {
        expert_tensor_name(0, 0, "gate_proj"): torch.full((3, 4), 2, dtype=torch.bfloat16),
        expert_tensor_name(0, 0, "up_proj"): torch.full((3, 4), 3, dtype=torch.bfloat16),
        expert_tensor_name(0, 0, "down_proj"): torch.arange(12, dtype=torch.bfloat16).view(4, 3),
    }
    save_file(tensors, str(root / "model.safetensors"))
    return root


def repair(rig: NpuRig) -> tuple[int, int, int]:
    rig.backend.quarantine(Fault(FaultKind.DEAD_PEER, info="ConnectionError"))
    rig.backend.mask_ranks(DEAD)
    rig.backend.rebuild_groups(frozenset(range(4)) - DEAD, 1)
    report = rig.backend.repair_experts(DEAD)
    rig.backend.run_dummy_batch()
    return report.reloads, report.reload_lower_bound, report.bytes_reloaded


def expected_w13(index: CheckpointIndex, layer: int, expert: int) -> torch.Tensor:
    gate = index.read(expert_tensor_name(layer, expert, "gate_proj"))
    up = index.read(expert_tensor_name(layer, expert, "up_proj"))
    return layout.to_w13(gate, up)


def test_reference_w13_layout_in_nd_storage(npu_state: FakeNpuState, reference_path: Path) -> None:
    index = CheckpointIndex.open(reference_path)
    slots = ExpertSlots.allocate(index, 1, 2)
    before = dict(slots.data_ptrs())
    stats = NpuExpertReloader(NpuRuntime.load(), torch.device("cpu")).reload(
        index, ExpertSlotsStorage(slots), [(0, 1, 0)]
    )
    assert slots.w13[0, 1, 0].tolist() == [2, 2, 2, 3, 3, 3]
    assert torch.equal(slots.w2[0, 1], torch.arange(12, dtype=torch.bfloat16).view(4, 3).t())
    assert slots.data_ptrs() == before
    assert (stats.experts, stats.format_casts) == (1, 0)
    assert npu_state.of(CAST) == []


def test_reference_w13_layout_through_npu_format_cast(
    npu_state: FakeNpuState, reference_path: Path
) -> None:
    # weight_nz_mode 2: vllm-ascend keeps bf16 expert weights in NZ too.
    index = CheckpointIndex.open(reference_path)
    slots = ExpertSlots.allocate(index, 1, 1)
    before = dict(slots.data_ptrs())
    stats = NpuExpertReloader(NpuRuntime.load(), torch.device("cpu")).reload(
        index, ExpertSlotsStorage(slots, nz=NzPolicy(2)), [(0, 0, 0)]
    )
    assert slots.data_ptrs() == before
    assert slots.w13[0, 0, 0].tolist() == [2, 2, 2, 3, 3, 3]
    casts = npu_state.of(CAST)
    assert [call.args[1] for call in casts] == [ACL_FORMAT_FRACTAL_NZ] * 2
    assert stats.format_casts == 2
    # torch_npu casts, and keeps, the logical size: w13 [H, 2I], w2 [I, H]
    shapes = [tuple(call.args[0].shape) for call in casts if isinstance(call.args[0], torch.Tensor)]
    assert shapes == [(4, 6), (3, 4)]


def test_nz_slot_storage_in_the_cpu_reference_layout_is_refused(reference_path: Path) -> None:
    slots = ExpertSlots.allocate(CheckpointIndex.open(reference_path), 1, 1, nz=True)
    with pytest.raises(WeightLoadError, match="allocate the ExpertSlots with nz=False"):
        ExpertSlotsStorage(slots)


@pytest.mark.parametrize(
    ("policy", "int8", "bf16"),
    [(NzPolicy(0), True, False), (NzPolicy(1), True, False), (NzPolicy(2), True, True)],
)
def test_the_nz_policy_is_vllm_ascends(policy: NzPolicy, int8: bool, bf16: bool) -> None:
    assert policy.applies(torch.int8) is int8
    assert policy.applies(torch.bfloat16) is bf16 and policy.applies(torch.float16) is bf16
    assert not policy.applies(torch.float32)


@pytest.mark.parametrize(("mode", "casts_per_expert"), [(1, 0), (2, 2)])
def test_every_survivor_reloads_its_share_in_place(
    npu_state: FakeNpuState, bf16_path: Path, mode: int, casts_per_expert: int
) -> None:
    index = CheckpointIndex.open(bf16_path)
    total = 0
    for rank in sorted(frozenset(range(4)) - DEAD):
        rig = make_npu_rig(index, dp_size=4, dp_rank=rank, num_redundant=4, nz=NzPolicy(mode))
        plan = plan_redistribution(rig.host.placement().clone(), DEAD)
        mine = plan.local_assignments(rank)
        before = dict(rig.host.slots.data_ptrs())
        p2l_ptr = rig.host.placement().physical_to_logical_map.data_ptr()
        casts = len(npu_state.of(CAST))
        reloads, lower_bound, nbytes = repair(rig)
        assert reloads == len(mine) and lower_bound == plan.lower_bound
        assert rig.host.slots.data_ptrs() == before
        assert rig.host.placement().physical_to_logical_map.data_ptr() == p2l_ptr
        assert len(npu_state.of(CAST)) - casts == casts_per_expert * len(mine)
        assert (nbytes > 0) == bool(mine)
        for layer, slot, expert in mine:
            assert torch.equal(
                rig.host.slots.w13_nd(layer, slot), expected_w13(index, layer, expert)
            )
            p2l = rig.host.placement().physical_to_logical_map
            assert int(p2l[layer, rank * rig.host.placement().local_slots + slot]) == expert
        total += reloads
    assert total == plan.reloads >= plan.lower_bound > 0


def test_only_the_needed_experts_are_read(npu_state: FakeNpuState, bf16_path: Path) -> None:
    index = CheckpointIndex.open(bf16_path)
    slots = ExpertSlots.allocate(index, index.num_layers, 3)
    stats = NpuExpertReloader(NpuRuntime.load(), torch.device("cpu")).reload(
        index, ExpertSlotsStorage(slots), [(1, 2, 5)]
    )
    one_expert = sum(
        index.info(expert_tensor_name(1, 5, proj)).nbytes
        for proj in ("gate_proj", "up_proj", "down_proj")
    )
    assert one_expert <= stats.bytes_read < index.expert_bytes_total // 4


def test_w8a8_reload_casts_int8_to_nz_and_writes_fp32_and_int64_scales(
    npu_state: FakeNpuState, w8a8_path: Path
) -> None:
    index = CheckpointIndex.open(w8a8_path)
    assert index.quant == "w8a8_dynamic"
    slots = ExpertSlots.allocate(index, index.num_layers, 2, fused_scales=True)
    before = dict(slots.data_ptrs())
    NpuExpertReloader(NpuRuntime.load(), torch.device("cpu")).reload(
        index, ExpertSlotsStorage(slots), [(1, 0, 3)]
    )
    assert slots.data_ptrs() == before
    assert torch.equal(slots.w13_nd(1, 0), expected_w13(index, 1, 3))
    scale = layout.to_w13_scale(
        index.read(expert_tensor_name(1, 3, "gate_proj", "weight_scale")),
        index.read(expert_tensor_name(1, 3, "up_proj", "weight_scale")),
    )
    assert slots.w13_scale is not None and slots.w13_scale.dtype == torch.float32
    assert torch.equal(slots.w13_scale[1, 0], scale)
    assert slots.w2_scale is not None and slots.w2_scale.dtype == index.dtype
    assert slots.w13_scale_int64 is not None
    assert torch.equal(slots.w13_scale_int64[1, 0], layout.scale_to_int64(scale))
    casts = npu_state.of(CAST)
    assert len(casts) == 2
    assert all(isinstance(c.args[0], torch.Tensor) and c.args[0].dtype == torch.int8 for c in casts)


def test_w8a8_scale_down_end_to_end(npu_state: FakeNpuState, w8a8_path: Path) -> None:
    index = CheckpointIndex.open(w8a8_path)
    rig = make_npu_rig(index, dp_size=4, dp_rank=0, num_redundant=4, fused_scales=True)
    before = dict(rig.host.slots.data_ptrs())
    repair(rig)
    assert rig.host.slots.data_ptrs() == before


def test_a_broken_shard_leaves_the_device_storage_untouched(
    npu_state: FakeNpuState, bf16_path: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(bf16_path, broken)
    index = CheckpointIndex.open(broken)
    shard = index.info(expert_tensor_name(1, 7, "down_proj")).file
    good = index.info(expert_tensor_name(0, 0, "down_proj")).file
    assert shard != good, "the test needs the two experts in different shards"
    slots = ExpertSlots.allocate(index, index.num_layers, 2)
    slots.w13.fill_(1)
    snapshot = {name: t.clone() for name, t in slots.tensors().items()}
    with shard.open("r+b") as handle:
        handle.truncate(shard.stat().st_size - 64)
    with pytest.raises(WeightLoadError):
        NpuExpertReloader(NpuRuntime.load(), torch.device("cpu")).reload(
            index, ExpertSlotsStorage(slots), [(0, 0, 0), (1, 1, 7)]
        )
    assert all(torch.equal(slots.tensors()[name], t) for name, t in snapshot.items())
    assert npu_state.of(CAST) == []


def test_a_slot_without_weight_storage_is_refused(npu_state: FakeNpuState, bf16_path: Path) -> None:
    class NoW2:
        nz = NzPolicy()
        tp = TpShard()

        def slot(self, layer: int, slot: int) -> dict[str, torch.Tensor]:
            return {"w13": torch.zeros(32, 32)}

    index = CheckpointIndex.open(bf16_path)
    reloader = NpuExpertReloader(NpuRuntime.load(), torch.device("cpu"))
    with pytest.raises(WeightLoadError, match="no w2 storage"):
        reloader.reload(index, NoW2(), [(0, 0, 1)])


def test_a_w8a8_slot_without_the_scales_the_forward_reads_is_refused(
    npu_state: FakeNpuState, w8a8_path: Path
) -> None:
    class WeightsOnly:
        """The weights under their new names, the scales nowhere (as if written to the old
        ``w13_weight_scale``, which vllm-ascend's v2 + EPLB forward no longer reads)."""

        nz = NzPolicy()
        tp = TpShard()

        def slot(self, layer: int, slot: int) -> dict[str, torch.Tensor]:
            return {
                "w13": torch.zeros(MC2_HIDDEN, 32, dtype=torch.int8),
                "w2": torch.zeros(16, MC2_HIDDEN, dtype=torch.int8),
            }

    index = CheckpointIndex.open(w8a8_path)
    reloader = NpuExpertReloader(NpuRuntime.load(), torch.device("cpu"))
    with pytest.raises(WeightLoadError, match="no w13_scale, w2_scale storage"):
        reloader.reload(index, WeightsOnly(), [(0, 0, 1)])


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_tp_sharded_slot_gets_its_share_of_every_expert(
    npu_state: FakeNpuState, w8a8_path: Path, tp_rank: int
) -> None:
    index = CheckpointIndex.open(w8a8_path)
    half = INTERMEDIATE // 2
    slots = ExpertSlots.empty(
        hidden=MC2_HIDDEN,
        intermediate=half,
        dtype=index.dtype,
        num_layers=index.num_layers,
        local_slots=1,
        quant=index.quant,
    )
    storage = ExpertSlotsStorage(slots, tp=TpShard(rank=tp_rank, size=2))
    NpuExpertReloader(NpuRuntime.load(), torch.device("cpu")).reload(index, storage, [(1, 0, 6)])
    full = ExpertSlots.allocate(index, index.num_layers, 1)
    NpuExpertReloader(NpuRuntime.load(), torch.device("cpu")).reload(
        index, ExpertSlotsStorage(full), [(1, 0, 6)]
    )
    cols = list(range(tp_rank * half, (tp_rank + 1) * half))
    w13_cols = cols + [INTERMEDIATE + c for c in cols]  # this shard of gate, then of up
    assert torch.equal(slots.w13[1, 0], full.w13[1, 0][:, w13_cols])
    assert torch.equal(slots.w2[1, 0], full.w2[1, 0][cols])
    assert slots.w13_scale is not None and full.w13_scale is not None
    assert torch.equal(slots.w13_scale[1, 0], full.w13_scale[1, 0][w13_cols])
    assert slots.w2_scale is not None and full.w2_scale is not None
    assert torch.equal(slots.w2_scale[1, 0], full.w2_scale[1, 0])  # [H]: not sharded


def test_a_slot_of_another_shape_is_refused_before_anything_is_written(
    npu_state: FakeNpuState, bf16_path: Path
) -> None:
    index = CheckpointIndex.open(bf16_path)
    half = ExpertSlots.empty(
        hidden=MC2_HIDDEN,
        intermediate=INTERMEDIATE // 2,
        dtype=index.dtype,
        num_layers=index.num_layers,
        local_slots=2,
    )
    half.w13.fill_(1)
    reloader = NpuExpertReloader(NpuRuntime.load(), torch.device("cpu"))
    with pytest.raises(WeightLoadError, match=r"w13: the checkpoint's expert gives \(1024, 32\)"):
        reloader.reload(index, ExpertSlotsStorage(half), [(0, 0, 0), (0, 1, 1)])
    assert bool((half.w13 == 1).all())


def test_shards_that_do_not_divide_are_refused() -> None:
    with pytest.raises(WeightLoadError, match="does not divide into 3"):
        shard_expert({"w2": torch.zeros(16, 4)}, TpShard(rank=0, size=3), 16)
