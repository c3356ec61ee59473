"""The float32 copy of a W8A8 checkpoint: plain HF layout, the cluster's own dequantised values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ftengine.errors import ConfigError
from ftengine.testbed.cluster import compare_outputs, reference_generate
from ftengine.testbed.cluster.prompts import Prompt
from ftengine.weights.checkpoint_gen import make_checkpoint
from ftengine.weights.dequantise import DEQUANTISED_KEY, write_dequantised
from ftengine.weights.index import CheckpointIndex
from ftengine.weights.reload import load_experts_into_slots
from ftengine.weights.slots import ExpertSlots

SIZES: dict[str, Any] = {
    "layers": 2,
    "experts": 4,
    "hidden": 16,
    "intermediate": 8,
    "vocab": 32,
    "heads": 2,
}


def test_the_copy_is_the_unquantised_layout_with_the_clusters_values(tmp_path: Path) -> None:
    w8a8 = make_checkpoint(tmp_path / "q", quant="w8a8_dynamic", fused_gate_up=True, **SIZES)
    plain = CheckpointIndex.open(make_checkpoint(tmp_path / "f", **SIZES))
    copy = CheckpointIndex.open(write_dequantised(w8a8, tmp_path / "d"))
    assert copy.quant == "none" and copy.dtype == torch.float32
    assert set(copy.tensors) == set(plain.tensors)  # split gate/up names, no scales
    assert {info.dtype for info in copy.tensors.values()} == {"F32"}
    config = json.loads((copy.path / "config.json").read_text())
    assert config[DEQUANTISED_KEY] == str(w8a8)
    assert "ftengine_generator" not in config
    assert (copy.path / "tokenizer.json").read_bytes() == (w8a8 / "tokenizer.json").read_bytes()
    source = CheckpointIndex.open(w8a8)
    slots = ExpertSlots.allocate(source, 2, 4)
    load_experts_into_slots(source, slots, [(1, 2, 2)])
    down = copy.read("model.layers.1.mlp.experts.2.down_proj.weight")
    assert torch.equal(down, slots.w2_float(1, 2).T)


def test_serving_the_copy_gives_the_same_numbers(tmp_path: Path) -> None:
    w8a8 = make_checkpoint(tmp_path / "q", quant="w8a8_dynamic", **SIZES)
    copy = write_dequantised(w8a8, tmp_path / "d")
    prompts: list[Prompt] = [[1, 2, 3], "w4 w5"]
    check = compare_outputs(
        reference_generate(copy, prompts, 3), reference_generate(w8a8, prompts, 3)
    )
    assert check.match and check.max_logit_diff == 0.0


def test_refuses_an_unquantised_source_or_an_existing_target(tmp_path: Path) -> None:
    plain = make_checkpoint(tmp_path / "f", **SIZES)
    with pytest.raises(ConfigError, match="expected a W8A8-dynamic checkpoint, found none"):
        write_dequantised(plain, tmp_path / "d")
    w8a8 = make_checkpoint(tmp_path / "q", quant="w8a8_dynamic", **SIZES)
    with pytest.raises(ConfigError, match="already exists"):
        write_dequantised(w8a8, plain)
