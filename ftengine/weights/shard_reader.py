"""Pre-read checks of the shards a reload needs, and its split into bounded chunks.

``check_shard`` re-reads a shard's header and confirms every wanted tensor is still there
with the indexed dtype and shape (no tensor data read); ``chunked`` cuts the slot jobs into
runs of about ``CHUNK_BYTES``, the unit the reader stages in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ftengine.errors import WeightLoadError
from ftengine.weights.safetensors_header import TensorInfo, read_header
from ftengine.weights.slot_jobs import SlotJob

CHUNK_BYTES = 16 * 2**20
"""Tensor bytes staged per chunk: small enough that reading the next one overlaps
transforming this one, large enough for long sequential reads."""


def check_shard(file: Path, infos: Sequence[TensorInfo]) -> int:
    """Re-read ``file``'s header and check each wanted tensor; returns the header bytes read."""
    header = read_header(file)  # truncated or corrupt files fail here, naming the file
    for info in infos:
        now = header.tensors.get(info.name)
        if now is None:
            raise WeightLoadError(
                f"{file}: tensor {info.name!r} is missing from the file; "
                "re-create or re-download this shard"
            )
        if (now.dtype, now.shape) != (info.dtype, info.shape):
            raise WeightLoadError(
                f"{file}: tensor {info.name!r} is now {now.dtype} {list(now.shape)}, indexed "
                f"as {info.dtype} {list(info.shape)}; the shard changed, reopen the index"
            )
    return header.header_bytes


def chunked(jobs: Sequence[SlotJob], limit: int = CHUNK_BYTES) -> list[list[SlotJob]]:
    """Consecutive runs of jobs of about ``limit`` tensor bytes each (at least one job)."""
    chunks: list[list[SlotJob]] = []
    size = limit
    for job in jobs:
        if size >= limit:
            chunks.append([])
            size = 0
        chunks[-1].append(job)
        size += job.nbytes
    return chunks
