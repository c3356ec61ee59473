"""The limits every generation request is checked against, read from a checkpoint's config.

One definition of the rule "token ids inside the vocabulary, positions inside the model's
context", used twice: at the API edge (a 400 naming the field, the value and the limit)
and again in the worker, where a request that still breaks it fails alone while the rest
of the step runs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ftengine.errors import ConfigError
from ftengine.validators import int_at_least

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
# transformers' Qwen3MoeConfig default, used when config.json does not say.
DEFAULT_MAX_POSITIONS = 32768


@attrs.frozen
class ModelLimits:
    """``vocab_size`` token ids (``0 .. vocab_size - 1``), ``max_model_len`` positions (the
    config's ``max_position_embeddings``: prompt plus generated tokens), and the
    end-of-sequence ids that finish a request with ``stop`` (empty: none)."""

    vocab_size: int = attrs.field(validator=int_at_least(1))
    max_model_len: int = attrs.field(validator=int_at_least(1))
    eos_token_ids: frozenset[int] = frozenset()

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None
    ) -> ModelLimits:
        """Read a HF ``config.json`` dict (and ``generation_config.json``, whose
        ``eos_token_id`` joins the config's, as transformers and vLLM stop on either)."""
        try:
            vocab = int(config["vocab_size"])
            positions = int(config.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                "config.json needs an integer 'vocab_size' (and 'max_position_embeddings', "
                f"if set, an integer); found {exc!r}"
            ) from exc
        eos = _ids(config.get("eos_token_id")) | _ids((generation_config or {}).get("eos_token_id"))
        return cls(vocab_size=vocab, max_model_len=positions, eos_token_ids=eos)

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ModelLimits:
        """Read ``path/config.json`` and, when present, ``path/generation_config.json``."""
        root = Path(path)
        config = _read_json(root / CONFIG_NAME)
        generation = root / GENERATION_CONFIG_NAME
        return cls.from_config(config, _read_json(generation) if generation.is_file() else None)

    def out_of_vocab(self, token_ids: Sequence[int]) -> int | None:
        """The first id outside ``0 .. vocab_size - 1``, None when every id is inside."""
        for token in token_ids:
            if not 0 <= token < self.vocab_size:
                return token
        return None

    def item_problem(self, cached: int, token_ids: Sequence[int]) -> str | None:
        """Why one model step cannot take ``token_ids`` after ``cached`` tokens of the same
        request; None when it can."""
        if not token_ids:
            return "a step item needs at least one token id"
        bad = self.out_of_vocab(token_ids)
        if bad is not None:
            return f"token id {bad} is outside the vocabulary (ids 0..{self.vocab_size - 1})"
        if cached + len(token_ids) > self.max_model_len:
            return (
                f"{cached} cached + {len(token_ids)} new tokens exceed the model's context of "
                f"{self.max_model_len} positions (max_position_embeddings)"
            )
        return None


def _ids(value: object) -> frozenset[int]:
    """An ``eos_token_id`` entry: absent, one id or a list of ids."""
    if value is None:
        return frozenset()
    values = value if isinstance(value, list) else [value]
    if not all(type(item) is int for item in values):
        raise ConfigError(f"eos_token_id must be an int or a list of ints, found {value!r}")
    return frozenset(values)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data
