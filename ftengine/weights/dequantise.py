"""A float32 copy of a W8A8-dynamic checkpoint, for implementations that cannot load
msModelSlim's int8 layout (transformers, vLLM on CPU).

The experts are dequantised by the cluster's own code (``ExpertSlots.w13_float`` /
``w2_float``), so a model run on the copy computes with exactly the expert values the
cluster computes with on the W8A8 files. Dense tensors are upcast (exact), the tokenizer and
generation settings are copied; the copy is a plain Hugging Face Qwen3-MoE checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ftengine.errors import ConfigError
from ftengine.weights.index import CONFIG_NAME, INDEX_NAME, CheckpointIndex, expert_tensor_name
from ftengine.weights.reload import load_experts_into_slots
from ftengine.weights.slots import ExpertSlots

DEQUANTISED_KEY = "ftengine_dequantised_from"
"""config.json key of the copy: the W8A8 checkpoint it was made from."""

_COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")


def _shard_name(shard: int, count: int) -> str:
    return f"model-{shard + 1:05d}-of-{count:05d}.safetensors"


def _dense(index: CheckpointIndex) -> dict[str, torch.Tensor]:
    """Every tensor that is not an expert's, as float32."""
    experts = set(index.experts.values())
    return {n: index.read(n).to(torch.float32) for n in index.tensors if n not in experts}


def _layer_experts(slots: ExpertSlots, layer: int) -> dict[str, torch.Tensor]:
    """One layer's experts, dequantised, under the split HF names ([out, in] float32)."""
    inter = slots.intermediate
    out: dict[str, torch.Tensor] = {}
    for expert in range(slots.local_slots):
        w13, w2 = slots.w13_float(layer, expert), slots.w2_float(layer, expert)
        out[expert_tensor_name(layer, expert, "gate_proj")] = w13[:, :inter].T.contiguous()
        out[expert_tensor_name(layer, expert, "up_proj")] = w13[:, inter:].T.contiguous()
        out[expert_tensor_name(layer, expert, "down_proj")] = w2.T.contiguous()
    return out


def _all_experts(index: CheckpointIndex) -> ExpertSlots:
    """Every expert of ``index`` in slot storage (slot ``e`` = expert ``e``), as loaded by
    the cluster's loader."""
    layers, experts = index.num_layers, index.num_experts
    slots = ExpertSlots.allocate(index, layers, experts)
    load_experts_into_slots(
        index, slots, [(i, e, e) for i in range(layers) for e in range(experts)]
    )
    return slots


def _write_shards(root: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    """The shards and their ``model.safetensors.index.json``."""
    weight_map: dict[str, str] = {}
    for shard, tensors in enumerate(shards):
        name = _shard_name(shard, len(shards))
        save_file(tensors, str(root / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    total = sum(t.nbytes for tensors in shards for t in tensors.values())
    body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (root / INDEX_NAME).write_text(json.dumps(body, indent=2))


def _write_settings(index: CheckpointIndex, root: Path) -> None:
    """The tokenizer and generation files as they are; config.json as float32, last."""
    for name in _COPIED:
        if (index.path / name).is_file():
            shutil.copyfile(index.path / name, root / name)
    config = {k: v for k, v in index.config.items() if not k.startswith("ftengine_")}
    config.update(dtype="float32", torch_dtype="float32")
    config[DEQUANTISED_KEY] = str(index.path)
    (root / CONFIG_NAME).write_text(json.dumps(config, indent=2))


def write_dequantised(source: str | Path, target: str | Path) -> Path:
    """Write the float32 copy of W8A8 checkpoint ``source`` into the new directory ``target``.

    One shard for the dense tensors, one per layer for its experts. Holds the int8 experts
    in memory as the single-process reference does. ConfigError if ``source`` is not W8A8
    or ``target`` exists.
    """
    index = CheckpointIndex.open(source)
    root = Path(target)
    if index.quant != "w8a8_dynamic":
        raise ConfigError(f"{index.path}: expected a W8A8-dynamic checkpoint, found {index.quant}")
    if root.exists():
        raise ConfigError(f"{root} already exists; pass a new directory for the copy")
    root.mkdir(parents=True)
    slots = _all_experts(index)
    layers = [_layer_experts(slots, layer) for layer in range(index.num_layers)]
    _write_shards(root, [_dense(index), *layers])
    _write_settings(index, root)
    return root
