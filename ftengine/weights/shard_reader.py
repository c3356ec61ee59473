"""Checked, bounded-memory access to the tensors of several safetensors shards.

``check_shards`` re-reads each shard's header and confirms every wanted tensor is still
there with the indexed dtype and shape (no tensor data read). ``ShardReader`` then opens
the shards with ``safetensors.safe_open`` for one chunk of slots at a time: with the mmap
backend the tensors are views of the mapped file whose pages stay resident until the
handles close, so closing after each chunk bounds resident memory to about one chunk.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ftengine.errors import WeightLoadError
from ftengine.weights.safetensors_header import READ_ERRORS, TensorInfo, read_header
from ftengine.weights.slot_jobs import SlotJob

CHUNK_BYTES = 64 * 2**20
"""Tensor bytes mapped at once before the shards are closed and reopened."""


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


class ShardReader:
    """``with ShardReader(files) as r: r.tensors(job)``: the shards of one chunk of jobs, open.

    Opening parses each shard's header again (safe_open's own check of the file).
    """

    def __init__(self, files: Iterable[Path]) -> None:
        self._files = sorted(set(files))
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}

    def __enter__(self) -> ShardReader:
        for file in self._files:
            try:
                self._handles[file] = self._stack.enter_context(
                    safe_open(str(file), framework="pt", device="cpu")
                )
            except READ_ERRORS as exc:
                self._stack.close()
                raise WeightLoadError(f"{file}: cannot open ({exc})") from exc
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._handles.clear()
        self._stack.close()

    def tensors(self, job: SlotJob) -> dict[str, torch.Tensor]:
        """The job's tensors by SlotWeights field (views of the mapped shards)."""
        out: dict[str, torch.Tensor] = {}
        for field, info in job.parts.items():
            try:
                out[field] = self._handles[info.file].get_tensor(info.name)
            except READ_ERRORS as exc:
                raise WeightLoadError(f"{info.file}: cannot read {info.name!r} ({exc})") from exc
        return out


def chunk_files(chunk: Iterable[SlotJob]) -> set[Path]:
    """The shards a chunk of jobs reads from."""
    return {info.file for job in chunk for info in job.parts.values()}
