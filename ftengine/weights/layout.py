"""Per-slot device-layout transforms for MoE expert weights (REFERENCE §6).

On disk a projection is ``[out, in]``: gate/up ``[I, H]``, down ``[H, I]``. In a slot,
``w13 = [H, 2I]`` (gate columns first, then up) and ``w2 = [I, H]``. W8A8-dynamic scales
become ``w13_scale`` float32 ``[2I]`` and ``w2_scale`` in the model dtype ``[H]``; offsets
are flattened (the MoE forward ignores them). The ``write_*`` functions transform straight
into existing storage in one pass over memory; the ``to_*`` functions return new tensors.
"""

from __future__ import annotations

import torch

from ftengine.errors import WeightLoadError


def _check_shape(what: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise WeightLoadError(
            f"{what} must have shape {list(expected)}, found {list(tensor.shape)}; "
            "check the checkpoint's hidden_size / moe_intermediate_size"
        )


def copy_transposed(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Write ``src.T`` (``src`` [a, b]) into the 2-D view ``dst`` [b, a] in one pass.

    When ``dst`` is contiguous and ``src`` row-major, torch takes its blocked transpose.
    """
    _check_shape("transposed copy source", src, (dst.shape[1], dst.shape[0]))
    dst.copy_(src.t())


def write_w13(dst: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    """Write gate [I, H] and up [I, H] into ``dst`` [H, 2I]: gate columns first, then up."""
    hidden, two_i = dst.shape
    inter = two_i // 2
    _check_shape("gate_proj", gate, (inter, hidden))
    _check_shape("up_proj", up, (inter, hidden))
    if dst.is_contiguous():
        # Stacking gate and up (a plain copy that stays in cache) lets one blocked transpose
        # fill the whole slot; two strided half-writes were 1.3-1.6x slower on CPU.
        copy_transposed(dst, torch.cat((gate, up)))
        return
    copy_transposed(dst[:, :inter], gate)
    copy_transposed(dst[:, inter:], up)


def write_w13_fused(dst: torch.Tensor, gate_up: torch.Tensor) -> None:
    """Write a fused gate_up [2I, H] (gate rows, then up rows) into ``dst`` [H, 2I]."""
    copy_transposed(dst, gate_up)


def write_w2(dst: torch.Tensor, down: torch.Tensor) -> None:
    """Write down [H, I] into ``dst`` [I, H]."""
    copy_transposed(dst, down)


def to_w13(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Build w13 [H, 2I] from gate [I, H] and up [I, H] (gate columns first).

    Example: gate ``(3, 4)`` all 2 and up ``(3, 4)`` all 3 -> row 0 is ``[2, 2, 2, 3, 3, 3]``.
    """
    out = gate.new_empty((gate.shape[1], 2 * gate.shape[0]))
    write_w13(out, gate, up)
    return out


def to_w2(down: torch.Tensor) -> torch.Tensor:
    """Build w2 [I, H] from down [H, I]."""
    out = down.new_empty((down.shape[1], down.shape[0]))
    write_w2(out, down)
    return out


def to_w13_scale(gate_scale: torch.Tensor, up_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Per-channel scales gate [I, 1] and up [I, 1] -> float32 [2I].

    Without ``up_scale``, ``gate_scale`` is a fused gate_up scale [2I, 1].
    """
    parts = [gate_scale] if up_scale is None else [gate_scale, up_scale]
    return torch.cat([part.reshape(-1) for part in parts]).to(torch.float32)


def to_w2_scale(down_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-channel down scale [H, 1] (or flat) -> ``dtype`` [H] (the model dtype)."""
    return down_scale.reshape(-1).to(dtype)


def flatten_offset(*offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-channel offsets ([out, 1] each) -> one flat ``dtype`` [sum(out)] (unused in forward)."""
    return torch.cat([offset.reshape(-1) for offset in offsets]).to(dtype)


def scale_to_int64(scale: torch.Tensor) -> torch.Tensor:
    """Fused-MC2 scale form: the float32 bits of ``scale`` read as int32, widened to int64."""
    return scale.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
