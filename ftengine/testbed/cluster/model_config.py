"""The model settings the cluster reads from a checkpoint's ``config.json``, parsed the way
transformers' ``Qwen3MoeConfig`` reads them, and the configurations the cluster refuses.

A key that transformers gives a default takes that default here too (``norm_topk_prob``
False, ``tie_word_embeddings`` False, rope theta 10000, ``head_dim`` hidden / heads), so a
file means the same model to both; sizes have no default. Variants the cluster does not
compute (dense MLP layers, sliding-window attention, scaled rope, ...) are refused with a
ConfigError naming the key rather than served wrongly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs

from ftengine.errors import ConfigError

T = TypeVar("T")

REQUIRED_KEYS = (
    "hidden_size",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)
"""Sizes without a usable default (transformers' defaults are those of Qwen3-30B-A3B)."""

DEFAULT_ROPE_THETA = 10000.0
"""transformers' ``RotaryEmbeddingConfigMixin.default_theta``, used when no theta is given."""

_SUPPORTED: Mapping[str, tuple[object, ...]] = {
    # key -> values the cluster computes (a missing key means transformers' default, listed first)
    "model_type": ("qwen3_moe",),
    "hidden_act": ("silu",),
    "decoder_sparse_step": (1,),
    "mlp_only_layers": ([], None),
    "use_sliding_window": (False,),
    "attention_bias": (False,),
}


@attrs.frozen
class ModelConfig:
    """Model settings from a checkpoint's ``config.json`` (HF Qwen3-MoE key names).

    ``intermediate`` is the per-expert ``moe_intermediate_size``; ``tie_word_embeddings``
    makes the head ``model.embed_tokens.weight`` (no ``lm_head.weight`` is read).
    """

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rms_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    norm_topk_prob: bool = False
    tie_word_embeddings: bool = False

    def __attrs_post_init__(self) -> None:
        sizes = attrs.asdict(self, filter=lambda a, v: not isinstance(v, bool))
        bad = {key: value for key, value in sizes.items() if value <= 0}
        if bad or self.top_k > self.num_experts or self.heads % self.kv_heads:
            raise ConfigError(
                f"model settings must be positive with num_experts_per_tok <= num_experts and "
                f"num_attention_heads divisible by num_key_value_heads, found {sizes}"
            )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a HF config dict; raises ConfigError naming ``source`` (the file it
        came from) and a missing, malformed or unsupported key."""
        fields = _Reader(config, source).fields()
        try:
            return cls(**fields)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from exc


@attrs.frozen
class _Reader:
    """Typed reads of one config dict; every error names ``source`` and the key."""

    config: Mapping[str, Any]
    source: str

    def fields(self) -> dict[str, Any]:
        """``ModelConfig``'s fields from the config (sizes required, the rest defaulted)."""
        missing = [key for key in REQUIRED_KEYS if key not in self.config]
        if missing:
            raise ConfigError(
                f"{self.source}: no {missing[0]!r}; expected a Qwen3-MoE config with every "
                f"one of {list(REQUIRED_KEYS)} (as `ftengine make-checkpoint` writes it)"
            )
        self.refuse_unsupported()
        hidden, heads = self("hidden_size", int), self("num_attention_heads", int)
        return {
            "hidden": hidden,
            "intermediate": self("moe_intermediate_size", int),
            "num_experts": self("num_experts", int),
            "top_k": self("num_experts_per_tok", int),
            "num_layers": self("num_hidden_layers", int),
            "heads": heads,
            "kv_heads": self("num_key_value_heads", int),
            "head_dim": self("head_dim", int, hidden // max(heads, 1)),
            "vocab": self("vocab_size", int),
            "rms_eps": self("rms_norm_eps", float, 1e-6),
            "rope_theta": self.rope_theta(),
            "norm_topk_prob": self("norm_topk_prob", bool, False),
            "tie_word_embeddings": self("tie_word_embeddings", bool, False),
        }

    def __call__(self, key: str, kind: Callable[[Any], T], default: T | None = None) -> T:
        """``config[key]`` as ``kind`` (``default`` when absent); ConfigError if malformed."""
        return self.convert(key, self.config.get(key, default), kind)

    def convert(self, key: str, value: object, kind: Callable[[Any], T]) -> T:
        if value is None:
            raise ConfigError(f"{self.source}: {key!r} must be set, found null")
        # bool("false") is True and int(True) is 1: flags and sizes must be JSON's own types.
        if (kind is bool) != isinstance(value, bool):
            raise ConfigError(f"{self.source}: {key!r} has the wrong type, found {value!r}")
        try:
            return kind(value)
        except (TypeError, ValueError) as exc:
            name = getattr(kind, "__name__", kind)
            raise ConfigError(f"{self.source}: {key!r} must be {name}, found {value!r}") from exc

    def refuse_unsupported(self) -> None:
        for key, allowed in _SUPPORTED.items():
            if key in self.config and self.config[key] not in allowed:
                raise ConfigError(
                    f"{self.source}: {key}={self.config[key]!r} is not supported by the CPU "
                    f"cluster's Qwen3-MoE (it computes {key}={allowed[0]!r} only)"
                )

    def rope_theta(self) -> float:
        """The rope base, looked up as transformers 5 does: ``rope_scaling`` (legacy) or
        ``rope_parameters`` first, then a top-level ``rope_theta``, then the default."""
        params = self.config.get("rope_scaling") or self.config.get("rope_parameters") or {}
        if not isinstance(params, Mapping):
            raise ConfigError(
                f"{self.source}: 'rope_parameters' must be an object, found {params!r}"
            )
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(
                f"{self.source}: rope_parameters.rope_type={rope_type!r} is not supported by "
                "the CPU cluster's Qwen3-MoE (it computes the 'default' rotary embedding only)"
            )
        partial = params.get("partial_rotary_factor", self.config.get("partial_rotary_factor"))
        if partial not in (None, 1, 1.0):
            raise ConfigError(
                f"{self.source}: partial_rotary_factor={partial!r} is not supported (only 1.0)"
            )
        theta = params.get("rope_theta", self.config.get("rope_theta", DEFAULT_ROPE_THETA))
        return self.convert("rope_theta", theta, float)
