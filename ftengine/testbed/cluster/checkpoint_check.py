"""The start-up check of a checkpoint directory: everything the cluster will read is there,
of the shape its ``config.json`` implies, and its tokenizer loads, before any worker starts.

Reads headers and JSON only (no tensor data), so it costs milliseconds on any checkpoint
size. Every error names the file and the key or tensor at fault.
"""

from __future__ import annotations

import json
from pathlib import Path

from ftengine.errors import ConfigError, WeightLoadError
from ftengine.testbed.cluster.model_config import ModelConfig
from ftengine.testbed.cluster.prompts import load_tokenizer
from ftengine.weights.index import CONFIG_NAME, INDEX_NAME, CheckpointIndex
from ftengine.weights.model_spec import ModelShape, disk_tensors, tensor_specs
from ftengine.weights.safetensors_header import DTYPES
from ftengine.weights.tokenizer_gen import TOKENIZER_CONFIG_NAME, TOKENIZER_NAME

_DTYPE_CODES = {"int8": ("I8",), "float32": ("F32",)}
"""Disk dtype class (``model_spec.disk_tensors``) -> safetensors codes it allows; "model"
allows any float dtype."""


def validate_checkpoint(path: str | Path) -> CheckpointIndex:
    """Check checkpoint directory ``path`` and return its index.

    Raises ConfigError for a missing directory, ``config.json`` or config key, an
    unsupported setting, or a tokenizer that does not load; WeightLoadError for a tensor
    that is missing, of the wrong shape or dtype, or an unreadable shard header.
    """
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"{root}: not a directory; pass a checkpoint directory")
    if not (root / CONFIG_NAME).is_file():
        raise ConfigError(f"{root / CONFIG_NAME}: missing; a checkpoint needs its config.json")
    index = CheckpointIndex.open(root)
    cfg = ModelConfig.from_hf(index.config, source=str(root / CONFIG_NAME))
    index.dtype  # noqa: B018 - raises WeightLoadError naming config.json for a bad torch_dtype
    check_tensors(index, cfg)
    check_tokenizer(root, cfg)
    return index


Expected = dict[str, tuple[tuple[int, ...], str]]
"""Tensor name -> (shape, dtype class of ``model_spec.disk_tensors``)."""


def expected_tensors(index: CheckpointIndex, cfg: ModelConfig) -> Expected:
    """Name -> (shape, dtype class) of every tensor the cluster reads from ``index``."""
    shape = ModelShape(
        layers=cfg.num_layers,
        experts=cfg.num_experts,
        hidden=cfg.hidden,
        intermediate=cfg.intermediate,
        vocab=cfg.vocab,
        heads=cfg.heads,
        kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        top_k=cfg.top_k,
        # ftengine's own variant (one gate_up_proj per expert) is told by its first expert.
        fused_gate_up=index.fused_gate_up(0, 0),
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    expected: Expected = {}
    for spec in tensor_specs(shape):
        expected.update(disk_tensors(spec, index.quant))
    return expected


def check_tensors(index: CheckpointIndex, cfg: ModelConfig) -> None:
    """WeightLoadError naming the file and tensor of the first one missing or malformed."""
    config = index.path / CONFIG_NAME
    for name, (shape, kind) in expected_tensors(index, cfg).items():
        if name not in index.tensors:
            where = index.missing.get(name, index.path / INDEX_NAME)
            raise WeightLoadError(
                f"{where}: no tensor {name!r}, which {config} implies (num_hidden_layers="
                f"{cfg.num_layers}, num_experts={cfg.num_experts}, tie_word_embeddings="
                f"{str(cfg.tie_word_embeddings).lower()}); re-create the checkpoint"
            )
        info = index.tensors[name]
        if info.shape != shape:
            raise WeightLoadError(
                f"{info.file}: tensor {name!r} has shape {list(info.shape)}, expected "
                f"{list(shape)} from the sizes in {config}"
            )
        allowed = _DTYPE_CODES.get(kind)
        dtype = DTYPES.get(info.dtype)
        ok = info.dtype in allowed if allowed else dtype is not None and dtype.is_floating_point
        if not ok:
            raise WeightLoadError(
                f"{info.file}: tensor {name!r} is {info.dtype}, expected "
                f"{' or '.join(allowed) if allowed else 'a float dtype'}"
            )


def check_tokenizer(root: Path, cfg: ModelConfig) -> None:
    """ConfigError unless the tokenizer loads and its ids fit the model's vocabulary."""
    settings = root / TOKENIZER_CONFIG_NAME
    try:
        loaded = json.loads(settings.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{settings}: cannot read the tokenizer settings ({exc})") from exc
    if not isinstance(loaded, dict):
        raise ConfigError(f"{settings}: expected a JSON object, found {type(loaded).__name__}")
    size = load_tokenizer(root).get_vocab_size(with_added_tokens=True)
    if size > cfg.vocab:
        raise ConfigError(
            f"{root / TOKENIZER_NAME}: the tokenizer has {size} ids but {root / CONFIG_NAME} "
            f"'vocab_size' is {cfg.vocab}; its ids would fall outside the embedding"
        )
