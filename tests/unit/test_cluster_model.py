"""The cluster's MoE decoder math: config parsing, routing, KV caching, lockstep empty steps."""

from __future__ import annotations

import pytest
import torch

from ftengine.cluster.model import (
    DenseWeights,
    ModelConfig,
    RequestState,
    forward_step,
    rms_norm,
    route,
)
from ftengine.errors import ConfigError

HF = {
    "hidden_size": 16,
    "moe_intermediate_size": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "vocab_size": 32,
}


def weights(cfg: ModelConfig, seed: int = 0) -> DenseWeights:
    g = torch.Generator().manual_seed(seed)
    h, qd, kvd = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    shapes = {
        "model.embed_tokens.weight": (cfg.vocab, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg.vocab, h),
    }
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (qd, h),
            f"{p}.self_attn.k_proj.weight": (kvd, h),
            f"{p}.self_attn.v_proj.weight": (kvd, h),
            f"{p}.self_attn.o_proj.weight": (h, qd),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.mlp.gate.weight": (cfg.num_experts, h),
        }
    tensors = {name: torch.randn(shape, generator=g) * 0.5 for name, shape in shapes.items()}
    return DenseWeights.load(tensors.__getitem__, cfg.num_layers)


class ScaleMoe:
    """A stand-in MoE layer: doubles its input; records the token counts it was called with."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        keys: torch.Tensor,
    ) -> torch.Tensor:
        self.calls.append((layer, hidden.shape[0]))
        assert topk_ids.shape == (hidden.shape[0], 2) and keys.shape == (hidden.shape[0],)
        return hidden * 2


def test_config_from_hf_and_missing_keys() -> None:
    cfg = ModelConfig.from_hf(HF)
    assert (cfg.hidden, cfg.num_experts, cfg.top_k, cfg.kv_heads, cfg.head_dim) == (16, 4, 2, 2, 4)
    broken = {k: v for k, v in HF.items() if k != "num_experts"}
    with pytest.raises(ConfigError, match="num_experts"):
        ModelConfig.from_hf(broken)


def test_rms_norm_scales_rows_to_unit_rms() -> None:
    x = torch.tensor([[3.0, 4.0]])
    out = rms_norm(x, torch.ones(2), 0.0)
    assert torch.allclose(out.pow(2).mean(), torch.tensor(1.0))


def test_route_picks_top_k_with_weights_summing_to_one() -> None:
    router = torch.eye(4)
    ids, w = route(router, torch.tensor([[0.0, 5.0, 1.0, 4.0]]), 2)
    assert ids.tolist() == [[1, 3]]
    assert torch.allclose(w.sum(dim=-1), torch.ones(1))


def test_empty_step_still_runs_every_moe_layer_with_zero_tokens() -> None:
    cfg = ModelConfig.from_hf(HF)
    moe = ScaleMoe()
    assert forward_step(cfg, weights(cfg), [], moe) == []
    assert moe.calls == [(0, 0), (1, 0)]


def test_decoding_with_the_kv_cache_matches_a_longer_prefill() -> None:
    cfg = ModelConfig.from_hf(HF)
    w = weights(cfg)
    whole = forward_step(cfg, w, [(RequestState("a"), [1, 2, 3, 4])], ScaleMoe())[0]
    state = RequestState("b")
    forward_step(cfg, w, [(state, [1, 2, 3])], ScaleMoe())
    stepped = forward_step(cfg, w, [(state, [4])], ScaleMoe())[0]
    assert state.num_tokens == 4 and len(state.cache) == cfg.num_layers
    assert torch.allclose(whole, stepped, atol=1e-5)


def test_requests_in_one_step_do_not_change_each_others_numbers() -> None:
    cfg = ModelConfig.from_hf(HF)
    w = weights(cfg)
    alone = forward_step(cfg, w, [(RequestState("a"), [5, 6])], ScaleMoe())[0]
    mixed = forward_step(
        cfg, w, [(RequestState("x"), [9, 9, 9]), (RequestState("a"), [5, 6])], ScaleMoe()
    )[1]
    assert torch.equal(alone, mixed)
