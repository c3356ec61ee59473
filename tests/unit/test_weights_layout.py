"""Device-layout transforms (REFERENCE §6): w13 / w2, W8A8 scales, offsets, int64 scales."""

from __future__ import annotations

import pytest
import torch

from ftengine.errors import WeightLoadError
from ftengine.weights import layout


def test_reference_w13_example() -> None:
    gate = torch.full((3, 4), 2.0)
    up = torch.full((3, 4), 3.0)
    w13 = layout.to_w13(gate, up)
    assert w13.shape == (4, 6)
    assert w13[0].tolist() == [2, 2, 2, 3, 3, 3]
    assert all(row.tolist() == [2, 2, 2, 3, 3, 3] for row in w13)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
def test_w13_is_transpose_of_gate_then_up(dtype: torch.dtype) -> None:
    gate = (torch.randn(5, 7) * 20).to(dtype)
    up = (torch.randn(5, 7) * 20).to(dtype)
    w13 = layout.to_w13(gate, up)
    assert w13.dtype == dtype
    assert torch.equal(w13, torch.cat((gate, up)).t())
    assert torch.equal(w13[:, :5], gate.t())
    assert torch.equal(w13[:, 5:], up.t())


def test_w13_into_non_contiguous_view_and_fused_form_agree() -> None:
    gate, up = torch.randn(6, 8), torch.randn(6, 8)
    storage = torch.zeros(8, 20)
    view = storage[:, 4:16]  # [8, 12], not contiguous
    layout.write_w13(view, gate, up)
    assert torch.equal(view, layout.to_w13(gate, up))
    assert torch.count_nonzero(storage[:, :4]) == 0
    assert torch.count_nonzero(storage[:, 16:]) == 0
    fused = torch.zeros(8, 12)
    layout.write_w13_fused(fused, torch.cat((gate, up)))
    assert torch.equal(fused, layout.to_w13(gate, up))


def test_w2_is_transpose_of_down() -> None:
    down = torch.randn(8, 3)  # [H, I]
    w2 = layout.to_w2(down)
    assert w2.shape == (3, 8)
    assert torch.equal(w2, down.t())


def test_wrong_shapes_are_weight_load_errors() -> None:
    with pytest.raises(WeightLoadError, match=r"up_proj must have shape \[3, 4\]"):
        layout.write_w13(torch.zeros(4, 6), torch.zeros(3, 4), torch.zeros(4, 3))
    with pytest.raises(WeightLoadError, match="must have shape"):
        layout.write_w2(torch.zeros(3, 8), torch.zeros(3, 8))


def test_w8a8_scales_dtypes_and_shapes() -> None:
    gate_scale = torch.full((3, 1), 0.5, dtype=torch.bfloat16)
    up_scale = torch.full((3, 1), 0.25, dtype=torch.bfloat16)
    w13_scale = layout.to_w13_scale(gate_scale, up_scale)
    assert w13_scale.dtype == torch.float32
    assert w13_scale.tolist() == [0.5, 0.5, 0.5, 0.25, 0.25, 0.25]
    fused = layout.to_w13_scale(torch.cat((gate_scale, up_scale)))
    assert torch.equal(fused, w13_scale)
    w2_scale = layout.to_w2_scale(torch.full((4, 1), 0.125), torch.bfloat16)
    assert w2_scale.dtype == torch.bfloat16
    assert w2_scale.shape == (4,)
    offsets = layout.flatten_offset(torch.zeros(3, 1), torch.ones(3, 1), dtype=torch.float16)
    assert offsets.tolist() == [0, 0, 0, 1, 1, 1]
    assert offsets.dtype == torch.float16


def test_scale_to_int64_widens_fp32_bits() -> None:
    scales = torch.tensor([1.0, 0.5, 2.0**-7], dtype=torch.float32)
    bits = layout.scale_to_int64(scales)
    assert bits.dtype == torch.int64
    assert bits.tolist() == [0x3F800000, 0x3F000000, 0x3C000000]
    # The low 32 bits round-trip to the same float32 values.
    assert torch.equal(bits.to(torch.int32).view(torch.float32), scales)
