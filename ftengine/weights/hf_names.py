"""The Hugging Face Qwen3-MoE names of the dense (non-expert) tensors, in one place.

The generator writes these names, the cluster's model reads them and the start-up check
expects them; transformers' ``Qwen3MoeForCausalLM`` and vLLM's Qwen3-MoE loader use the
same ones. Expert tensors are named by ``index.expert_tensor_name``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
"""Absent from a checkpoint whose config sets ``tie_word_embeddings`` (the head is EMBED)."""

LAYER_TENSORS: Mapping[str, str] = MappingProxyType(
    {
        "input_norm": "input_layernorm.weight",
        "q": "self_attn.q_proj.weight",
        "k": "self_attn.k_proj.weight",
        "v": "self_attn.v_proj.weight",
        "o": "self_attn.o_proj.weight",
        "q_norm": "self_attn.q_norm.weight",
        "k_norm": "self_attn.k_norm.weight",
        "post_norm": "post_attention_layernorm.weight",
        "router": "mlp.gate.weight",
    }
)
"""A decoder layer's dense tensors: ``LayerWeights`` field -> name under ``model.layers.{L}.``."""


def layer_tensor_name(layer: int, field: str) -> str:
    """The HF name of one dense layer tensor, e.g. ``model.layers.0.self_attn.q_norm.weight``."""
    return f"model.layers.{layer}.{LAYER_TENSORS[field]}"
