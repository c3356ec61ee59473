"""The checkpoint generator: a complete tiny Qwen3-MoE model, sharded, W8A8 done for real."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from ftengine.errors import ConfigError
from ftengine.weights.checkpoint_gen import make_checkpoint, quantize_per_channel_int8
from ftengine.weights.index import CheckpointIndex
from ftengine.weights.integrity import Manifest, verify_files

SIZES = {"layers": 2, "experts": 4, "hidden": 32, "intermediate": 16}


def _make(path: Path, **options: Any) -> Path:
    """A tiny checkpoint of the module's sizes (``options`` go to make_checkpoint)."""
    return make_checkpoint(path, **{**SIZES, **options})


def _all_tensors(root: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            out.update({name: handle.get_tensor(name).clone() for name in handle.offset_keys()})
    return out


def test_config_and_every_contract_tensor(tmp_path: Path) -> None:
    root = _make(tmp_path / "ck", vocab=64, heads=4, kv_heads=2, top_k=2)
    config = json.loads((root / "config.json").read_text())
    assert config["hidden_size"] == 32
    assert config["moe_intermediate_size"] == 16
    assert config["num_experts"] == 4
    assert config["num_experts_per_tok"] == 2
    assert config["num_hidden_layers"] == 2
    assert config["num_attention_heads"] == 4
    assert config["num_key_value_heads"] == 2
    assert config["head_dim"] == 8
    assert config["vocab_size"] == 64
    assert config["rms_norm_eps"] > 0
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["model_type"] == "qwen3_moe"
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    assert config["rope_theta"] == 1e6
    assert (config["decoder_sparse_step"], config["mlp_only_layers"]) == (1, [])
    assert (config["norm_topk_prob"], config["tie_word_embeddings"]) == (True, False)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (61, 62, 63)
    tensors = _all_tensors(root)
    expected = {"model.embed_tokens.weight": (64, 32), "model.norm.weight": (32,)}
    expected["lm_head.weight"] = (64, 32)
    for layer in range(2):
        p = f"model.layers.{layer}"
        expected[f"{p}.input_layernorm.weight"] = (32,)
        expected[f"{p}.post_attention_layernorm.weight"] = (32,)
        expected[f"{p}.self_attn.q_proj.weight"] = (32, 32)
        expected[f"{p}.self_attn.k_proj.weight"] = (16, 32)
        expected[f"{p}.self_attn.v_proj.weight"] = (16, 32)
        expected[f"{p}.self_attn.o_proj.weight"] = (32, 32)
        expected[f"{p}.self_attn.q_norm.weight"] = (8,)
        expected[f"{p}.self_attn.k_norm.weight"] = (8,)
        expected[f"{p}.mlp.gate.weight"] = (4, 32)
        for e in range(4):
            expected[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (16, 32)
            expected[f"{p}.mlp.experts.{e}.up_proj.weight"] = (16, 32)
            expected[f"{p}.mlp.experts.{e}.down_proj.weight"] = (32, 16)
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    # RMSNorm weights are seeded values around 1 (not all ones, so a dropped norm shows).
    for name in ("model.norm.weight", "model.layers.1.self_attn.k_norm.weight"):
        norm = tensors[name].float()
        assert float(norm.min()) > 0.5 and float(norm.max()) < 1.5, name
        assert float(norm.std()) > 0.02, name


def test_generation_config_tokenizer_and_a_tied_head(tmp_path: Path) -> None:
    root = _make(tmp_path / "ck", vocab=40, tie_word_embeddings=True, norm_topk_prob=False)
    config = json.loads((root / "config.json").read_text())
    assert (config["tie_word_embeddings"], config["norm_topk_prob"]) == (True, False)
    assert "lm_head.weight" not in _all_tensors(root)
    generation = json.loads((root / "generation_config.json").read_text())
    assert generation == {
        "bos_token_id": 37,
        "eos_token_id": 38,
        "pad_token_id": 39,
        "do_sample": False,
    }
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 40
    assert tokenizer.encode("w0 w7 w35").ids == [0, 7, 35]
    assert tokenizer.encode("nonsense").ids == [36]  # <unk>
    assert [tokenizer.id_to_token(i) for i in (36, 37, 38, 39)] == ["<unk>", "<s>", "</s>", "<pad>"]
    settings = json.loads((root / "tokenizer_config.json").read_text())
    assert (settings["eos_token"], settings["pad_token"]) == ("</s>", "<pad>")


def test_a_vocab_without_room_for_words_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="vocab must be above the 4 special tokens"):
        _make(tmp_path / "ck", vocab=4)
    assert not (tmp_path / "ck").exists()


def test_shards_and_index_json(tmp_path: Path) -> None:
    root = _make(tmp_path / "ck", shards=3)
    files = sorted(p.name for p in root.glob("*.safetensors"))
    assert files == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    index = json.loads((root / "model.safetensors.index.json").read_text())
    on_disk = {}
    for file in files:
        with safe_open(str(root / file), framework="pt") as handle:
            on_disk.update({name: file for name in handle.offset_keys()})
    assert index["weight_map"] == on_disk
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in _all_tensors(root).values())


def test_values_depend_on_seed_not_on_sharding(tmp_path: Path) -> None:
    one = _all_tensors(_make(tmp_path / "a", shards=1, seed=5))
    four = _all_tensors(_make(tmp_path / "b", shards=4, seed=5))
    other = _all_tensors(_make(tmp_path / "c", shards=1, seed=6))
    assert one.keys() == four.keys()
    assert all(torch.equal(one[name], four[name]) for name in one)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    assert not torch.equal(one[name], other[name])


def test_w8a8_is_real_per_channel_symmetric_int8(tmp_path: Path) -> None:
    q = _all_tensors(_make(tmp_path / "q", quant="w8a8_dynamic"))
    f = _all_tensors(_make(tmp_path / "f", dtype="float32"))
    stem = "model.layers.0.mlp.experts.1.down_proj"
    weight, scale = q[f"{stem}.weight"], q[f"{stem}.weight_scale"]
    assert weight.dtype == torch.int8 and weight.shape == (32, 16)
    assert scale.shape == (32, 1) and scale.dtype == torch.float32
    assert torch.count_nonzero(q[f"{stem}.weight_offset"]) == 0
    # Every row uses the full int8 range on its largest element and rounds within scale/2.
    assert torch.equal(weight.abs().amax(dim=1), torch.full((32,), 127, dtype=torch.int8))
    error = (weight.float() * scale - f[f"{stem}.weight"]).abs()
    assert bool((error <= scale / 2 + 1e-7).all())
    # Non-expert tensors stay in the model dtype.
    assert q["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16


def test_quant_description_marks_experts(tmp_path: Path) -> None:
    root = _make(tmp_path / "q", quant="w8a8_dynamic")
    description = json.loads((root / "quant_model_description.json").read_text())
    assert description["model_quant_type"] == "W8A8_DYNAMIC"
    assert description["model.layers.0.mlp.experts.3.gate_proj.weight"] == "W8A8_DYNAMIC"
    assert description["model.layers.0.mlp.experts.3.gate_proj.weight_scale"] == "W8A8_DYNAMIC"
    assert description["model.layers.0.mlp.gate.weight"] == "FLOAT"
    assert description["lm_head.weight"] == "FLOAT"
    assert CheckpointIndex.open(root).quant == "w8a8_dynamic"


def test_quantize_helper_bounds() -> None:
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    q, scale = quantize_per_channel_int8(w)
    assert q[0].tolist() == [64, -127, 32]
    assert scale[0, 0] == pytest.approx(2.0 / 127)
    assert q[1].tolist() == [0, 0, 0]  # an all-zero row stays zero, no division by zero


def test_fused_gate_up_option(tmp_path: Path) -> None:
    fused = _all_tensors(_make(tmp_path / "f", fused_gate_up=True))
    split = _all_tensors(_make(tmp_path / "s"))
    assert fused["model.layers.0.mlp.experts.0.gate_up_proj.weight"].shape == (32, 32)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" not in fused
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in split


def test_manifest_is_written_and_verifies(tmp_path: Path) -> None:
    root = _make(tmp_path / "m", manifest=True)
    manifest = Manifest.load(root)
    assert manifest is not None
    assert set(manifest.tensors) == set(_all_tensors(root))
    verify_files(root, manifest)


def test_refuses_to_overwrite_and_rejects_bad_sizes(tmp_path: Path) -> None:
    _make(tmp_path / "ck")
    with pytest.raises(ConfigError, match="already holds a checkpoint"):
        _make(tmp_path / "ck")
    _make(tmp_path / "ck", overwrite=True, shards=1)
    assert len(list((tmp_path / "ck").glob("*.safetensors"))) == 1
    with pytest.raises(ConfigError, match="must be positive"):
        make_checkpoint(tmp_path / "bad", layers=0, experts=4, hidden=8, intermediate=4)
    with pytest.raises(ConfigError, match="dtype must be one of"):
        _make(tmp_path / "bad", dtype="int4")


@pytest.mark.parametrize(
    "sizes", [{"heads": 0}, {"kv_heads": 0}, {"head_dim": 0}, {"heads": 3, "kv_heads": 2}]
)
def test_impossible_attention_sizes_are_config_errors(tmp_path: Path, sizes: Any) -> None:
    with pytest.raises(ConfigError, match="must be positive"):
        _make(tmp_path / "bad", **sizes)
    assert not (tmp_path / "bad").exists()


def test_a_file_in_the_way_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "ck"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="is a file, expected a directory"):
        _make(blocker)
    assert blocker.read_text() == "not a directory"
