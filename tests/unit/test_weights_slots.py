"""ExpertSlots: REFERENCE §6 storage shapes and dequantised float views for CPU compute."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ftengine.errors import WeightLoadError
from ftengine.weights.checkpoint_gen import make_checkpoint
from ftengine.weights.index import CheckpointIndex, expert_tensor_name
from ftengine.weights.nz import nz_shape
from ftengine.weights.reload import load_experts_into_slots
from ftengine.weights.slots import ExpertSlots, SlotWeights

H, INTER = 64, 32
SIZES = {"layers": 2, "experts": 4, "hidden": H, "intermediate": INTER}


def _make(path: Path, **options: Any) -> Path:
    """A tiny checkpoint of the module's sizes (``options`` go to make_checkpoint)."""
    return make_checkpoint(path, **{**SIZES, **options})


def _empty(**options: Any) -> ExpertSlots:
    """Storage of the module's sizes: bfloat16, 2 layers x 4 slots unless ``options`` say."""
    defaults = {"dtype": torch.bfloat16, "num_layers": 2, "local_slots": 4}
    return ExpertSlots.empty(hidden=H, intermediate=INTER, **{**defaults, **options})


def test_unquantized_storage_shapes() -> None:
    slots = _empty(dtype=torch.float16, num_layers=3, local_slots=5)
    assert slots.w13.shape == (3, 5, H, 2 * INTER) and slots.w13.dtype == torch.float16
    assert slots.w2.shape == (3, 5, INTER, H) and slots.w2.dtype == torch.float16
    assert set(slots.tensors()) == {"w13", "w2"}
    assert (slots.num_layers, slots.local_slots) == (3, 5)


def test_w8a8_storage_shapes_and_dtypes() -> None:
    slots = _empty(quant="w8a8_dynamic", fused_scales=True)
    assert slots.w13.dtype == torch.int8 and slots.w2.dtype == torch.int8
    assert slots.w13_scale is not None and slots.w2_scale is not None
    assert slots.w13_scale.shape == (2, 4, 2 * INTER) and slots.w13_scale.dtype == torch.float32
    assert slots.w2_scale.shape == (2, 4, H) and slots.w2_scale.dtype == torch.bfloat16
    assert slots.w13_offset is not None and slots.w13_offset.shape == (2, 4, 2 * INTER)
    assert slots.w2_scale_int64 is not None and slots.w2_scale_int64.dtype == torch.int64
    assert len(slots.tensors()) == 8


def test_nz_storage_shapes() -> None:
    slots = _empty(num_layers=1, local_slots=2, nz=True, quant="w8a8_dynamic")
    assert slots.w13.shape == (1, 2, *nz_shape((H, 2 * INTER), torch.int8))
    assert slots.w2.shape == (1, 2, *nz_shape((INTER, H), torch.int8))


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(WeightLoadError, match="positive sizes"):
        _empty(num_layers=0, local_slots=1)


def _ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate_up = x @ w13
    gate, up = gate_up[:, :INTER], gate_up[:, INTER:]
    return (torch.nn.functional.silu(gate) * up) @ w2


def test_dequantised_w8a8_slot_matches_unquantised_reference(tmp_path: Path) -> None:
    ref_index = CheckpointIndex.open(_make(tmp_path / "f", dtype="float32"))
    q_index = CheckpointIndex.open(_make(tmp_path / "q", quant="w8a8_dynamic"))
    plan = [(1, 0, 3), (1, 1, 0)]
    ref = ExpertSlots.allocate(ref_index, 2, 2)
    quant = ExpertSlots.allocate(q_index, 2, 2)
    load_experts_into_slots(ref_index, ref, plan)
    load_experts_into_slots(q_index, quant, plan)
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(1))
    for slot in (0, 1):
        w13_ref, w2_ref = ref.w13_float(1, slot), ref.w2_float(1, slot)
        w13_q, w2_q = quant.w13_float(1, slot), quant.w2_float(1, slot)
        assert w13_q.dtype == torch.float32 and w13_q.shape == (H, 2 * INTER)
        projected_ref, projected_q = x @ w13_ref, x @ w13_q
        rel = (projected_q - projected_ref).norm() / projected_ref.norm()
        assert rel < 0.02, f"w13 relative error {rel:.4f} beyond int8 tolerance"
        out_ref, out_q = _ffn(x, w13_ref, w2_ref), _ffn(x, w13_q, w2_q)
        rel = (out_q - out_ref).norm() / out_ref.norm()
        assert rel < 0.03, f"expert output relative error {rel:.4f} beyond int8 tolerance"
        # And the int8 really matters: without the scales the result is far off.
        raw = x @ quant.w13_nd(1, slot).float()
        assert (raw - projected_ref).norm() / projected_ref.norm() > 1.0


def test_nz_float_view_equals_nd_float_view(tmp_path: Path) -> None:
    index = CheckpointIndex.open(_make(tmp_path / "q", quant="w8a8_dynamic"))
    nd = ExpertSlots.allocate(index, 2, 2)
    nz = ExpertSlots.allocate(index, 2, 2, nz=True)
    plan = [(0, 1, 2), (1, 0, 1)]
    load_experts_into_slots(index, nd, plan)
    load_experts_into_slots(index, nz, plan)
    for layer, slot, _ in plan:
        assert torch.equal(nz.w13_nd(layer, slot), nd.w13_nd(layer, slot))
        assert torch.equal(nz.w2_float(layer, slot), nd.w2_float(layer, slot))
    w13, w2 = nz.layer_float(0)
    assert w13.shape == (2, H, 2 * INTER) and w2.shape == (2, INTER, H)
    assert torch.equal(w13[1], nd.w13_float(0, 1))


_ROLES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_PARAMS = {"weight": "", "weight_scale": "_scale", "weight_offset": "_offset"}


def _expert_parts(index: CheckpointIndex, layer: int, expert: int) -> dict[str, torch.Tensor]:
    """One W8A8 expert's tensors by SlotWeights field, read straight from the checkpoint."""
    return {
        role + suffix: index.read(expert_tensor_name(layer, expert, projection, param))
        for projection, role in _ROLES.items()
        for param, suffix in _PARAMS.items()
    }


@pytest.mark.parametrize(
    "broken",
    [
        {"down_scale": None},
        {"up_scale": None},
        {"down": torch.zeros(H, INTER + 1, dtype=torch.int8)},
        {"up": torch.zeros(INTER, H + 1, dtype=torch.int8)},
        {"gate": torch.zeros(INTER, H)},  # float weights for int8 storage
        {"gate_scale": torch.ones(INTER + 1, 1)},
        {"down_offset": torch.zeros(H + 1, 1)},
    ],
    ids=[
        "no-down-scale",
        "no-up-scale",
        "down-shape",
        "up-shape",
        "gate-dtype",
        "scale-shape",
        "offset-shape",
    ],
)
def test_write_slot_checks_everything_before_writing(
    tmp_path: Path, broken: dict[str, torch.Tensor | None]
) -> None:
    index = CheckpointIndex.open(_make(tmp_path / "q", quant="w8a8_dynamic"))
    slots = ExpertSlots.allocate(index, 2, 2, fused_scales=True)
    load_experts_into_slots(index, slots, [(0, 0, 1), (0, 1, 2)])
    before = {name: tensor.clone() for name, tensor in slots.tensors().items()}
    fields: dict[str, Any] = {**_expert_parts(index, 0, 3), **broken}
    weights = SlotWeights(**fields)
    with pytest.raises(WeightLoadError, match="expected"):
        slots.write_slot(0, 0, weights)
    for name, tensor in slots.tensors().items():
        assert torch.equal(tensor, before[name]), f"{name} was written before the error"
    slots.write_slot(0, 0, SlotWeights(**_expert_parts(index, 0, 3)))  # the good one still fits
    assert not torch.equal(slots.w13[0, 0], before["w13"][0, 0])


def test_nz_write_casts_float_weights_like_the_nd_write() -> None:
    gen = torch.Generator().manual_seed(3)
    weights = SlotWeights(
        gate=torch.randn(INTER, H, generator=gen),
        up=torch.randn(INTER, H, generator=gen),
        down=torch.randn(H, INTER, generator=gen),
    )  # float32 weights for bfloat16 storage: both layouts cast them on write
    nd, nz = _empty(), _empty(nz=True)
    nd.write_slot(1, 2, weights)
    nz.write_slot(1, 2, weights)
    assert torch.equal(nz.w13_nd(1, 2), nd.w13_nd(1, 2))
    assert torch.equal(nz.w2_nd(1, 2), nd.w2_nd(1, 2))
    assert nd.w2_nd(1, 2).abs().sum() > 0
