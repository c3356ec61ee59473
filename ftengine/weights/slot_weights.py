"""One expert's tensors as read from disk, and the check that they fit a slot.

``ExpertSlots.write_slot`` runs ``check_fits`` before it writes anything, so a tensor of
the wrong shape or dtype, or a missing W8A8 scale, never leaves a slot half-written.
"""

from __future__ import annotations

import attrs
import torch

from ftengine.errors import WeightLoadError


@attrs.frozen(kw_only=True)
class SlotWeights:
    """One expert's tensors as read from disk, ready to be written into a slot.

    ``gate``/``up`` [I, H] and ``down`` [H, I]. W8A8 adds per-channel ``*_scale`` /
    ``*_offset`` ([out, 1]). For a fused checkpoint ``gate`` (and its scale and offset)
    hold the fused gate_up [2I, H] and the up entries are None.
    """

    gate: torch.Tensor
    down: torch.Tensor
    up: torch.Tensor | None = None
    gate_scale: torch.Tensor | None = None
    up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    gate_offset: torch.Tensor | None = None
    up_offset: torch.Tensor | None = None
    down_offset: torch.Tensor | None = None

    @property
    def fused(self) -> bool:
        """Whether ``gate`` holds a fused gate_up [2I, H] (no separate ``up``)."""
        return self.up is None


def _fail(field: str, expected: str, found: torch.Tensor | None, hint: str) -> WeightLoadError:
    seen = "None" if found is None else f"{found.dtype} {list(found.shape)}"
    return WeightLoadError(f"slot tensor {field!r}: expected {expected}, found {seen}; {hint}")


def _check_weight(
    field: str, tensor: torch.Tensor, shape: tuple[int, int], quantized: bool
) -> None:
    dtype_ok = tensor.dtype == torch.int8 if quantized else tensor.dtype.is_floating_point
    if not dtype_ok or tuple(tensor.shape) != shape:
        kind = "int8" if quantized else "a float dtype"
        hint = "check the checkpoint's hidden_size / moe_intermediate_size and quantization"
        raise _fail(field, f"{kind} {list(shape)}", tensor, hint)


def _check_channels(field: str, tensor: torch.Tensor | None, rows: int, required: bool) -> None:
    """A per-output-channel scale or offset: float [rows, 1] or [rows] (or None if optional)."""
    if tensor is None and not required:
        return
    if (
        tensor is None
        or not tensor.dtype.is_floating_point
        or tuple(tensor.shape) not in ((rows, 1), (rows,))
    ):
        hint = "W8A8 slots need a float weight_scale per output channel of every projection"
        raise _fail(field, f"a float tensor of [{rows}, 1] or [{rows}]", tensor, hint)


def check_fits(weights: SlotWeights, *, hidden: int, intermediate: int, quantized: bool) -> None:
    """Raise WeightLoadError naming the first tensor of ``weights`` that does not fit a slot.

    Weights are int8 (``quantized``) or any float dtype, shaped gate [I, H] (fused gate_up
    [2I, H]), up [I, H], down [H, I]. Quantized slots also need a float scale per output
    channel of each projection; offsets are optional, but a split gate/up has both or neither.
    """
    rows = {"gate": intermediate if not weights.fused else 2 * intermediate, "down": hidden}
    if weights.up is not None:
        rows["up"] = intermediate
    columns = {"gate": hidden, "up": hidden, "down": intermediate}
    for role, out in rows.items():
        _check_weight(role, getattr(weights, role), (out, columns[role]), quantized)
    if weights.fused:
        for field in ("up_scale", "up_offset"):
            extra = getattr(weights, field)
            if extra is not None:
                raise _fail(
                    field, "None beside a fused gate_up", extra, "the fused scale covers up"
                )
    if not quantized:
        return
    offsets = (weights.gate_offset, weights.up_offset)
    split_offsets = not weights.fused and any(offset is not None for offset in offsets)
    for role, out in rows.items():
        _check_channels(f"{role}_scale", getattr(weights, f"{role}_scale"), out, required=True)
        required = role != "down" and split_offsets
        _check_channels(f"{role}_offset", getattr(weights, f"{role}_offset"), out, required)
