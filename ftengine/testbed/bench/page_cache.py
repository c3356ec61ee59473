"""Evict files from the kernel page cache and measure how much of them is still cached.

After a real fault the weights a survivor reloads are on disk, not in memory, so the reload
benchmark evicts the shards before each timed run: ``fsync`` (dirty pages cannot be
dropped) then ``posix_fadvise(POSIX_FADV_DONTNEED)``, which needs no root. ``mincore(2)``
on a fresh mapping then says whether the pages really left (they do not on tmpfs, nor
while another process maps them), and ``/proc/self/io`` what the disk really delivered.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

_MAP_FAILED = ctypes.c_void_p(-1).value
_PROC_IO = Path("/proc/self/io")


def evict(paths: Iterable[Path]) -> bool:
    """Ask the kernel to drop every file of ``paths`` from the page cache.

    Returns False (having done nothing) where the OS has no ``posix_fadvise``; the advice
    itself is best effort, so check with ``cached_fraction``. Raises OSError for a file
    that cannot be opened.
    """
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None or not hasattr(mmap, "MAP_SHARED"):
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _cached_pages(libc: ctypes.CDLL, path: Path) -> tuple[int, int]:
    """(pages in the page cache, pages) of one file; mapping it faults nothing in."""
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    if pages == 0:
        return 0, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(byte & 1 for byte in bytes(vec)), pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def cached_fraction(paths: Iterable[Path]) -> float | None:
    """Fraction (0..1) of the pages of ``paths`` now in the page cache; None if unknowable."""
    libc = _libc()
    if libc is None:
        return None
    cached = total = 0
    try:
        for path in paths:
            hit, pages = _cached_pages(libc, path)
            cached, total = cached + hit, total + pages
    except (OSError, AttributeError):
        return None
    return cached / total if total else 0.0


def disk_read_bytes() -> int | None:
    """Bytes this process has had fetched from storage so far, readahead included.

    From Linux's ``/proc/self/io`` (``read_bytes``); None where it is unavailable. Page-cache
    hits do not count, so the delta over a cold run is what the disk really delivered.
    """
    try:
        for line in _PROC_IO.read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None
