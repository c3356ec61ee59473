"""CheckpointIndex: index json or header scan, split and fused naming, W8A8 detection, errors."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ftengine.errors import WeightLoadError
from ftengine.weights.checkpoint_gen import make_checkpoint
from ftengine.weights.index import CheckpointIndex, expert_tensor_name

SIZES = {"layers": 2, "experts": 4, "hidden": 32, "intermediate": 16}


def _make(path: Path, **options: Any) -> Path:
    """A tiny checkpoint of the module's sizes (``options`` go to make_checkpoint)."""
    return make_checkpoint(path, **{**SIZES, **options})


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return _make(tmp_path / "ck", shards=3)


def test_index_json_maps_experts_to_files(ckpt: Path) -> None:
    index = CheckpointIndex.open(ckpt)
    assert index.quant == "none"
    assert (index.hidden_size, index.intermediate_size) == (32, 16)
    assert (index.num_experts, index.num_layers, index.dtype) == (4, 2, torch.bfloat16)
    assert len(index.files) == 3
    info = index.expert_tensor(1, 3, "up_proj")
    assert info.name == "model.layers.1.mlp.experts.3.up_proj.weight"
    assert info.shape == (16, 32) and info.dtype == "BF16"
    assert info.nbytes == 16 * 32 * 2
    assert info.file.parent == ckpt
    assert len(index.experts) == 2 * 4 * 3
    assert index.expert_bytes_total == 2 * 4 * 3 * 16 * 32 * 2
    assert index.config["num_experts_per_tok"] == 2


def test_header_scan_without_index_json_gives_the_same_map(ckpt: Path) -> None:
    with_json = CheckpointIndex.open(ckpt)
    (ckpt / "model.safetensors.index.json").unlink()
    scanned = CheckpointIndex.open(ckpt)
    assert scanned.tensors == with_json.tensors
    assert scanned.experts == with_json.experts


def test_read_returns_an_owned_copy_of_the_tensor(ckpt: Path) -> None:
    index = CheckpointIndex.open(ckpt)
    router = index.read("model.layers.0.mlp.gate.weight")
    assert router.shape == (4, 32) and router.dtype == torch.bfloat16
    again = index.read("model.layers.0.mlp.gate.weight")
    assert torch.equal(router, again)
    assert router.data_ptr() != again.data_ptr()


def test_fused_gate_up_naming(tmp_path: Path) -> None:
    index = CheckpointIndex.open(_make(tmp_path / "f", fused_gate_up=True))
    assert index.fused_gate_up(0, 1)
    assert index.expert_tensor(0, 1, "gate_up_proj").shape == (32, 32)
    assert not index.has_expert_tensor(0, 1, "gate_proj", "weight")


def test_w8a8_detection_and_scales(tmp_path: Path) -> None:
    index = CheckpointIndex.open(_make(tmp_path / "q", quant="w8a8_dynamic"))
    assert index.quant == "w8a8_dynamic"
    assert index.dtype == torch.bfloat16
    assert index.expert_tensor(0, 0, "down_proj", "weight_scale").shape == (32, 1)
    assert index.expert_tensor(0, 0, "gate_proj").dtype == "I8"


def test_unsupported_quant_type_is_refused(ckpt: Path) -> None:
    name = expert_tensor_name(0, 0, "gate_proj")
    (ckpt / "quant_model_description.json").write_text(json.dumps({name: "W4A8_DYNAMIC"}))
    with pytest.raises(WeightLoadError, match="W4A8_DYNAMIC"):
        CheckpointIndex.open(ckpt)


def test_sizes_are_inferred_without_config(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    index = CheckpointIndex.open(ckpt)
    assert (index.hidden_size, index.intermediate_size) == (32, 16)
    assert (index.num_experts, index.num_layers, index.dtype) == (4, 2, torch.bfloat16)


def test_tensor_missing_from_its_shard_names_file_and_tensor(ckpt: Path) -> None:
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    name = expert_tensor_name(1, 2, "down_proj")
    shard = ckpt / weight_map[name]
    _rewrite_without(shard, name)
    index = CheckpointIndex.open(ckpt)
    with pytest.raises(WeightLoadError, match=r"down_proj.*missing from the file") as err:
        index.expert_tensor(1, 2, "down_proj")
    assert shard.name in str(err.value)
    with pytest.raises(WeightLoadError, match="no tensor"):
        index.info("model.layers.9.mlp.gate.weight")


def test_truncated_and_corrupt_shards_fail_at_open(ckpt: Path) -> None:
    shard = sorted(ckpt.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(WeightLoadError, match="truncated") as err:
        CheckpointIndex.open(ckpt)
    assert shard.name in str(err.value)
    shard.write_bytes(struct.pack("<Q", 10) + b"{not json}" + data[18:])
    with pytest.raises(WeightLoadError, match="not valid JSON"):
        CheckpointIndex.open(ckpt)
    shard.write_bytes(b"\x01\x02")
    with pytest.raises(WeightLoadError, match="too short"):
        CheckpointIndex.open(ckpt)


def test_duplicate_tensor_across_scanned_shards(tmp_path: Path) -> None:
    root = tmp_path / "dup"
    root.mkdir()
    save_file({"a": torch.zeros(2)}, str(root / "one.safetensors"))
    save_file({"a": torch.zeros(2)}, str(root / "two.safetensors"))
    with pytest.raises(WeightLoadError, match=r"in both one\.safetensors and two\.safetensors"):
        CheckpointIndex.open(root)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(WeightLoadError, match="not a directory"):
        CheckpointIndex.open(tmp_path / "nowhere")
    with pytest.raises(WeightLoadError, match="neither"):
        CheckpointIndex.open(tmp_path)


@pytest.mark.parametrize("name", ["model.safetensors.index.json", "config.json"])
def test_json_that_is_not_an_object_is_refused(ckpt: Path, name: str) -> None:
    (ckpt / name).write_text("[1, 2]")
    with pytest.raises(WeightLoadError, match=r"expected a JSON object.*found list") as err:
        CheckpointIndex.open(ckpt)
    assert name in str(err.value)


def test_a_config_size_that_is_not_an_integer_names_key_and_value(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "hidden_size": "wide"}))
    index = CheckpointIndex.open(ckpt)
    with pytest.raises(
        WeightLoadError, match=r"'hidden_size' must be an integer, found 'wide'"
    ) as err:
        _ = index.hidden_size
    assert isinstance(err.value.__cause__, ValueError)


def _rewrite_without(shard: Path, name: str) -> None:
    with safe_open(str(shard), framework="pt") as handle:
        kept = {k: handle.get_tensor(k).clone() for k in handle.offset_keys() if k != name}
    save_file(kept, str(shard))


def test_the_model_dtype_is_read_as_either_transformers_spells_it(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    for keys, want in (
        ({"dtype": "float16", "torch_dtype": "bfloat16"}, torch.float16),  # transformers 5 first
        ({"torch_dtype": "float16"}, torch.float16),
        ({}, torch.bfloat16),  # neither: the first float tensor's
    ):
        body = {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")}
        (ckpt / "config.json").write_text(json.dumps({**body, **keys}))
        assert CheckpointIndex.open(ckpt).dtype == want, keys
    (ckpt / "config.json").write_text(json.dumps({**config, "dtype": "int8"}))
    with pytest.raises(WeightLoadError, match=r"config\.json: dtype 'int8' is not a torch float"):
        _ = CheckpointIndex.open(ckpt).dtype
