"""Generate a tiny, complete Qwen3-MoE-style checkpoint for tests, benchmarks and the demo.

Writes ``config.json``, sharded ``model-0000k-of-0000n.safetensors`` with
``model.safetensors.index.json`` and, for W8A8-dynamic, int8 experts quantized per output
channel (symmetric) with their ``weight_scale`` / ``weight_offset`` and a
``quant_model_description.json``. Every tensor is drawn from its own generator seeded by
(seed, name), so values do not depend on the shard count or the quantization.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import attrs
import torch
from safetensors.torch import save_file

from ftengine.errors import ConfigError
from ftengine.weights.index import (
    CONFIG_NAME,
    INDEX_NAME,
    QUANT_DESCRIPTION_NAME,
    Quant,
    expert_tensor_name,
)
from ftengine.weights.integrity import Manifest, file_sha256, tensor_sha256

ProgressFn = Callable[[int, int], None]
"""Called with (bytes written, bytes total)."""

GENERATOR_KEY = "ftengine_generator"
"""config.json key recording the generator's arguments (lets a benchmark reuse a checkpoint)."""

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_QUANTS = ("none", "w8a8_dynamic")
Kind = Literal["ones", "linear", "embed", "expert"]


@attrs.frozen
class TensorSpec:
    """One tensor to generate: HF name, shape ``[out, in]`` for linears, and its init kind."""

    name: str
    shape: tuple[int, ...]
    kind: Kind


@attrs.frozen
class ModelShape:
    """Sizes of the generated model (see ``make_checkpoint`` for their meaning)."""

    layers: int
    experts: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    top_k: int
    fused_gate_up: bool = False

    @classmethod
    def checked(cls, **fields: Any) -> ModelShape:
        """Build one, raising ConfigError for sizes a model cannot have."""
        shape = cls(**fields)
        sizes = attrs.asdict(shape, filter=lambda a, v: not isinstance(v, bool))
        bad = {key: value for key, value in sizes.items() if value <= 0}
        if bad or shape.top_k > shape.experts or shape.heads % shape.kv_heads:
            raise ConfigError(
                f"model sizes must be positive with top_k <= experts and heads divisible by "
                f"kv_heads, found {sizes}"
            )
        return shape


def quantize_per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``weight`` [out, in] -> (int8 [out, in], scale [out, 1]).

    ``scale = max|row| / 127`` (float32), so ``q * scale`` recovers the row within scale / 2.
    """
    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _layer_specs(layer: int, s: ModelShape) -> Iterator[TensorSpec]:
    p = f"model.layers.{layer}"
    h, q_out, kv_out = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    yield TensorSpec(f"{p}.input_layernorm.weight", (h,), "ones")
    yield TensorSpec(f"{p}.self_attn.q_proj.weight", (q_out, h), "linear")
    yield TensorSpec(f"{p}.self_attn.k_proj.weight", (kv_out, h), "linear")
    yield TensorSpec(f"{p}.self_attn.v_proj.weight", (kv_out, h), "linear")
    yield TensorSpec(f"{p}.self_attn.o_proj.weight", (h, q_out), "linear")
    yield TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), "ones")
    yield TensorSpec(f"{p}.mlp.gate.weight", (s.experts, h), "linear")
    i = s.intermediate
    for e in range(s.experts):
        if s.fused_gate_up:
            yield TensorSpec(expert_tensor_name(layer, e, "gate_up_proj"), (2 * i, h), "expert")
        else:
            yield TensorSpec(expert_tensor_name(layer, e, "gate_proj"), (i, h), "expert")
            yield TensorSpec(expert_tensor_name(layer, e, "up_proj"), (i, h), "expert")
        yield TensorSpec(expert_tensor_name(layer, e, "down_proj"), (h, i), "expert")


def tensor_specs(shape: ModelShape) -> list[TensorSpec]:
    """Every tensor of the model, in file order (embeddings, layers, final norm, lm_head)."""
    specs = [TensorSpec("model.embed_tokens.weight", (shape.vocab, shape.hidden), "embed")]
    for layer in range(shape.layers):
        specs.extend(_layer_specs(layer, shape))
    specs.append(TensorSpec("model.norm.weight", (shape.hidden,), "ones"))
    specs.append(TensorSpec("lm_head.weight", (shape.vocab, shape.hidden), "linear"))
    return specs


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _spec_bytes(spec: TensorSpec, dtype: torch.dtype, quant: Quant) -> int:
    if spec.kind == "expert" and quant == "w8a8_dynamic":
        return _numel(spec.shape) + 2 * 4 * spec.shape[0]  # int8 + float32 scale and offset
    return _numel(spec.shape) * torch.empty((), dtype=dtype).element_size()


def _master(spec: TensorSpec, seed: int) -> torch.Tensor:
    """The float32 value of a tensor, from a generator seeded by (seed, name)."""
    if spec.kind == "ones":
        return torch.ones(spec.shape)
    digest = hashlib.sha256(f"{seed}:{spec.name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    values = torch.randn(spec.shape, generator=gen)
    return values if spec.kind == "embed" else values.mul_(spec.shape[-1] ** -0.5)


def _materialise(
    spec: TensorSpec, seed: int, dtype: torch.dtype, quant: Quant
) -> dict[str, torch.Tensor]:
    master = _master(spec, seed)
    if spec.kind != "expert" or quant == "none":
        return {spec.name: master.to(dtype)}
    q, scale = quantize_per_channel_int8(master)
    stem = spec.name.removesuffix(".weight")
    return {
        spec.name: q,
        f"{stem}.weight_scale": scale,
        f"{stem}.weight_offset": torch.zeros_like(scale),
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


def _config(shape: ModelShape, dtype: str, generator: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate * shape.top_k,
        "moe_intermediate_size": shape.intermediate,
        "num_experts": shape.experts,
        "num_experts_per_tok": shape.top_k,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": dtype,
        GENERATOR_KEY: generator,
    }


def _prepare_dir(root: Path, overwrite: bool) -> None:
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
    manifest: bool = False,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
) -> Path:
    """Write a tiny Qwen3-MoE-style checkpoint to directory ``path`` and return it.

    ``hidden`` is H, ``intermediate`` the per-expert I; ``dtype`` one of bfloat16, float16,
    float32; ``quant`` "none" or "w8a8_dynamic" (int8 experts, float32 scales on disk);
    ``fused_gate_up`` writes ``gate_up_proj`` [2I, H] instead of gate/up; ``manifest``
    adds a sha256 manifest. Raises ConfigError for impossible sizes or a non-empty ``path``
    (unless ``overwrite``).
    """
    if dtype not in _DTYPES or quant not in _QUANTS:
        raise ConfigError(
            f"dtype must be one of {sorted(_DTYPES)} and quant one of {_QUANTS}, "
            f"found dtype={dtype!r}, quant={quant!r}"
        )
    shape = ModelShape.checked(
        layers=layers,
        experts=experts,
        hidden=hidden,
        intermediate=intermediate,
        vocab=vocab,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim or max(1, hidden // heads),
        top_k=top_k,
        fused_gate_up=fused_gate_up,
    )
    if shards <= 0:
        raise ConfigError(f"shards must be positive, found {shards}")
    root = Path(path)
    _prepare_dir(root, overwrite)
    torch_dtype = _DTYPES[dtype]
    specs = tensor_specs(shape)
    sizes = [_spec_bytes(spec, torch_dtype, quant) for spec in specs]
    owners = _shard(sizes, min(shards, len(specs)))
    weight_map, digests = _write_shards(
        root,
        specs,
        owners,
        lambda spec: _materialise(spec, seed, torch_dtype, quant),
        progress,
        sum(sizes),
        manifest,
    )
    generator = {"seed": seed, "quant": quant, "shards": shards, "manifest": manifest}
    _write_metadata(root, weight_map, digests if manifest else None, sum(sizes), quant)
    # config.json last: its presence marks a complete checkpoint.
    (root / CONFIG_NAME).write_text(json.dumps(_config(shape, dtype, generator), indent=2))
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
