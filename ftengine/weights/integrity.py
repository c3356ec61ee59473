"""Optional sha256 manifest of a checkpoint: per-tensor and per-file digests.

Per-tensor digests let a selective reload verify exactly the bytes it reads (no need to
hash whole shards); per-file digests serve an offline full check.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs
import torch
from safetensors import safe_open

from ftengine.errors import WeightLoadError
from ftengine.weights.safetensors_header import READ_ERRORS, read_header

MANIFEST_NAME = "sha256_manifest.json"
_CHUNK = 16 * 2**20


def tensor_sha256(tensor: torch.Tensor) -> str:
    """Hex sha256 of a tensor's raw bytes in row-major order (as stored in safetensors)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().data).hexdigest()


def file_sha256(file: Path) -> str:
    """Hex sha256 of a whole file, read in 16 MiB chunks (never the whole file at once)."""
    digest = hashlib.sha256()
    try:
        with file.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    except OSError as exc:
        raise WeightLoadError(f"{file}: cannot read for hashing ({exc})") from exc
    return digest.hexdigest()


@attrs.frozen
class Manifest:
    """sha256 digests: ``tensors`` by tensor name, ``files`` by file name in the checkpoint."""

    tensors: Mapping[str, str]
    files: Mapping[str, str]

    def check_tensor(self, name: str, tensor: torch.Tensor, file: Path) -> None:
        """Raise WeightLoadError if ``tensor``'s bytes differ from the manifest's digest."""
        expected = self.tensors.get(name)
        if expected is None:
            raise WeightLoadError(
                f"{file}: tensor {name!r} has no entry in {MANIFEST_NAME}; regenerate the manifest"
            )
        found = tensor_sha256(tensor)
        if found != expected:
            raise WeightLoadError(
                f"{file}: tensor {name!r} is corrupt: sha256 {found[:16]}…, manifest says "
                f"{expected[:16]}…; re-create or re-download this shard"
            )

    def save(self, checkpoint: Path) -> Path:
        """Write the manifest as ``checkpoint / MANIFEST_NAME``; returns its path."""
        out = checkpoint / MANIFEST_NAME
        body = {"tensors": dict(self.tensors), "files": dict(self.files)}
        out.write_text(json.dumps(body, indent=1, sort_keys=True))
        return out

    @classmethod
    def load(cls, checkpoint: Path) -> Manifest | None:
        """The checkpoint's manifest, or None if it has none."""
        file = checkpoint / MANIFEST_NAME
        if not file.exists():
            return None
        try:
            body = json.loads(file.read_text())
            return cls(dict(body["tensors"]), dict(body["files"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WeightLoadError(f"{file}: unreadable manifest ({exc}); regenerate it") from exc


def build_manifest(checkpoint: Path) -> Manifest:
    """Hash every tensor and every shard of ``checkpoint`` (reads it all: offline use)."""
    tensors: dict[str, str] = {}
    files: dict[str, str] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        names = read_header(file).tensors
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in names:
                    tensors[name] = tensor_sha256(handle.get_tensor(name))
        except READ_ERRORS as exc:
            raise WeightLoadError(f"{file}: cannot read for hashing ({exc})") from exc
        files[file.name] = file_sha256(file)
    return Manifest(tensors, files)


def verify_files(checkpoint: Path, manifest: Manifest, names: Iterable[str] | None = None) -> None:
    """Hash whole shards (``names``, default all in the manifest) against the manifest."""
    for name in sorted(manifest.files if names is None else names):
        expected = manifest.files.get(name)
        if expected is None:
            raise WeightLoadError(f"{checkpoint / name}: not in {MANIFEST_NAME}")
        found = file_sha256(checkpoint / name)
        if found != expected:
            raise WeightLoadError(
                f"{checkpoint / name}: sha256 {found[:16]}… differs from the manifest's "
                f"{expected[:16]}…; the file is corrupt, re-create or re-download it"
            )
