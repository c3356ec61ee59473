"""Generate a complete Hugging Face Qwen3-MoE checkpoint for tests, benchmarks and the demo.

Writes ``config.json``, ``generation_config.json``, sharded
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``, a word-level
tokenizer (``tokenizer.json``, ``tokenizer_config.json``) and, for W8A8-dynamic, the
experts' int8 weights with their scales and offsets and a ``quant_model_description.json``
(msModelSlim's layout). transformers' ``AutoModelForCausalLM`` / ``AutoTokenizer`` and vLLM
load an unquantised one offline as it is. The model itself is described in ``model_spec``;
tensors are written shard by shard, so memory holds one shard at most.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import save_file

from ftengine.errors import ConfigError
from ftengine.weights.index import CONFIG_NAME, INDEX_NAME, QUANT_DESCRIPTION_NAME, Quant
from ftengine.weights.integrity import Manifest, file_sha256, tensor_sha256
from ftengine.weights.model_spec import (
    MAX_POSITIONS,
    ModelShape,
    TensorSpec,
    generation_config,
    model_config,
    quantize_per_channel_int8,
    spec_bytes,
    tensor_specs,
    tensor_values,
)
from ftengine.weights.tokenizer_gen import check_vocab, write_tokenizer

__all__ = [
    "GENERATOR_KEY",
    "ModelShape",
    "WriteOptions",
    "is_generated_checkpoint",
    "make_checkpoint",
    "quantize_per_channel_int8",
    "remove_checkpoint",
    "write_checkpoint",
]

ProgressFn = Callable[[int, int], None]
"""Called with (bytes written, bytes total)."""

GENERATOR_KEY = "ftengine_generator"
"""config.json key recording the generator's arguments (lets a benchmark reuse a checkpoint)."""

GENERATOR_FORMAT = 2
"""Bumped when the files written change (2: the Hugging Face Qwen3-MoE layout with q/k norms
and a tokenizer), so that a checkpoint written before is rebuilt rather than reused."""

GENERATION_CONFIG_NAME = "generation_config.json"

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_QUANTS = ("none", "w8a8_dynamic")


@attrs.frozen
class WriteOptions:
    """How to write a checkpoint: model dtype name, quantization, shard count, seed, manifest.

    Raises ConfigError at construction for an unknown dtype or quant or no shards.
    """

    dtype: str = "bfloat16"
    quant: Quant = "none"
    shards: int = 2
    seed: int = 0
    manifest: bool = False

    def __attrs_post_init__(self) -> None:
        if self.dtype not in _DTYPES or self.quant not in _QUANTS:
            raise ConfigError(
                f"dtype must be one of {sorted(_DTYPES)} and quant one of {_QUANTS}, "
                f"found dtype={self.dtype!r}, quant={self.quant!r}"
            )
        if self.shards <= 0:
            raise ConfigError(f"shards must be positive, found {self.shards}")

    def generator_record(self) -> dict[str, Any]:
        """What config.json records under GENERATOR_KEY (all a reuse check must compare)."""
        return {
            "format": GENERATOR_FORMAT,
            "seed": self.seed,
            "quant": self.quant,
            "shards": self.shards,
            "manifest": self.manifest,
        }


def _shard(sizes: list[int], shards: int) -> list[int]:
    """Shard number of each tensor: contiguous runs of about equal bytes, none empty."""
    total = max(sum(sizes), 1)
    owners, start = [], 0
    for size in sizes:
        owners.append(min(shards - 1, (start + size // 2) * shards // total))
        start += size
    renumber = {old: new for new, old in enumerate(sorted(set(owners)))}
    return [renumber[owner] for owner in owners]


def _prepare_dir(root: Path, overwrite: bool) -> None:
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{root} is a file, expected a directory; choose another path")
    stale = [*root.glob("*.safetensors"), *root.glob("*.json")] if root.exists() else []
    if stale and not overwrite:
        raise ConfigError(
            f"{root} already holds a checkpoint ({stale[0].name}, ...); pass overwrite=True "
            "(--overwrite) or choose an empty directory"
        )
    for file in stale:
        file.unlink()
    root.mkdir(parents=True, exist_ok=True)


def _write_shards(
    root: Path,
    specs: list[TensorSpec],
    owners: list[int],
    materialise: Callable[[TensorSpec], dict[str, torch.Tensor]],
    progress: ProgressFn | None,
    total: int,
    digest: bool,
) -> tuple[dict[str, str], dict[str, str]]:
    """Write one shard at a time (memory ~ one shard); returns (weight_map, tensor digests)."""
    count = max(owners) + 1
    weight_map: dict[str, str] = {}
    digests: dict[str, str] = {}
    written = 0
    for shard in range(count):
        file = f"model-{shard + 1:05d}-of-{count:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for spec, owner in zip(specs, owners, strict=True):
            if owner == shard:
                tensors.update(materialise(spec))
        save_file(tensors, str(root / file), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = file
            if digest:
                digests[name] = tensor_sha256(tensor)
            written += tensor.nbytes
        if progress is not None:
            progress(written, total)
    return weight_map, digests


def make_checkpoint(
    path: str | Path,
    *,
    layers: int,
    experts: int,
    hidden: int,
    intermediate: int,
    dtype: str = "bfloat16",
    quant: Quant = "none",
    shards: int = 2,
    seed: int = 0,
    vocab: int = 512,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    top_k: int = 2,
    fused_gate_up: bool = False,
    tie_word_embeddings: bool = False,
    norm_topk_prob: bool = True,
    rope_theta: float = 1000000.0,
    manifest: bool = False,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
) -> Path:
    """Write a Qwen3-MoE checkpoint to directory ``path`` and return it.

    ``hidden`` is H, ``intermediate`` the per-expert I; ``dtype`` one of bfloat16, float16,
    float32; ``quant`` "none" or "w8a8_dynamic" (int8 experts, float32 scales on disk);
    ``head_dim`` defaults to hidden / heads; ``fused_gate_up`` writes a per-expert
    ``gate_up_proj`` [2I, H] instead of gate/up (an ftengine variant that transformers and
    vLLM do not load); ``tie_word_embeddings`` leaves out ``lm_head`` (the head is the
    embedding); ``norm_topk_prob`` renormalises the router's top-k weights; ``manifest``
    adds a sha256 manifest. Raises ConfigError for impossible sizes or a non-empty ``path``
    (unless ``overwrite``).
    """
    options = WriteOptions(dtype=dtype, quant=quant, shards=shards, seed=seed, manifest=manifest)
    shape = ModelShape(
        layers=layers,
        experts=experts,
        hidden=hidden,
        intermediate=intermediate,
        vocab=vocab,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim if head_dim is not None else max(1, hidden // max(heads, 1)),
        top_k=top_k,
        fused_gate_up=fused_gate_up,
        tie_word_embeddings=tie_word_embeddings,
        norm_topk_prob=norm_topk_prob,
        rope_theta=rope_theta,
    )
    return write_checkpoint(path, shape, options, overwrite=overwrite, progress=progress)


def write_checkpoint(
    path: str | Path,
    shape: ModelShape,
    options: WriteOptions,
    *,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
) -> Path:
    """Write the checkpoint of ``shape`` to directory ``path`` (see ``make_checkpoint``)."""
    root = Path(path)
    check_vocab(shape.vocab)
    _prepare_dir(root, overwrite)
    torch_dtype = _DTYPES[options.dtype]
    specs = tensor_specs(shape)
    sizes = [spec_bytes(spec, torch_dtype, options.quant) for spec in specs]
    owners = _shard(sizes, min(options.shards, len(specs)))
    weight_map, digests = _write_shards(
        root,
        specs,
        owners,
        lambda spec: tensor_values(spec, options.seed, torch_dtype, options.quant),
        progress,
        sum(sizes),
        options.manifest,
    )
    manifest = digests if options.manifest else None
    _write_metadata(root, weight_map, manifest, sum(sizes), options.quant)
    write_tokenizer(root, shape.vocab, MAX_POSITIONS)
    (root / GENERATION_CONFIG_NAME).write_text(json.dumps(generation_config(shape), indent=2))
    # config.json last: its presence marks a complete checkpoint.
    config = {**model_config(shape, options.dtype), GENERATOR_KEY: options.generator_record()}
    (root / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    return root


def _write_metadata(
    root: Path,
    weight_map: dict[str, str],
    digests: dict[str, str] | None,
    total: int,
    quant: Quant,
) -> None:
    """The index json, the W8A8 description and (with ``digests``) the sha256 manifest."""
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (root / INDEX_NAME).write_text(json.dumps(index, indent=2))
    if quant == "w8a8_dynamic":
        _write_quant_description(root, weight_map)
    if digests is not None:
        files = {file: file_sha256(root / file) for file in sorted(set(weight_map.values()))}
        Manifest(digests, files).save(root)


def _write_quant_description(root: Path, weight_map: dict[str, str]) -> None:
    """msModelSlim-style description: every tensor name -> W8A8_DYNAMIC or FLOAT."""
    description: dict[str, str] = {"model_quant_type": "W8A8_DYNAMIC", "version": "1.0.0"}
    for name in sorted(weight_map):
        quantized = ".mlp.experts." in name
        description[name] = "W8A8_DYNAMIC" if quantized else "FLOAT"
    (root / QUANT_DESCRIPTION_NAME).write_text(json.dumps(description, indent=2))


def is_generated_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` holds a checkpoint this module wrote (its config.json says so)."""
    config = Path(path) / CONFIG_NAME
    try:
        return GENERATOR_KEY in json.loads(config.read_text())
    except (OSError, ValueError, TypeError):
        return False


def remove_checkpoint(path: str | Path) -> None:
    """Delete a checkpoint directory written by ``make_checkpoint`` (and nothing else)."""
    root = Path(path)
    if not is_generated_checkpoint(root):
        raise ConfigError(
            f"{root} is not an ftengine-generated checkpoint (no {GENERATOR_KEY!r} in "
            f"{CONFIG_NAME}); refusing to delete it"
        )
    shutil.rmtree(root)
