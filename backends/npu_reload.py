"""Reload re-hosted experts into existing NPU slot storage after a scale-down.

The weights module reads exactly the needed (layer, expert) tensors, validates them all and
applies the per-slot transforms (w13 = [H, 2I] gate columns first, w2 = [I, H], W8A8 scales
to float32 / model dtype) into a small CPU staging area; this module then moves each slot to
the device, casts it to FRACTAL_NZ with ``npu_format_cast(..., 29)`` where the storage is
NZ, and ``copy_``-s it into the slot tensors the model already holds (same ``data_ptr``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Protocol

import attrs
import torch

from ftengine.backends.npu_runtime import NpuRuntime
from ftengine.errors import WeightLoadError
from ftengine.weights import layout
from ftengine.weights.index import CheckpointIndex
from ftengine.weights.nz import ACL_FORMAT_FRACTAL_NZ
from ftengine.weights.reload import Assignment, load_experts_into_slots
from ftengine.weights.slots import ExpertSlots

logger = logging.getLogger(__name__)

WEIGHT_FIELDS = ("w13", "w2")
SCALE_FIELDS = ("w13_scale", "w2_scale", "w13_offset", "w2_offset")
INT64_SCALE_FIELDS = {"w13_scale_int64": "w13_scale", "w2_scale_int64": "w2_scale"}


class SlotStorage(Protocol):
    """This rank's device expert storage, as the host model holds it.

    ``slot(layer, slot)`` gives views of one slot's tensors by name: ``w13`` (logical
    ``[H, 2I]``), ``w2`` (``[I, H]``) and, for W8A8, ``w13_scale`` float32 ``[2I]``,
    ``w2_scale`` model dtype ``[H]``, optional ``w13_offset`` / ``w2_offset`` and, with
    fused MC2, ``w13_scale_int64`` / ``w2_scale_int64``. ``nz``: the weights are stored
    in FRACTAL_NZ (int8 weights always are on Ascend).
    """

    @property
    def nz(self) -> bool: ...

    def slot(self, layer: int, slot: int) -> Mapping[str, torch.Tensor]: ...


class ExpertSlotsStorage:
    """:class:`SlotStorage` over the weights module's stacked ``ExpertSlots``."""

    def __init__(self, slots: ExpertSlots) -> None:
        self.slots = slots

    @property
    def nz(self) -> bool:
        return self.slots.nz

    def slot(self, layer: int, slot: int) -> Mapping[str, torch.Tensor]:
        return {name: tensor[layer, slot] for name, tensor in self.slots.tensors().items()}


@attrs.frozen
class NpuReloadStats:
    """What one reload did: slots written, bytes read from disk, format casts, wall seconds."""

    experts: int
    bytes_read: int
    format_casts: int
    seconds: float


def _stage(index: CheckpointIndex, assignments: list[Assignment]) -> tuple[ExpertSlots, int]:
    """Read and transform the assigned experts into CPU ND staging; staging slot k = assignment k.

    The weights module reads layer ``L``'s expert into staging ``[L, k]``. Every layer
    dimension of the staging is a stride-0 view of one ``[n, ...]`` buffer, so it costs
    ``n`` experts whatever the layer count; each ``[L, k]`` is written once, so the aliasing
    across layers is harmless. Returns the staging and the bytes read from disk.
    """
    flat = ExpertSlots.empty(
        hidden=index.hidden_size,
        intermediate=index.intermediate_size,
        dtype=index.dtype,
        num_layers=1,
        local_slots=len(assignments),
        quant=index.quant,
        nz=False,
        fused_scales=False,
    )
    layers = index.num_layers

    def widen(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.expand(layers, *tensor.shape[1:])

    staging = attrs.evolve(
        flat,
        w13=flat.w13.expand(layers, *flat.w13.shape[1:]),
        w2=flat.w2.expand(layers, *flat.w2.shape[1:]),
        w13_scale=widen(flat.w13_scale),
        w2_scale=widen(flat.w2_scale),
        w13_offset=widen(flat.w13_offset),
        w2_offset=widen(flat.w2_offset),
    )
    staged = [(layer, k, expert) for k, (layer, _, expert) in enumerate(assignments)]
    stats = load_experts_into_slots(index, staging, staged)
    return staging, stats.bytes_read


def _check_targets(storage: SlotStorage, assignments: list[Assignment]) -> None:
    for layer, slot, _ in assignments:
        found = storage.slot(layer, slot)
        missing = [name for name in WEIGHT_FIELDS if name not in found]
        if missing:
            raise WeightLoadError(
                f"slot (layer {layer}, slot {slot}) has no {', '.join(missing)} storage; "
                "the host must expose every slot tensor it reads in the forward pass"
            )


class NpuExpertReloader:
    """Writes experts from the checkpoint into NPU slot storage, in place."""

    def __init__(self, runtime: NpuRuntime, device: torch.device) -> None:
        self._runtime = runtime
        self._device = device

    def _to_device(self, tensor: torch.Tensor, dst: torch.Tensor, nz: bool) -> torch.Tensor:
        # Blocking: the staging is freed when the reload returns, so no copy may outlive it.
        moved = tensor.to(device=self._device, dtype=dst.dtype)
        return self._runtime.format_cast(moved, ACL_FORMAT_FRACTAL_NZ) if nz else moved

    def _write(
        self,
        staging: ExpertSlots,
        layer: int,
        k: int,
        dst: Mapping[str, torch.Tensor],
        nz: bool,
    ) -> int:
        casts = 0
        for name in WEIGHT_FIELDS:
            src = staging.w13[layer, k] if name == "w13" else staging.w2[layer, k]
            dst[name].copy_(self._to_device(src, dst[name], nz))
            casts += int(nz)
        staged = staging.tensors()
        for name in SCALE_FIELDS:
            if name in dst and name in staged:
                dst[name].copy_(self._to_device(staged[name][layer, k], dst[name], False))
        for name, source in INT64_SCALE_FIELDS.items():
            if name in dst and source in staged:
                wide = layout.scale_to_int64(staged[source][layer, k])
                dst[name].copy_(wide.to(self._device))
        return casts

    def reload(
        self, index: CheckpointIndex, storage: SlotStorage, assignments: Iterable[Assignment]
    ) -> NpuReloadStats:
        """Load (layer, local slot, logical expert) ``assignments`` into ``storage``.

        Every tensor is read and validated before the first device slot is written; a bad
        checkpoint raises ``WeightLoadError`` and leaves the device storage untouched.
        """
        started = time.perf_counter()
        chosen = list(assignments)
        if not chosen:
            return NpuReloadStats(experts=0, bytes_read=0, format_casts=0, seconds=0.0)
        _check_targets(storage, chosen)
        staging, bytes_read = _stage(index, chosen)
        casts = 0
        for k, (layer, slot, _) in enumerate(chosen):
            casts += self._write(staging, layer, k, storage.slot(layer, slot), storage.nz)
        stats = NpuReloadStats(
            experts=len(chosen),
            bytes_read=bytes_read,
            format_casts=casts,
            seconds=time.perf_counter() - started,
        )
        logger.info(
            "npu experts reloaded",
            extra={"experts": stats.experts, "bytes": stats.bytes_read, "casts": casts},
        )
        return stats
