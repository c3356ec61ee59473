"""Expert slot storage: one worker's device-layout expert tensors, written in place on reload.

Shapes (REFERENCE §6), for ``layers`` MoE layers and ``slots`` local slots per layer:
``w13 [layers, slots, H, 2I]`` and ``w2 [layers, slots, I, H]`` in the model dtype, or int8
for W8A8-dynamic with ``w13_scale`` float32 ``[layers, slots, 2I]``, ``w2_scale`` model dtype
``[layers, slots, H]``, flattened offsets beside them and, with ``fused_scales``, the int64
forms of both scales. With ``nz`` the weights are kept in FRACTAL_NZ, each slot's
``[H, 2I]`` / ``[I, H]`` becoming ``nz_shape(...)``. Tensors are never replaced, only
written, so views held elsewhere (and captured graphs) stay valid.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from ftengine.errors import WeightLoadError
from ftengine.weights import layout
from ftengine.weights.index import CheckpointIndex, Quant
from ftengine.weights.nz import from_fractal_nz, nz_shape, to_fractal_nz
from ftengine.weights.slot_weights import SlotWeights, check_fits

__all__ = ["ExpertSlots", "SlotWeights"]

StorageLayout = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""Storage field -> (per-slot shape, dtype)."""


def storage_layout(
    hidden: int,
    intermediate: int,
    dtype: torch.dtype,
    *,
    quant: Quant = "none",
    nz: bool = False,
    fused_scales: bool = False,
) -> StorageLayout:
    """Per-slot shape and dtype of every storage tensor, by field name (REFERENCE §6)."""
    wdtype = torch.int8 if quant == "w8a8_dynamic" else dtype
    w13, w2 = (hidden, 2 * intermediate), (intermediate, hidden)
    shapes: StorageLayout = {
        "w13": (nz_shape(w13, wdtype) if nz else w13, wdtype),
        "w2": (nz_shape(w2, wdtype) if nz else w2, wdtype),
    }
    if quant == "w8a8_dynamic":
        channels = {
            "w13_scale": (2 * intermediate, torch.float32),
            "w2_scale": (hidden, dtype),
            "w13_offset": (2 * intermediate, dtype),
            "w2_offset": (hidden, dtype),
            "w13_scale_int64": (2 * intermediate, torch.int64),
            "w2_scale_int64": (hidden, torch.int64),
        }
        shapes.update(
            (name, ((size,), kind))
            for name, (size, kind) in channels.items()
            if fused_scales or not name.endswith("_int64")
        )
    return shapes


def _fill_w13(dst: torch.Tensor, weights: SlotWeights) -> None:
    if weights.up is None:
        layout.write_w13_fused(dst, weights.gate)
    else:
        layout.write_w13(dst, weights.gate, weights.up)


_STORAGE_FIELDS = (
    "w13",
    "w2",
    "w13_scale",
    "w2_scale",
    "w13_offset",
    "w2_offset",
    "w13_scale_int64",
    "w2_scale_int64",
)


@attrs.frozen(eq=False)
class ExpertSlots:
    """Device-layout expert storage of one worker (see the module docstring for shapes)."""

    w13: torch.Tensor = attrs.field(repr=False)
    w2: torch.Tensor = attrs.field(repr=False)
    hidden: int
    intermediate: int
    dtype: torch.dtype
    quant: Quant = "none"
    nz: bool = False
    w13_scale: torch.Tensor | None = attrs.field(default=None, repr=False)
    w2_scale: torch.Tensor | None = attrs.field(default=None, repr=False)
    w13_offset: torch.Tensor | None = attrs.field(default=None, repr=False)
    w2_offset: torch.Tensor | None = attrs.field(default=None, repr=False)
    w13_scale_int64: torch.Tensor | None = attrs.field(default=None, repr=False)
    w2_scale_int64: torch.Tensor | None = attrs.field(default=None, repr=False)

    @classmethod
    def allocate(
        cls,
        index: CheckpointIndex,
        num_layers: int,
        local_slots: int,
        *,
        nz: bool = False,
        fused_scales: bool = False,
        device: torch.device | str = "cpu",
    ) -> ExpertSlots:
        """Zero-filled storage for ``num_layers`` x ``local_slots`` experts of ``index``."""
        return cls.empty(
            hidden=index.hidden_size,
            intermediate=index.intermediate_size,
            dtype=index.dtype,
            num_layers=num_layers,
            local_slots=local_slots,
            quant=index.quant,
            nz=nz,
            fused_scales=fused_scales,
            device=device,
        )

    @classmethod
    def empty(
        cls,
        *,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype,
        num_layers: int,
        local_slots: int,
        quant: Quant = "none",
        nz: bool = False,
        fused_scales: bool = False,
        device: torch.device | str = "cpu",
    ) -> ExpertSlots:
        """Zero-filled storage from explicit sizes (zeros, so every page is resident now)."""
        if min(hidden, intermediate, num_layers, local_slots) <= 0:
            raise WeightLoadError(
                f"slot storage needs positive sizes, found hidden={hidden}, intermediate="
                f"{intermediate}, layers={num_layers}, slots={local_slots}"
            )
        shapes = storage_layout(
            hidden, intermediate, dtype, quant=quant, nz=nz, fused_scales=fused_scales
        )
        lead = (num_layers, local_slots)
        tensors = {
            name: torch.zeros((*lead, *shape), dtype=kind, device=device)
            for name, (shape, kind) in shapes.items()
        }
        return cls(
            **tensors, hidden=hidden, intermediate=intermediate, dtype=dtype, quant=quant, nz=nz
        )

    @property
    def num_layers(self) -> int:
        """MoE layers held."""
        return int(self.w13.shape[0])

    @property
    def local_slots(self) -> int:
        """Expert slots per layer on this worker."""
        return int(self.w13.shape[1])

    @property
    def weight_dtype(self) -> torch.dtype:
        """Dtype of w13/w2: int8 for W8A8-dynamic, else the model dtype."""
        return self.w13.dtype

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Every storage tensor by field name (absent optional ones left out)."""
        found = {name: getattr(self, name) for name in _STORAGE_FIELDS}
        return {name: tensor for name, tensor in found.items() if tensor is not None}

    def data_ptrs(self) -> Mapping[str, int]:
        """``data_ptr()`` of every storage tensor: equal before and after an in-place reload."""
        return {name: tensor.data_ptr() for name, tensor in self.tensors().items()}

    def w13_nd(self, layer: int, slot: int) -> torch.Tensor:
        """Slot ``(layer, slot)``'s w13 as stored, in ND [H, 2I] (a view unless NZ)."""
        w13 = self.w13[layer, slot]
        return from_fractal_nz(w13, self.hidden, 2 * self.intermediate) if self.nz else w13

    def w2_nd(self, layer: int, slot: int) -> torch.Tensor:
        """Slot ``(layer, slot)``'s w2 as stored, in ND [I, H] (a view unless NZ)."""
        w2 = self.w2[layer, slot]
        return from_fractal_nz(w2, self.intermediate, self.hidden) if self.nz else w2

    def w13_float(self, layer: int, slot: int) -> torch.Tensor:
        """Dequantised float32 w13 [H, 2I] of one slot, for CPU compute (``x @ w13``)."""
        weight = self.w13_nd(layer, slot).to(torch.float32)
        if self.w13_scale is None:
            return weight
        return weight * self.w13_scale[layer, slot].to(torch.float32)

    def w2_float(self, layer: int, slot: int) -> torch.Tensor:
        """Dequantised float32 w2 [I, H] of one slot, for CPU compute (``h @ w2``)."""
        weight = self.w2_nd(layer, slot).to(torch.float32)
        if self.w2_scale is None:
            return weight
        return weight * self.w2_scale[layer, slot].to(torch.float32)

    def layer_float(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All slots of ``layer`` dequantised: (w13 [slots, H, 2I], w2 [slots, I, H]) float32."""
        slots = range(self.local_slots)
        w13 = torch.stack([self.w13_float(layer, slot) for slot in slots])
        w2 = torch.stack([self.w2_float(layer, slot) for slot in slots])
        return w13, w2

    def write_slot(self, layer: int, slot: int, weights: SlotWeights) -> None:
        """Transform one expert's disk tensors into slot ``(layer, slot)`` in place.

        Every tensor is checked (shape, dtype, W8A8 scales present) before any is written,
        so a bad one raises WeightLoadError and leaves the slot as it was.
        """
        quantized = self.quant == "w8a8_dynamic"
        check_fits(weights, hidden=self.hidden, intermediate=self.intermediate, quantized=quantized)
        missing = [name for name in ("w13_scale", "w2_scale") if getattr(self, name) is None]
        if quantized and missing:
            raise WeightLoadError(
                f"W8A8 slot storage: expected w13_scale and w2_scale tensors, found no "
                f"{' or '.join(missing)}; build it with ExpertSlots.allocate() or .empty()"
            )
        self._write_weights(layer, slot, weights)
        if quantized:
            self._write_scales(layer, slot, weights)

    def _write_weights(self, layer: int, slot: int, weights: SlotWeights) -> None:
        if not self.nz:
            _fill_w13(self.w13[layer, slot], weights)
            layout.write_w2(self.w2[layer, slot], weights.down)
            return
        # NZ is a second layout pass over an ND copy in the storage dtype: the CPU reference
        # favours clarity here; the NPU path casts on device instead.
        w13 = self.w13.new_empty((self.hidden, 2 * self.intermediate))
        w2 = self.w2.new_empty((self.intermediate, self.hidden))
        _fill_w13(w13, weights)
        layout.write_w2(w2, weights.down)
        to_fractal_nz(w13, out=self.w13[layer, slot])
        to_fractal_nz(w2, out=self.w2[layer, slot])

    def _write_scales(self, layer: int, slot: int, weights: SlotWeights) -> None:
        # write_slot has checked that these are present.
        assert self.w13_scale is not None and self.w2_scale is not None
        assert weights.gate_scale is not None and weights.down_scale is not None
        w13_scale = layout.to_w13_scale(weights.gate_scale, weights.up_scale)
        self.w13_scale[layer, slot].copy_(w13_scale)
        self.w2_scale[layer, slot].copy_(layout.to_w2_scale(weights.down_scale, self.dtype))
        if self.w13_offset is not None and weights.gate_offset is not None:
            ups = () if weights.up_offset is None else (weights.up_offset,)
            offset = layout.flatten_offset(weights.gate_offset, *ups, dtype=self.dtype)
            self.w13_offset[layer, slot].copy_(offset)
        if self.w2_offset is not None and weights.down_offset is not None:
            offset = layout.flatten_offset(weights.down_offset, dtype=self.dtype)
            self.w2_offset[layer, slot].copy_(offset)
        if self.w13_scale_int64 is not None and self.w2_scale_int64 is not None:
            # Both from the scales as stored (w2's already in the model dtype), the way the
            # fused-MC2 path derives them after loading; unconfirmed against vLLM-Ascend.
            self.w13_scale_int64[layer, slot].copy_(layout.scale_to_int64(w13_scale))
            self.w2_scale_int64[layer, slot].copy_(
                layout.scale_to_int64(self.w2_scale[layer, slot])
            )
