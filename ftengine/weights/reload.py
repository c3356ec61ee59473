"""Selective, validate-all-then-copy reload of expert weights into existing slot storage.

Only the tensors of the requested (layer, slot, logical expert) assignments are read, with
``safetensors.safe_open`` (never a whole-file load), grouped per file. Every tensor is
checked (present, dtype, shape, optional sha256) before the first byte of slot storage is
written; then each slot is transformed straight into its existing storage (same
``data_ptr``). Any problem raises WeightLoadError naming the file and the tensor and leaves
the storage untouched.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import attrs
import torch
from safetensors import safe_open

from ftengine.errors import PlacementError, WeightLoadError
from ftengine.weights.index import CheckpointIndex
from ftengine.weights.integrity import Manifest
from ftengine.weights.safetensors_header import CODES, READ_ERRORS, TensorInfo, check_file_size
from ftengine.weights.slots import ExpertSlots, SlotWeights

logger = logging.getLogger(__name__)

Assignment = tuple[int, int, int]
"""(layer, local slot, logical expert)."""

ProgressFn = Callable[[int, int], None]
"""Called with (bytes done, bytes total) as slots are written."""

_T = TypeVar("_T")
_R = TypeVar("_R")

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
class ReloadStats:
    """What a reload did: slots written, bytes read (tensor data + headers), wall seconds."""

    experts: int
    bytes_read: int
    bytes_needed: int
    files: int
    seconds: float


@attrs.frozen
class _SlotJob:
    layer: int
    slot: int
    expert: int
    parts: Mapping[str, TensorInfo]  # SlotWeights field -> tensor


def _expected_shapes(slots: ExpertSlots, projection: str) -> tuple[int, int]:
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


def _resolve(index: CheckpointIndex, slots: ExpertSlots, a: Assignment) -> _SlotJob:
    layer, slot, expert = a
    fused = index.fused_gate_up(layer, expert)
    projections = ("gate_up_proj",) if fused else ("gate_proj", "up_proj")
    params = ("weight", "weight_scale", "weight_offset") if slots.quant != "none" else ("weight",)
    parts: dict[str, TensorInfo] = {}
    for projection in (*projections, "down_proj"):
        out, inp = _expected_shapes(slots, projection)
        for param in params:
            info = index.expert_tensor(layer, expert, projection, param)
            if param == "weight":
                _check(info, slots.weight_dtype, [(out, inp)])
            else:
                _check(info, None, [(out, 1), (out,)])
            parts[_FIELDS[(projection, param)]] = info
    return _SlotJob(layer, slot, expert, parts)


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


def _read_file(
    file: Path, infos: Sequence[TensorInfo], data_end: int, manifest: Manifest | None
) -> dict[str, torch.Tensor]:
    """Open one shard, check each wanted tensor against the index, and return them.

    With the mmap backend of safetensors the tensors are views of the mapped file, so the
    bytes are read once, by the transform that writes the slot.
    """
    check_file_size(file, data_end)
    out: dict[str, torch.Tensor] = {}
    current = ""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            present = set(handle.keys())
            for info in infos:
                current = info.name
                if info.name not in present:
                    raise WeightLoadError(
                        f"{file}: tensor {info.name!r} is missing from the file; "
                        "re-create or re-download this shard"
                    )
                view = handle.get_slice(info.name)
                if view.get_dtype() != info.dtype or tuple(view.get_shape()) != info.shape:
                    raise WeightLoadError(
                        f"{file}: tensor {info.name!r} is now {view.get_dtype()} "
                        f"{view.get_shape()}, indexed as {info.dtype} {list(info.shape)}; "
                        "the shard changed, reopen the checkpoint index"
                    )
                out[info.name] = handle.get_tensor(info.name)
                if manifest is not None:
                    manifest.check_tensor(info.name, out[info.name], file)
    except READ_ERRORS as exc:
        if isinstance(exc, WeightLoadError):
            raise
        raise WeightLoadError(f"{file}: cannot read tensor {current!r} ({exc})") from exc
    return out


def _map(workers: int, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    if workers <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return list(pool.map(fn, items))


def _weights(job: _SlotJob, tensors: Mapping[str, torch.Tensor]) -> SlotWeights:
    return SlotWeights(**{field: tensors[info.name] for field, info in job.parts.items()})


def load_experts_into_slots(
    index: CheckpointIndex,
    slots: ExpertSlots,
    assignments: Iterable[Assignment],
    *,
    workers: int = 1,
    manifest: Manifest | None = None,
    progress: ProgressFn | None = None,
) -> ReloadStats:
    """Load exactly the experts of ``assignments`` into ``slots``, in place.

    ``assignments`` are (layer, local slot, logical expert); ``workers`` > 1 reads files and
    writes slots on a small thread pool. Raises WeightLoadError (storage untouched) for a
    missing, truncated or corrupt tensor, and PlacementError for an impossible assignment.
    """
    started = time.perf_counter()
    chosen = _normalise(slots, index.num_experts, assignments)
    jobs = [_resolve(index, slots, a) for a in chosen]
    by_file: dict[Path, dict[str, TensorInfo]] = defaultdict(dict)
    for job in jobs:
        for info in job.parts.values():
            by_file[info.file][info.name] = info
    files = sorted(by_file)

    def read(file: Path) -> dict[str, torch.Tensor]:
        infos = sorted(by_file[file].values(), key=lambda info: info.begin)
        return _read_file(file, infos, index.files[file].data_end, manifest)

    tensors: dict[str, torch.Tensor] = {}
    for found in _map(workers, read, files):
        tensors.update(found)
    needed = sum(info.nbytes for infos in by_file.values() for info in infos.values())
    done = [0]
    lock = threading.Lock()

    def write(job: _SlotJob) -> None:
        slots.write_slot(job.layer, job.slot, _weights(job, tensors))
        with lock:
            done[0] += sum(info.nbytes for info in job.parts.values())
            if progress is not None:
                progress(done[0], needed)

    _map(workers, write, jobs)
    headers = sum(index.files[file].header_bytes for file in files)
    seconds = time.perf_counter() - started
    stats = ReloadStats(len(jobs), needed + headers, needed, len(files), seconds)
    logger.info(
        "reloaded %d experts from %d files: %d bytes in %.3f s",
        stats.experts,
        stats.files,
        stats.bytes_read,
        stats.seconds,
    )
    return stats
