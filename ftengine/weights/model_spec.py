"""The tiny Qwen3-MoE model the checkpoint generator writes: tensors, values, config.

Every tensor is drawn from its own generator seeded by (seed, name), so values do not
depend on the shard count or the quantization. W8A8-dynamic experts are quantized per
output channel (symmetric int8) with a float32 ``weight_scale`` and zero ``weight_offset``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any, Literal

import attrs
import torch

from ftengine.errors import ConfigError
from ftengine.weights.index import Quant, expert_tensor_name

Kind = Literal["ones", "linear", "embed", "expert"]


@attrs.frozen
class TensorSpec:
    """One tensor to generate: HF name, shape ``[out, in]`` for linears, and its init kind."""

    name: str
    shape: tuple[int, ...]
    kind: Kind


@attrs.frozen
class ModelShape:
    """Sizes of the generated model (see ``make_checkpoint`` for their meaning).

    Raises ConfigError at construction for sizes a model cannot have.
    """

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

    def __attrs_post_init__(self) -> None:
        sizes = attrs.asdict(self, filter=lambda a, v: not isinstance(v, bool))
        bad = {key: value for key, value in sizes.items() if value <= 0}
        if bad or self.top_k > self.experts or self.heads % self.kv_heads:
            raise ConfigError(
                f"model sizes must be positive with top_k <= experts and heads divisible by "
                f"kv_heads, found {sizes}"
            )


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


def spec_bytes(spec: TensorSpec, dtype: torch.dtype, quant: Quant) -> int:
    """Bytes the tensor (with its W8A8 scale and offset) takes on disk."""
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


def tensor_values(
    spec: TensorSpec, seed: int, dtype: torch.dtype, quant: Quant
) -> dict[str, torch.Tensor]:
    """The tensor by name, in ``dtype``; a W8A8 expert adds its scale and offset."""
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


def model_config(shape: ModelShape, dtype: str) -> dict[str, Any]:
    """The model's Qwen3-MoE ``config.json`` content (``dtype``: its torch_dtype name)."""
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
    }
