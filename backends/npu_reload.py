"""Reload re-hosted experts into the NPU slot tensors the MoE forward reads, in place.

The weights module reads exactly the needed (layer, expert) tensors, validates them all and
applies the per-slot transforms (w13 = [H, 2I] gate columns first, w2 = [I, H], W8A8 scales
to float32 / model dtype) into a small CPU staging area. This module then takes this rank's
tensor-parallel share of each expert (the intermediate dimension, as vllm-ascend shards
it), moves it to the device, casts the weights to FRACTAL_NZ with
``npu_format_cast(..., 29)`` where vllm-ascend keeps them in NZ (:class:`NzPolicy`) and
``copy_``-s every tensor into the storage the model already holds (same ``data_ptr``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Protocol

import attrs
import torch

from ftengine.backends.npu_runtime import NpuRuntime
from ftengine.errors import ConfigError, WeightLoadError
from ftengine.weights import layout
from ftengine.weights.index import CheckpointIndex
from ftengine.weights.nz import ACL_FORMAT_FRACTAL_NZ
from ftengine.weights.reload import Assignment, load_experts_into_slots
from ftengine.weights.slots import ExpertSlots

logger = logging.getLogger(__name__)

WEIGHT_FIELDS = ("w13", "w2")
SCALE_FIELDS = ("w13_scale", "w2_scale", "w13_offset", "w2_offset")
W8A8_READ_FIELDS = ("w13_scale", "w2_scale")
"""The W8A8 scale tensors the MoE forward reads: a slot without them cannot be reloaded."""
INT64_SCALE_FIELDS = {"w13_scale_int64": "w13_scale", "w2_scale_int64": "w2_scale"}
# Fields laid out along the intermediate dimension as [gate | up] (w13's columns).
_W13_SHAPED = frozenset({"w13", "w13_scale", "w13_offset"})


def _mode(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value not in (0, 1, 2):
        raise ConfigError(f"weight_nz_mode must be 0, 1 or 2, found {value!r}")


@attrs.frozen
class NzPolicy:
    """Which expert weights are stored in FRACTAL_NZ, as vllm-ascend decides.

    ``mode`` is vllm-ascend's ``weight_nz_mode`` (``VLLM_ASCEND_ENABLE_NZ``, default 1):
    int8 weights are always NZ (its W8A8 grouped matmul takes NZ only), fp16 / bf16 ones
    only with mode 2, fp32 never.
    """

    mode: int = attrs.field(default=1, validator=_mode)

    def applies(self, dtype: torch.dtype) -> bool:
        if dtype == torch.int8:
            return True
        return self.mode == 2 and dtype in (torch.float16, torch.bfloat16)


def _tp_shard(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ConfigError(f"{attribute.name} must be >= 0, found {value}")


@attrs.frozen
class TpShard:
    """This rank's share of every expert's intermediate dimension (MoE TP rank and size)."""

    rank: int = attrs.field(default=0, validator=_tp_shard)
    size: int = attrs.field(default=1, validator=_tp_shard)

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"TP rank must be in [0, {self.size}), found {self.rank}")


class SlotStorage(Protocol):
    """This rank's device expert storage, the tensors the MoE forward reads.

    ``slot(layer, slot)`` gives one slot's tensors by name: ``w13`` (logical
    ``[H, 2I/tp]``), ``w2`` (``[I/tp, H]``) and, for W8A8, ``w13_scale`` float32
    ``[2I/tp]``, ``w2_scale`` ``[H]``, optional ``w13_offset`` / ``w2_offset`` and, with
    fused MC2, ``w13_scale_int64`` / ``w2_scale_int64``. ``nz``: which weights are NZ;
    ``tp``: the MoE tensor-parallel shard this rank holds.
    """

    @property
    def nz(self) -> NzPolicy: ...

    @property
    def tp(self) -> TpShard: ...

    def slot(self, layer: int, slot: int) -> Mapping[str, torch.Tensor]: ...


class ExpertSlotsStorage:
    """:class:`SlotStorage` over the weights module's stacked ND ``ExpertSlots``.

    ``ExpertSlots`` with ``nz=True`` hold ftengine's CPU reference of the NZ block layout
    in their shapes; torch_npu keeps the logical size instead, so they are refused here.
    """

    def __init__(
        self, slots: ExpertSlots, *, nz: NzPolicy | None = None, tp: TpShard | None = None
    ) -> None:
        if slots.nz:
            raise WeightLoadError(
                "the NPU reload writes logical [H, 2I] / [I, H] slots (torch_npu keeps the "
                "logical size of an NZ tensor); allocate the ExpertSlots with nz=False"
            )
        self.slots = slots
        self._nz = nz if nz is not None else NzPolicy()
        self._tp = tp if tp is not None else TpShard()

    @property
    def nz(self) -> NzPolicy:
        return self._nz

    @property
    def tp(self) -> TpShard:
        return self._tp

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


def shard_expert(
    tensors: Mapping[str, torch.Tensor], tp: TpShard, intermediate: int
) -> dict[str, torch.Tensor]:
    """This TP rank's share of one staged expert: w13-shaped fields keep columns
    ``[r*I/tp, (r+1)*I/tp)`` of the gate half and of the up half, w2 the same rows; the
    ``[H]`` fields are whole. ``WeightLoadError`` if ``intermediate`` does not divide."""
    if tp.size == 1:
        return dict(tensors)
    if intermediate % tp.size:
        raise WeightLoadError(
            f"the intermediate size {intermediate} does not divide into {tp.size} TP shards"
        )
    width = intermediate // tp.size
    gate = slice(tp.rank * width, (tp.rank + 1) * width)
    up = slice(intermediate + gate.start, intermediate + gate.stop)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in _W13_SHAPED:
            out[name] = torch.cat([tensor[..., gate], tensor[..., up]], dim=-1)
        elif name == "w2":
            out[name] = tensor[gate]
        else:
            out[name] = tensor
    return out


def _required(index: CheckpointIndex) -> tuple[str, ...]:
    return WEIGHT_FIELDS + (W8A8_READ_FIELDS if index.quant == "w8a8_dynamic" else ())


def _check_targets(
    storage: SlotStorage, assignments: list[Assignment], required: tuple[str, ...]
) -> None:
    for layer, slot, _ in assignments:
        found = storage.slot(layer, slot)
        missing = [name for name in required if name not in found]
        if missing:
            raise WeightLoadError(
                f"slot (layer {layer}, slot {slot}) has no {', '.join(missing)} storage; "
                "the host must expose every slot tensor the MoE forward reads"
            )


def _check_shapes(
    where: str, staged: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]
) -> None:
    for name in (*WEIGHT_FIELDS, *SCALE_FIELDS):
        if name in dst and name in staged and staged[name].shape != dst[name].shape:
            raise WeightLoadError(
                f"{where} {name}: the checkpoint's expert gives {tuple(staged[name].shape)} "
                f"but the slot the forward reads is {tuple(dst[name].shape)}; check the MoE "
                "TP shard and the layout"
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
        self, staged: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor], policy: NzPolicy
    ) -> int:
        """Copy one slot's staged tensors into ``dst``; returns the NZ casts made."""
        casts = 0
        for name in WEIGHT_FIELDS:
            nz = policy.applies(dst[name].dtype)
            dst[name].copy_(self._to_device(staged[name], dst[name], nz))
            casts += int(nz)
        for name in SCALE_FIELDS:
            if name in dst and name in staged:
                dst[name].copy_(self._to_device(staged[name], dst[name], False))
        for name, source in INT64_SCALE_FIELDS.items():
            if name in dst and source in staged:
                dst[name].copy_(layout.scale_to_int64(staged[source]).to(self._device))
        return casts

    def reload(
        self, index: CheckpointIndex, storage: SlotStorage, assignments: Iterable[Assignment]
    ) -> NpuReloadStats:
        """Load (layer, local slot, logical expert) ``assignments`` into ``storage``.

        Every tensor is read and validated, and every slot checked to have the storage the
        forward reads, before the first device slot is written; a bad checkpoint raises
        ``WeightLoadError`` and leaves the device storage untouched.
        """
        started = time.perf_counter()
        chosen = list(assignments)
        if not chosen:
            return NpuReloadStats(experts=0, bytes_read=0, format_casts=0, seconds=0.0)
        _check_targets(storage, chosen, _required(index))
        staging, bytes_read = _stage(index, chosen)
        writes = []
        for k, (layer, slot, _) in enumerate(chosen):
            whole = {name: tensor[layer, k] for name, tensor in staging.tensors().items()}
            share = shard_expert(whole, storage.tp, index.intermediate_size)
            dst = storage.slot(layer, slot)
            _check_shapes(f"slot (layer {layer}, slot {slot})", share, dst)
            writes.append((share, dst))
        casts = sum(self._write(share, dst, storage.nz) for share, dst in writes)
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
