"""The start-up check of a checkpoint directory: each kind of bad checkpoint fails with the
file and the key or tensor named, and ``Cluster.launch`` fails before any worker starts."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ftengine.errors import ConfigError, WeightLoadError
from ftengine.testbed.cluster import Cluster, ClusterConfig
from ftengine.testbed.cluster.checkpoint_check import validate_checkpoint
from ftengine.weights.checkpoint_gen import make_checkpoint

SIZES: dict[str, Any] = {
    "layers": 2,
    "experts": 4,
    "hidden": 16,
    "intermediate": 8,
    "vocab": 32,
    "heads": 2,
    "kv_heads": 1,
    "shards": 2,
}
Q_NORM = "model.layers.1.self_attn.q_norm.weight"


def _make(path: Path, **options: Any) -> Path:
    return make_checkpoint(path, **{**SIZES, **options})


def _edit_json(file: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    body = json.loads(file.read_text())
    edit(body)
    file.write_text(json.dumps(body))


def _shard_of(root: Path, name: str) -> Path:
    weight_map = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    return root / str(weight_map[name])


def _rewrite_shard(file: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    with safe_open(str(file), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name).clone() for name in handle.offset_keys()}
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "options",
    [{}, {"quant": "w8a8_dynamic"}, {"fused_gate_up": True}, {"tie_word_embeddings": True}],
)
def test_generated_checkpoints_pass(tmp_path: Path, options: dict[str, Any]) -> None:
    index = validate_checkpoint(_make(tmp_path / "ck", **options))
    assert index.num_experts == 4


def test_no_directory_or_no_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nowhere: not a directory"):
        validate_checkpoint(tmp_path / "nowhere")
    root = _make(tmp_path / "ck")
    (root / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"ck/config\.json: missing"):
        validate_checkpoint(root)


@pytest.mark.parametrize("key", ["num_key_value_heads", "vocab_size", "moe_intermediate_size"])
def test_a_missing_config_key_names_the_file_and_the_key(tmp_path: Path, key: str) -> None:
    root = _make(tmp_path / "ck")
    _edit_json(root / "config.json", lambda body: body.pop(key))
    with pytest.raises(ConfigError, match=rf"ck/config\.json: no '{key}'"):
        validate_checkpoint(root)


def test_an_unsupported_setting_names_the_file_and_the_key(tmp_path: Path) -> None:
    root = _make(tmp_path / "ck")
    _edit_json(root / "config.json", lambda body: body.update(mlp_only_layers=[1]))
    with pytest.raises(ConfigError, match=r"ck/config\.json: mlp_only_layers=\[1\]"):
        validate_checkpoint(root)


def test_a_tensor_missing_from_every_shard(tmp_path: Path) -> None:
    root = _make(tmp_path / "ck")
    shard = _shard_of(root, Q_NORM)
    _rewrite_shard(shard, lambda tensors: tensors.pop(Q_NORM))
    index_file = root / "model.safetensors.index.json"
    _edit_json(index_file, lambda body: body["weight_map"].pop(Q_NORM))
    with pytest.raises(WeightLoadError, match=rf"index\.json: no tensor '{Q_NORM}'"):
        validate_checkpoint(root)


def test_a_tensor_listed_but_missing_from_its_shard_names_the_shard(tmp_path: Path) -> None:
    root = _make(tmp_path / "ck")
    shard = _shard_of(root, Q_NORM)
    _rewrite_shard(shard, lambda tensors: tensors.pop(Q_NORM))
    with pytest.raises(WeightLoadError, match=rf"{shard.name}: no tensor '{Q_NORM}'"):
        validate_checkpoint(root)


def test_a_missing_lm_head_of_an_untied_model(tmp_path: Path) -> None:
    root = _make(tmp_path / "ck", tie_word_embeddings=True)
    _edit_json(root / "config.json", lambda body: body.update(tie_word_embeddings=False))
    with pytest.raises(
        WeightLoadError, match=r"no tensor 'lm_head\.weight'.*tie_word_embeddings=false"
    ):
        validate_checkpoint(root)


def test_a_tensor_of_the_wrong_shape_names_its_file(tmp_path: Path) -> None:
    root = _make(tmp_path / "ck")
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    shard = _shard_of(root, name)
    _rewrite_shard(shard, lambda tensors: tensors.update({name: torch.zeros(16, 9)}))
    with pytest.raises(
        WeightLoadError, match=rf"{shard.name}: tensor '{name}' has shape \[16, 9\]"
    ):
        validate_checkpoint(root)


def test_a_head_dim_that_disagrees_with_the_tensors(tmp_path: Path) -> None:
    root = _make(tmp_path / "ck")
    _edit_json(root / "config.json", lambda body: body.update(head_dim=4))
    with pytest.raises(
        WeightLoadError, match=r"q_proj.weight' has shape \[16, 16\], expected \[8, 16\]"
    ):
        validate_checkpoint(root)


def test_a_w8a8_expert_must_be_int8_with_its_scale(tmp_path: Path) -> None:
    root = _make(tmp_path / "q", quant="w8a8_dynamic")
    name = "model.layers.1.mlp.experts.0.up_proj.weight"
    shard = _shard_of(root, name)
    _rewrite_shard(shard, lambda tensors: tensors.update({name: tensors[name].float()}))
    with pytest.raises(WeightLoadError, match=rf"tensor '{name}' is F32, expected I8"):
        validate_checkpoint(root)
    scale = "model.layers.1.mlp.experts.0.up_proj.weight_scale"

    def int8_without_scale(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name].to(torch.int8)
        del tensors[scale]

    _rewrite_shard(shard, int8_without_scale)
    with pytest.raises(WeightLoadError, match=f"no tensor '{scale}'"):
        validate_checkpoint(root)


def test_a_tokenizer_that_does_not_load(tmp_path: Path) -> None:
    root = _make(tmp_path / "ck")
    (root / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"ck/tokenizer\.json: the tokenizer does not load"):
        validate_checkpoint(root)
    (root / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"ck/tokenizer\.json: no tokenizer"):
        validate_checkpoint(root)


def test_tokenizer_settings_and_size(tmp_path: Path) -> None:
    root = _make(tmp_path / "ck")
    (root / "tokenizer_config.json").write_text("[]")
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: expected a JSON object"):
        validate_checkpoint(root)
    (root / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: cannot read"):
        validate_checkpoint(root)
    bigger = _make(tmp_path / "big", vocab=64)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / name).write_bytes((bigger / name).read_bytes())
    with pytest.raises(ConfigError, match=r"the tokenizer has 64 ids but .*'vocab_size' is 32"):
        validate_checkpoint(root)


def test_launch_refuses_a_bad_checkpoint_before_any_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _make(tmp_path / "ck")
    _edit_json(root / "config.json", lambda body: body.pop("num_experts"))

    def no_workers(self: Cluster) -> None:
        raise AssertionError("a worker was spawned for a bad checkpoint")

    monkeypatch.setattr(Cluster, "_spawn", no_workers)
    with pytest.raises(ConfigError, match=r"ck/config\.json: no 'num_experts'"):
        Cluster.launch(ClusterConfig(root, dp_size=2))
