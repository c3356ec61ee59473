"""The Qwen3-MoE model the checkpoint generator writes: tensors, values, config files.

Every tensor is drawn from its own generator seeded by (seed, name), so values do not
depend on the shard count or the quantization. W8A8-dynamic experts are quantized per
output channel (symmetric int8) with a float32 ``weight_scale`` and zero ``weight_offset``.
The config is a complete Hugging Face ``Qwen3MoeConfig`` (transformers and vLLM load it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any, Literal

import attrs
import torch

from ftengine.errors import ConfigError
from ftengine.weights import hf_names
from ftengine.weights.index import Quant, expert_tensor_name
from ftengine.weights.tokenizer_gen import special_token_ids

Kind = Literal["norm", "linear", "embed", "expert"]

RMS_NORM_EPS = 1e-6
MAX_POSITIONS = 4096
NORM_SPREAD = 0.1
"""Standard deviation of RMSNorm weights around 1."""


@attrs.frozen
class TensorSpec:
    """One tensor to generate: HF name, shape ``[out, in]`` for linears, and its init kind."""

    name: str
    shape: tuple[int, ...]
    kind: Kind


@attrs.frozen
class ModelShape:
    """Sizes and settings of the generated model (see ``make_checkpoint`` for their meaning).

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
    tie_word_embeddings: bool = False
    norm_topk_prob: bool = True
    rope_theta: float = 1000000.0

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
    h, d, q_out, kv_out = s.hidden, s.head_dim, s.heads * s.head_dim, s.kv_heads * s.head_dim
    dense: dict[str, tuple[tuple[int, ...], Kind]] = {
        "input_norm": ((h,), "norm"),
        "q": ((q_out, h), "linear"),
        "k": ((kv_out, h), "linear"),
        "v": ((kv_out, h), "linear"),
        "o": ((h, q_out), "linear"),
        "q_norm": ((d,), "norm"),
        "k_norm": ((d,), "norm"),
        "post_norm": ((h,), "norm"),
        "router": ((s.experts, h), "linear"),
    }
    for field in hf_names.LAYER_TENSORS:
        shape, kind = dense[field]
        yield TensorSpec(hf_names.layer_tensor_name(layer, field), shape, kind)
    i = s.intermediate
    for e in range(s.experts):
        if s.fused_gate_up:
            yield TensorSpec(expert_tensor_name(layer, e, "gate_up_proj"), (2 * i, h), "expert")
        else:
            yield TensorSpec(expert_tensor_name(layer, e, "gate_proj"), (i, h), "expert")
            yield TensorSpec(expert_tensor_name(layer, e, "up_proj"), (i, h), "expert")
        yield TensorSpec(expert_tensor_name(layer, e, "down_proj"), (h, i), "expert")


def tensor_specs(shape: ModelShape) -> list[TensorSpec]:
    """Every tensor of the model, in file order (embeddings, layers, final norm, lm_head).

    A tied model (``tie_word_embeddings``) has no ``lm_head.weight``: its head is the
    embedding, as transformers and vLLM tie it.
    """
    # A tied embedding is also the head: scaled as a linear layer (rows of norm ~1), so that
    # no token's own embedding dominates its logits and greedy output is not an echo.
    embed: Kind = "linear" if shape.tie_word_embeddings else "embed"
    specs = [TensorSpec(hf_names.EMBED, (shape.vocab, shape.hidden), embed)]
    for layer in range(shape.layers):
        specs.extend(_layer_specs(layer, shape))
    specs.append(TensorSpec(hf_names.FINAL_NORM, (shape.hidden,), "norm"))
    if not shape.tie_word_embeddings:
        specs.append(TensorSpec(hf_names.LM_HEAD, (shape.vocab, shape.hidden), "linear"))
    return specs


def disk_tensors(spec: TensorSpec, quant: Quant) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, safetensors dtype class) of what ``spec`` is stored as on disk.

    The class is "int8" or "float32" for a W8A8 expert's weight and its scale / offset,
    "model" for a tensor in the model dtype.
    """
    if spec.kind != "expert" or quant == "none":
        return {spec.name: (spec.shape, "model")}
    stem = spec.name.removesuffix(".weight")
    channels = (spec.shape[0], 1)
    return {
        spec.name: (spec.shape, "int8"),
        f"{stem}.weight_scale": (channels, "float32"),
        f"{stem}.weight_offset": (channels, "float32"),
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def spec_bytes(spec: TensorSpec, dtype: torch.dtype, quant: Quant) -> int:
    """Bytes the tensor (with its W8A8 scale and offset) takes on disk."""
    kinds = {"model": dtype, "int8": torch.int8, "float32": torch.float32}
    return sum(
        _numel(shape) * torch.empty((), dtype=kinds[kind]).element_size()
        for shape, kind in disk_tensors(spec, quant).values()
    )


def _master(spec: TensorSpec, seed: int) -> torch.Tensor:
    """The float32 value of a tensor, from a generator seeded by (seed, name)."""
    digest = hashlib.sha256(f"{seed}:{spec.name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    values = torch.randn(spec.shape, generator=gen)
    if spec.kind == "norm":
        # Near 1 but not 1, so that a norm whose weight is dropped or swapped shows in the
        # outputs (the transformers comparison would not see it with all-ones weights).
        return values.mul_(NORM_SPREAD).add_(1.0)
    return values if spec.kind == "embed" else values.mul_(spec.shape[-1] ** -0.5)


def tensor_values(
    spec: TensorSpec, seed: int, dtype: torch.dtype, quant: Quant
) -> dict[str, torch.Tensor]:
    """The tensor by name, in ``dtype``; a W8A8 expert adds its scale and offset."""
    master = _master(spec, seed)
    if spec.kind != "expert" or quant == "none":
        return {spec.name: master.to(dtype)}
    q, scale = quantize_per_channel_int8(master)
    names = list(disk_tensors(spec, quant))  # weight, weight_scale, weight_offset
    return dict(zip(names, (q, scale, torch.zeros_like(scale)), strict=True))


def model_config(shape: ModelShape, dtype: str) -> dict[str, Any]:
    """The model's Qwen3-MoE ``config.json`` content (``dtype``: its torch dtype name).

    Every key transformers' ``Qwen3MoeConfig`` reads, plus ``head_dim`` (read by its
    attention and by vLLM). Rope is spelled both ways: ``rope_parameters`` as transformers
    5 writes it, and the top-level ``rope_theta`` of transformers 4 (vLLM-Ascend's pin);
    the dtype likewise as ``dtype`` and ``torch_dtype``.
    """
    ids = special_token_ids(shape.vocab)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        # The dense MLP size: unused (every layer is sparse), kept at k experts' worth.
        "intermediate_size": shape.intermediate * shape.top_k,
        "moe_intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": 0.02,
        "rms_norm_eps": RMS_NORM_EPS,
        "use_cache": True,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": shape.experts,
        "num_experts_per_tok": shape.top_k,
        "norm_topk_prob": shape.norm_topk_prob,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def generation_config(shape: ModelShape) -> dict[str, Any]:
    """``generation_config.json``: greedy decoding and the special token ids."""
    ids = special_token_ids(shape.vocab)
    return {
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "do_sample": False,
    }
