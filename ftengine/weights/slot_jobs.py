"""Resolve (layer, slot, logical expert) assignments to the exact tensors each slot needs.

Each tensor is checked against the slot storage (dtype, shape) from the index's header
facts alone, so an unusable checkpoint is refused before any data is read.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import attrs
import torch

from ftengine.errors import PlacementError, WeightLoadError
from ftengine.weights.index import CheckpointIndex
from ftengine.weights.safetensors_header import CODES, TensorInfo
from ftengine.weights.slots import ExpertSlots

Assignment = tuple[int, int, int]
"""(layer, local slot, logical expert)."""

# (projection, param) -> SlotWeights field; a fused gate_up fills the gate fields.
_FIELDS: Mapping[tuple[str, str], str] = {
    (proj, param): f"{role}{suffix}"
    for proj, role in (
        ("gate_proj", "gate"),
        ("up_proj", "up"),
        ("gate_up_proj", "gate"),
        ("down_proj", "down"),
    )
    for param, suffix in (("weight", ""), ("weight_scale", "_scale"), ("weight_offset", "_offset"))
}


@attrs.frozen
class SlotJob:
    """One slot to write: where, which expert, and its tensors by SlotWeights field."""

    layer: int
    slot: int
    expert: int
    parts: Mapping[str, TensorInfo]

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data this slot reads."""
        return sum(info.nbytes for info in self.parts.values())


def _expected_shape(slots: ExpertSlots, projection: str) -> tuple[int, int]:
    h, i = slots.hidden, slots.intermediate
    return {"gate_proj": (i, h), "up_proj": (i, h), "gate_up_proj": (2 * i, h)}.get(
        projection, (h, i)
    )


def _check(info: TensorInfo, dtype: torch.dtype | None, shapes: Sequence[tuple[int, ...]]) -> None:
    """``dtype`` None accepts any float dtype (scales and offsets are cast on load)."""
    found = info.torch_dtype
    dtype_ok = found.is_floating_point if dtype is None else found == dtype
    if not dtype_ok or info.shape not in shapes:
        want = "a float dtype" if dtype is None else CODES.get(dtype, str(dtype))
        raise WeightLoadError(
            f"{info.file}: tensor {info.name!r} is {info.dtype} {list(info.shape)}, expected "
            f"{want} {' or '.join(str(list(s)) for s in shapes)}; the checkpoint does not "
            "match the slot storage (hidden/intermediate size, dtype or quantization)"
        )


def _resolve(index: CheckpointIndex, slots: ExpertSlots, a: Assignment) -> SlotJob:
    layer, slot, expert = a
    fused = index.fused_gate_up(layer, expert)
    projections = ("gate_up_proj",) if fused else ("gate_proj", "up_proj")
    params = ("weight", "weight_scale", "weight_offset") if slots.quant != "none" else ("weight",)
    parts: dict[str, TensorInfo] = {}
    for projection in (*projections, "down_proj"):
        out, inp = _expected_shape(slots, projection)
        for param in params:
            info = index.expert_tensor(layer, expert, projection, param)
            if param == "weight":
                _check(info, slots.weight_dtype, [(out, inp)])
            else:
                _check(info, None, [(out, 1), (out,)])
            parts[_FIELDS[(projection, param)]] = info
    return SlotJob(layer, slot, expert, parts)


def _normalise(
    slots: ExpertSlots, num_experts: int, assignments: Iterable[Assignment]
) -> list[Assignment]:
    chosen: dict[tuple[int, int], int] = {}
    for layer, slot, expert in assignments:
        if not (0 <= layer < slots.num_layers and 0 <= slot < slots.local_slots):
            raise PlacementError(
                f"slot (layer {layer}, slot {slot}) is outside the storage's "
                f"{slots.num_layers} layers x {slots.local_slots} slots"
            )
        if not 0 <= expert < num_experts:
            raise PlacementError(f"logical expert {expert} is outside [0, {num_experts})")
        if chosen.setdefault((layer, slot), expert) != expert:
            raise PlacementError(
                f"slot (layer {layer}, slot {slot}) assigned both expert "
                f"{chosen[(layer, slot)]} and {expert}; a plan must give each slot one expert"
            )
    return [(layer, slot, expert) for (layer, slot), expert in chosen.items()]


def plan_slot_jobs(
    index: CheckpointIndex, slots: ExpertSlots, assignments: Iterable[Assignment]
) -> list[SlotJob]:
    """One checked job per distinct slot, in on-disk order of each slot's first tensor.

    Raises PlacementError for an impossible assignment and WeightLoadError for a tensor the
    index lacks or whose dtype/shape does not fit the storage.
    """
    chosen = _normalise(slots, index.num_experts, assignments)
    jobs = [_resolve(index, slots, a) for a in chosen]
    return sorted(jobs, key=lambda job: min((i.file, i.begin) for i in job.parts.values()))


def tensors_by_file(jobs: Sequence[SlotJob]) -> dict[Path, list[TensorInfo]]:
    """Every tensor the jobs need, grouped per file in on-disk order (each tensor once)."""
    grouped: dict[Path, dict[str, TensorInfo]] = defaultdict(dict)
    for job in jobs:
        for info in job.parts.values():
            grouped[info.file][info.name] = info
    return {
        file: sorted(infos.values(), key=lambda info: info.begin)
        for file, infos in sorted(grouped.items())
    }
