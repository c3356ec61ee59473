"""Read chosen safetensors tensors with plain positioned reads, a chunk ahead of their use.

The tensors of a chunk are sorted by file and offset and coalesced into runs (adjacent, or
apart by at most ``GAP_BYTES``); each run is one ``os.preadv`` into a reusable staging
buffer, and every tensor is a zero-copy view of that buffer. No mmap, so resident memory is
the staging buffers alone and the kernel sees large sequential reads. ``RangeReader.chunks``
reads the next ``depth - 1`` chunks on background threads while the caller transforms the
current one (file reads and torch copies both release the GIL). A short read, e.g. a shard
truncated after its header was checked, raises WeightLoadError naming the file and tensor.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import attrs
import torch

from ftengine.errors import WeightLoadError
from ftengine.weights.safetensors_header import TensorInfo

__all__ = ["GAP_BYTES", "Loaded", "RangeReader", "Run", "coalesce"]

GAP_BYTES = 4096
"""Unneeded bytes between two needed tensors that are read rather than skipped (a page)."""

_ALIGN = 64  # staging offsets keep the file offset's alignment modulo this
_MAX_READ = 1 << 30  # per preadv call; Linux caps one read near 2 GiB anyway

Loaded = dict[tuple[Path, str], torch.Tensor]
"""Tensors read for one chunk, by (file, tensor name): views of a staging buffer."""


@attrs.frozen
class Run:
    """One sequential read: bytes [begin, end) of ``file``, covering ``tensors``."""

    file: Path
    begin: int
    end: int
    tensors: tuple[TensorInfo, ...]

    @property
    def nbytes(self) -> int:
        """Bytes this run reads, gaps between its tensors included."""
        return self.end - self.begin


def coalesce(infos: Iterable[TensorInfo], gap: int = GAP_BYTES) -> list[Run]:
    """Sort ``infos`` by (file, offset), each tensor once, and merge those at most ``gap`` apart."""
    unique = {(info.file, info.name): info for info in infos}
    runs: list[Run] = []
    for info in sorted(unique.values(), key=lambda i: (i.file, i.begin, i.end)):
        last = runs[-1] if runs else None
        if last is not None and last.file == info.file and info.begin - last.end <= gap:
            end = max(last.end, info.end)
            runs[-1] = Run(last.file, last.begin, end, (*last.tensors, info))
        else:
            runs.append(Run(info.file, info.begin, info.end, (info,)))
    return runs


def _view(buffer: torch.Tensor, at: int, info: TensorInfo) -> torch.Tensor:
    raw = buffer[at : at + info.nbytes]
    if at % info.torch_dtype.itemsize:
        raw = raw.clone()  # a misaligned tensor in the file: torch views need alignment
    return raw.view(info.torch_dtype).reshape(info.shape)


class RangeReader:
    """``with RangeReader(depth) as r: for loaded in r.chunks(per_chunk_infos): ...``.

    Keeps one read-only descriptor per shard and ``depth`` staging buffers (each grows to
    the largest chunk it held); ``bytes_read`` counts every byte read, gaps included.
    """

    def __init__(self, depth: int = 2, gap: int = GAP_BYTES) -> None:
        self._depth = max(1, depth)
        self._gap = gap
        self._fds: dict[Path, int] = {}
        self._buffers = [torch.empty(0, dtype=torch.uint8) for _ in range(self._depth)]
        self._pool = ThreadPoolExecutor(max_workers=self._depth, thread_name_prefix="ranges")
        self.bytes_read = 0

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        # Reads in flight use the descriptors: stop them before closing.
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def chunks(self, chunks: Sequence[Iterable[TensorInfo]]) -> Iterator[Loaded]:
        """The tensors of each chunk in order; later chunks are read while one is in use.

        A chunk's views stay valid until the next chunk is requested.
        """
        plans = [coalesce(infos, self._gap) for infos in chunks]
        ahead: deque[Future[Loaded]] = deque()

        def submit(k: int) -> None:
            if k < len(plans):
                ahead.append(self._pool.submit(self._read_chunk, plans[k], k % self._depth))

        for k in range(self._depth - 1):
            submit(k)
        for k in range(len(plans)):
            # Chunk k - 1 is done with, so its buffer can take chunk k + depth - 1.
            submit(k + self._depth - 1)
            loaded = ahead.popleft().result()
            self.bytes_read += sum(run.nbytes for run in plans[k])
            yield loaded

    def read(self, infos: Iterable[TensorInfo]) -> Loaded:
        """The tensors of ``infos``, read now (views of staging buffer 0)."""
        runs = coalesce(infos, self._gap)
        loaded = self._read_chunk(runs, 0)
        self.bytes_read += sum(run.nbytes for run in runs)
        return loaded

    def _read_chunk(self, runs: Sequence[Run], slot: int) -> Loaded:
        places, size = [], 0
        for run in runs:
            size += (run.begin - size) % _ALIGN
            places.append(size)
            size += run.nbytes
        if self._buffers[slot].numel() < size:
            self._buffers[slot] = torch.empty(size, dtype=torch.uint8)
        buffer = self._buffers[slot]
        memory = buffer.numpy().data
        loaded: Loaded = {}
        for run, at in zip(runs, places, strict=True):
            self._read_run(run, memory[at : at + run.nbytes])
            for info in run.tensors:
                loaded[(info.file, info.name)] = _view(buffer, at + info.begin - run.begin, info)
        return loaded

    def _fd(self, file: Path, first: TensorInfo) -> int:
        fd = self._fds.get(file)
        if fd is None:
            try:
                fd = self._fds[file] = os.open(file, os.O_RDONLY)
                if hasattr(os, "posix_fadvise"):
                    # Runs are read whole, so readahead past a run's end is wasted disk time.
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            except OSError as exc:
                raise WeightLoadError(
                    f"{file}: cannot open to read tensor {first.name!r} ({exc}); "
                    "check the path and permissions"
                ) from exc
        return fd

    def _read_run(self, run: Run, into: memoryview) -> None:
        fd, done = self._fd(run.file, run.tensors[0]), 0
        while done < run.nbytes:
            step = min(run.nbytes - done, _MAX_READ)
            try:
                got = os.preadv(fd, [into[done : done + step]], run.begin + done)
            except OSError as exc:
                raise _short(run, run.begin + done, str(exc)) from exc
            if got == 0:
                raise _short(run, run.begin + done, "end of file")
            done += got


def _short(run: Run, offset: int, why: str) -> WeightLoadError:
    info = next(i for i in run.tensors if i.end > offset)
    return WeightLoadError(
        f"{run.file}: cannot read tensor {info.name!r} (bytes [{info.begin}, {info.end})): "
        f"stopped at byte {offset} ({why}); the shard was truncated or rewritten, "
        "re-create or re-download it and reload"
    )
