"""Selective, validate-all-then-copy reload of expert weights into existing slot storage.

Only the tensors of the requested (layer, slot, logical expert) assignments are read, as
large positioned reads of coalesced byte ranges (``range_reader``; never a whole file, no
mmap). First every tensor is checked against the index and the shard headers as they are
now (present, dtype, shape, file long enough; with a manifest also its sha256), then each
slot is transformed straight into its existing storage (same ``data_ptr``), a chunk of
slots at a time while the next chunk is read, so resident memory stays near two chunks.
Any problem found by the checks raises WeightLoadError naming the file and the tensor and
leaves the storage untouched; a shard cut short during the reload fails the chunk being
read before any of its slots is written.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import attrs
import torch

from ftengine.weights.index import CheckpointIndex
from ftengine.weights.integrity import Manifest
from ftengine.weights.range_reader import Loaded, RangeReader
from ftengine.weights.safetensors_header import TensorInfo
from ftengine.weights.shard_reader import (
    CHUNK_BYTES,
    check_shard,
    chunked,
)
from ftengine.weights.slot_jobs import Assignment, SlotJob, plan_slot_jobs, tensors_by_file
from ftengine.weights.slots import ExpertSlots, SlotWeights

__all__ = ["Assignment", "ProgressFn", "ReloadStats", "load_experts_into_slots"]

logger = logging.getLogger(__name__)

_DEPTH = 2
"""Chunks in flight: the one being written and the next, read meanwhile."""

ProgressFn = Callable[[int, int], None]
"""Called with (bytes done, bytes total) as slots are written."""

_T = TypeVar("_T")
_R = TypeVar("_R")


@attrs.frozen
class ReloadStats:
    """What a reload did: slots written, bytes read (tensor data + headers), wall seconds."""

    experts: int
    bytes_read: int
    bytes_needed: int
    files: int
    seconds: float


def _map(workers: int, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    if workers <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return list(pool.map(fn, items))


def _verify(chunks: Sequence[Sequence[SlotJob]], manifest: Manifest) -> int:
    """Hash every needed tensor against the manifest before anything is written."""
    with RangeReader(_DEPTH) as reader:
        for chunk, loaded in zip(chunks, reader.chunks([_infos(c) for c in chunks]), strict=True):
            for job in chunk:
                for info in job.parts.values():
                    manifest.check_tensor(info.name, loaded[(info.file, info.name)], info.file)
    return reader.bytes_read


def _infos(chunk: Iterable[SlotJob]) -> list[TensorInfo]:
    return [info for job in chunk for info in job.parts.values()]


def _fields(job: SlotJob, loaded: Loaded) -> dict[str, torch.Tensor]:
    return {field: loaded[(info.file, info.name)] for field, info in job.parts.items()}


def _write(
    slots: ExpertSlots,
    chunks: Sequence[Sequence[SlotJob]],
    workers: int,
    progress: ProgressFn | None,
) -> int:
    """Transform every slot into place, chunk by chunk, the next chunks read meanwhile;
    returns the bytes read."""
    needed = sum(job.nbytes for chunk in chunks for job in chunk)
    done = [0]
    lock = threading.Lock()

    def write(job: SlotJob, loaded: Loaded) -> None:
        slots.write_slot(job.layer, job.slot, SlotWeights(**_fields(job, loaded)))
        with lock:
            done[0] += job.nbytes
            if progress is not None:
                progress(done[0], needed)

    with RangeReader(_DEPTH) as reader:
        for chunk, loaded in zip(chunks, reader.chunks([_infos(c) for c in chunks]), strict=True):
            _map(workers, functools.partial(write, loaded=loaded), chunk)
    return reader.bytes_read


def load_experts_into_slots(
    index: CheckpointIndex,
    slots: ExpertSlots,
    assignments: Iterable[Assignment],
    *,
    workers: int = 1,
    manifest: Manifest | None = None,
    progress: ProgressFn | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> ReloadStats:
    """Load exactly the experts of ``assignments`` into ``slots``, in place.

    ``assignments`` are (layer, local slot, logical expert); ``workers`` > 1 checks shards
    and writes slots on a small thread pool; ``manifest`` adds a sha256 check of every
    tensor read (which reads the data twice). Raises WeightLoadError (storage untouched)
    for a missing, truncated or corrupt tensor, PlacementError for an impossible assignment.
    """
    started = time.perf_counter()
    jobs = plan_slot_jobs(index, slots, assignments)
    by_file = tensors_by_file(jobs)
    headers = _map(workers, lambda file: check_shard(file, by_file[file]), list(by_file))
    chunks = chunked(jobs, chunk_bytes)
    read = sum(headers)
    if manifest is not None:
        read += _verify(chunks, manifest)
    read += _write(slots, chunks, workers, progress)
    needed = sum(info.nbytes for infos in by_file.values() for info in infos)
    seconds = time.perf_counter() - started
    stats = ReloadStats(len(jobs), read, needed, len(by_file), seconds)
    logger.info(
        "reloaded %d experts from %d files: %d bytes in %.3f s",
        stats.experts,
        stats.files,
        stats.bytes_read,
        stats.seconds,
    )
    return stats
