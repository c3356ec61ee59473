"""Read and check the JSON header of a safetensors file without touching its tensor data.

Checking a header catches truncated and corrupt files before any tensor is read, and
gives every tensor's dtype, shape and byte range, so a loader can validate what it is about
to read (file and tensor named in every error).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import attrs
import torch
from safetensors import SafetensorError

from ftengine.errors import WeightLoadError

_MAX_HEADER_BYTES = 100 * 2**20

DTYPES: Mapping[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
"""safetensors dtype codes -> torch dtypes."""

READ_ERRORS: tuple[type[BaseException], ...] = (OSError, RuntimeError, ValueError, SafetensorError)
"""What reading a tensor through ``safetensors`` may raise for a bad or vanished file."""

CODES: Mapping[torch.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}
"""torch dtypes -> safetensors dtype codes."""


@attrs.frozen
class TensorInfo:
    """Where one tensor lives: its file, safetensors dtype code, shape and absolute byte range."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        """The tensor's torch dtype; raises WeightLoadError for a code torch cannot hold."""
        try:
            return DTYPES[self.dtype]
        except KeyError as exc:
            raise WeightLoadError(
                f"{self.file}: tensor {self.name!r} has dtype {self.dtype!r}, which ftengine "
                f"cannot load; supported: {sorted(DTYPES)}"
            ) from exc


@attrs.frozen
class FileHeader:
    """One safetensors file's header: tensors by name and the bytes the header occupies."""

    file: Path
    header_bytes: int
    data_end: int
    tensors: Mapping[str, TensorInfo]


_ITEM_SIZES: Mapping[str, int] = {
    code: torch.empty((), dtype=dtype).element_size() for code, dtype in DTYPES.items()
}


def _parse_entry(file: Path, name: str, entry: object, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise WeightLoadError(f"{file}: header entry {name!r} is not an object; file is corrupt")
    try:
        dtype = str(entry["dtype"])
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(o) for o in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise WeightLoadError(
            f"{file}: header entry {name!r} lacks a valid dtype/shape/data_offsets ({exc}); "
            "the file is corrupt, re-create or re-download it"
        ) from exc
    item = _ITEM_SIZES.get(dtype)
    numel = 1
    for dim in shape:
        numel *= dim
    if end < begin or (item is not None and end - begin != numel * item):
        raise WeightLoadError(
            f"{file}: tensor {name!r} ({dtype}, {list(shape)}) claims bytes [{begin}, {end}); "
            "sizes disagree, the file is corrupt"
        )
    return TensorInfo(name, file, dtype, shape, data_start + begin, data_start + end)


def _read_raw_header(file: Path) -> tuple[int, int, bytes]:
    """Return (file size, header length, header bytes), checking the length is plausible."""
    try:
        with file.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            prefix = fh.read(8)
            length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
            plausible = 0 <= length <= min(size - 8, _MAX_HEADER_BYTES)
            raw = fh.read(length) if plausible else b""
    except OSError as exc:
        raise WeightLoadError(f"{file}: cannot read ({exc}); check path and permissions") from exc
    if length < 0:
        raise WeightLoadError(f"{file}: {size} bytes, too short for a safetensors header")
    if not plausible or len(raw) != length:
        raise WeightLoadError(
            f"{file}: header claims {length} bytes but the file has {size}; "
            "the file is truncated or not safetensors"
        )
    return size, length, raw


def read_header(file: Path) -> FileHeader:
    """Parse ``file``'s header and check that the file holds every byte it promises.

    Raises WeightLoadError (naming the file) for a missing, truncated or corrupt file.
    """
    size, length, raw = _read_raw_header(file)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightLoadError(f"{file}: header is not valid JSON ({exc}); file is corrupt") from exc
    if not isinstance(header, dict):
        raise WeightLoadError(f"{file}: header is not a JSON object; file is corrupt")
    data_start = 8 + length
    tensors = {
        name: _parse_entry(file, name, entry, data_start)
        for name, entry in header.items()
        if name != "__metadata__"
    }
    data_end = max((info.end for info in tensors.values()), default=data_start)
    if data_end > size:
        raise WeightLoadError(
            f"{file}: truncated: its header needs {data_end} bytes, the file has {size}; "
            "re-create or re-download it"
        )
    return FileHeader(file, data_start, data_end, tensors)
