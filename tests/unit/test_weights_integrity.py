"""sha256 manifest: per-tensor digests match the stored bytes; a changed shard is caught."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from ftengine.errors import WeightLoadError
from ftengine.weights.checkpoint_gen import make_checkpoint
from ftengine.weights.index import CheckpointIndex
from ftengine.weights.integrity import Manifest, build_manifest, tensor_sha256, verify_files


def test_tensor_digest_is_of_row_major_bytes() -> None:
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    assert tensor_sha256(t) == hashlib.sha256(raw).hexdigest()
    assert tensor_sha256(t.t().contiguous()) != tensor_sha256(t)
    assert tensor_sha256(torch.tensor(3, dtype=torch.int8)) == hashlib.sha256(b"\x03").hexdigest()


def test_generated_manifest_equals_rebuilt_one_and_round_trips(tmp_path: Path) -> None:
    root = make_checkpoint(
        tmp_path / "ck", layers=1, experts=2, hidden=16, intermediate=8, manifest=True
    )
    written = Manifest.load(root)
    assert written is not None
    assert written == build_manifest(root)
    assert Manifest.load(tmp_path) is None
    index = CheckpointIndex.open(root)
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    written.check_tensor(name, index.read(name), index.info(name).file)
    with pytest.raises(WeightLoadError, match="corrupt: sha256"):
        written.check_tensor(name, index.read(name) + 1, index.info(name).file)
    with pytest.raises(WeightLoadError, match="no entry"):
        written.check_tensor("other", torch.zeros(1), index.info(name).file)


def test_verify_files_catches_a_changed_shard(tmp_path: Path) -> None:
    root = make_checkpoint(
        tmp_path / "ck", layers=1, experts=2, hidden=16, intermediate=8, shards=2, manifest=True
    )
    manifest = Manifest.load(root)
    assert manifest is not None
    verify_files(root, manifest)
    shard = sorted(root.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    verify_files(root, manifest, names=[sorted(root.glob("*.safetensors"))[0].name])
    with pytest.raises(WeightLoadError, match=shard.name):
        verify_files(root, manifest)


def test_unreadable_manifest(tmp_path: Path) -> None:
    (tmp_path / "sha256_manifest.json").write_text("{")
    with pytest.raises(WeightLoadError, match="unreadable manifest"):
        Manifest.load(tmp_path)
