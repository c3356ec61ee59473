"""Pre-read checks of the shards a reload needs, and its split into bounded chunks.

``check_shard`` re-reads a shard's header and confirms every wanted tensor is still there
with the indexed dtype and shape (no tensor data read); ``chunked`` cuts the slot jobs into
runs of about ``CHUNK_BYTES``, the unit the reader stages in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from ftengine.errors import WeightLoadError
from ftengine.weights.safetensors_header import TensorInfo, read_header

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


class Sized(Protocol):
    """Anything with a byte count (a SlotJob, a TensorInfo)."""

    @property
    def nbytes(self) -> int: ...


_S = TypeVar("_S", bound=Sized)


def chunked(items: Sequence[_S], limit: int = CHUNK_BYTES) -> list[list[_S]]:
    """Consecutive runs of ``items`` of about ``limit`` bytes each (at least one item)."""
    chunks: list[list[_S]] = []
    size = limit
    for item in items:
        if size >= limit:
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += item.nbytes
    return chunks
