"""The cluster's MoE decoder math: config parsing and refusals, routing, rope, the tied head,
KV caching, lockstep empty steps (the comparison with transformers is
tests/integration/test_transformers_anchor.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ftengine.errors import ConfigError
from ftengine.testbed.cluster.model import (
    DenseWeights,
    ModelConfig,
    RequestState,
    forward_step,
    rms_norm,
    rope,
    rotate_half,
    route,
)
from ftengine.weights import hf_names

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
    "norm_topk_prob": True,
}


def dense_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random dense tensors of ``cfg`` by HF name (with an lm_head, tied or not)."""
    g = torch.Generator().manual_seed(seed)
    h, d, qd, kvd = cfg.hidden, cfg.head_dim, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    shapes = {hf_names.EMBED: (cfg.vocab, h), hf_names.FINAL_NORM: (h,)}
    shapes[hf_names.LM_HEAD] = (cfg.vocab, h)
    layer_shapes = {
        "input_norm": (h,),
        "q": (qd, h),
        "k": (kvd, h),
        "v": (kvd, h),
        "o": (h, qd),
        "q_norm": (d,),
        "k_norm": (d,),
        "post_norm": (h,),
        "router": (cfg.num_experts, h),
    }
    for layer in range(cfg.num_layers):
        for field, shape in layer_shapes.items():
            shapes[hf_names.layer_tensor_name(layer, field)] = shape
    return {name: torch.randn(shape, generator=g) * 0.5 for name, shape in shapes.items()}


def weights(cfg: ModelConfig, seed: int = 0) -> DenseWeights:
    return DenseWeights.load(dense_tensors(cfg, seed).__getitem__, cfg)


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
    with pytest.raises(ConfigError, match=r"ck/config\.json: no 'num_experts'"):
        ModelConfig.from_hf(broken, source="ck/config.json")


def test_rms_norm_scales_rows_to_unit_rms() -> None:
    x = torch.tensor([[3.0, 4.0]])
    out = rms_norm(x, torch.ones(2), 0.0)
    assert torch.allclose(out.pow(2).mean(), torch.tensor(1.0))


def test_route_picks_top_k_with_weights_summing_to_one() -> None:
    router = torch.eye(4)
    ids, w = route(router, torch.tensor([[0.0, 5.0, 1.0, 4.0]]), 2, norm_topk_prob=True)
    assert ids.tolist() == [[1, 3]]
    assert torch.allclose(w.sum(dim=-1), torch.ones(1))


def test_route_without_norm_topk_prob_keeps_the_softmax_probabilities() -> None:
    hidden = torch.tensor([[0.0, 5.0, 1.0, 4.0]])
    ids, w = route(torch.eye(4), hidden, 2, norm_topk_prob=False)
    probs = torch.softmax(hidden, dim=-1)[0]
    assert ids.tolist() == [[1, 3]]
    assert torch.equal(w[0], probs[[1, 3]])
    assert float(w.sum()) < 1.0


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


def test_rotate_half_and_rope_at_position_zero() -> None:
    x = torch.arange(8.0).view(1, 2, 4)
    assert rotate_half(x)[0, 0].tolist() == [-2.0, -3.0, 0.0, 1.0]
    assert torch.equal(rope(x, torch.tensor([0]), 10000.0), x)  # angle 0: no rotation


def test_rope_scores_depend_only_on_the_distance() -> None:
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 8, generator=g), torch.randn(1, 1, 8, generator=g)

    def score(i: int, j: int) -> float:
        rq = rope(q, torch.tensor([i]), 1000.0)
        rk = rope(k, torch.tensor([j]), 1000.0)
        return float((rq * rk).sum())

    assert score(5, 2) == pytest.approx(score(13, 10), abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("mlp_only_layers", [0]),
        ("decoder_sparse_step", 2),
        ("use_sliding_window", True),
        ("hidden_act", "gelu"),
        ("attention_bias", True),
        ("model_type", "qwen2_moe"),
    ],
)
def test_unsupported_settings_are_refused_naming_the_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"ckpt/config.json: {key}="):
        ModelConfig.from_hf({**HF, key: value}, source="ckpt/config.json")
    assert ModelConfig.from_hf({**HF, "mlp_only_layers": [], "decoder_sparse_step": 1})


def test_scaled_or_partial_rope_is_refused() -> None:
    scaled = {**HF, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ConfigError, match="rope_type='yarn'"):
        ModelConfig.from_hf(scaled)
    with pytest.raises(ConfigError, match="rope_type='linear'"):
        ModelConfig.from_hf({**HF, "rope_scaling": {"type": "linear", "factor": 2.0}})
    partial = {**HF, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        ModelConfig.from_hf(partial)


def test_rope_theta_is_read_as_transformers_5_reads_it() -> None:
    assert ModelConfig.from_hf(HF).rope_theta == 10000.0  # transformers' default_theta
    assert ModelConfig.from_hf({**HF, "rope_theta": 5e5}).rope_theta == 5e5
    both = {**HF, "rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert ModelConfig.from_hf(both).rope_theta == 1e6


def test_defaults_follow_transformers_and_types_are_checked() -> None:
    cfg = ModelConfig.from_hf(
        {k: v for k, v in HF.items() if k not in ("head_dim", "norm_topk_prob")}
    )
    assert (cfg.head_dim, cfg.norm_topk_prob, cfg.tie_word_embeddings) == (4, False, False)
    assert cfg.rms_eps == 1e-6
    with pytest.raises(ConfigError, match="'norm_topk_prob' has the wrong type"):
        ModelConfig.from_hf({**HF, "norm_topk_prob": "yes"})
    with pytest.raises(ConfigError, match="'hidden_size' must be int"):
        ModelConfig.from_hf({**HF, "hidden_size": "wide"})
    with pytest.raises(ConfigError, match=r"x\.json: .*num_attention_heads divisible"):
        ModelConfig.from_hf({**HF, "num_key_value_heads": 3}, source="x.json")


def test_a_tied_head_is_the_embedding_and_lm_head_is_not_read() -> None:
    cfg = ModelConfig.from_hf({**HF, "tie_word_embeddings": True})
    tensors = dense_tensors(cfg)
    del tensors[hf_names.LM_HEAD]
    tied = DenseWeights.load(tensors.__getitem__, cfg)
    assert tied.lm_head is tied.embed
    untied = weights(ModelConfig.from_hf(HF))
    assert not torch.equal(untied.lm_head, untied.embed)


def test_q_and_k_norms_change_the_outputs() -> None:
    cfg = ModelConfig.from_hf(HF)
    tensors = dense_tensors(cfg)
    base = forward_step(cfg, weights(cfg), [(RequestState("a"), [1, 2, 3])], ScaleMoe())[0]
    for field in ("q_norm", "k_norm"):
        changed = dict(tensors)
        name = hf_names.layer_tensor_name(0, field)
        changed[name] = changed[name] * 2.0
        out = forward_step(
            cfg,
            DenseWeights.load(changed.__getitem__, cfg),
            [(RequestState("a"), [1, 2, 3])],
            ScaleMoe(),
        )[0]
        assert not torch.allclose(out, base), field
