"""The small Qwen3-MoE-style decoder the CPU cluster serves, written so that its numbers
do not depend on batching or on which rank hosts an expert.

Every dense op (embedding, norms, attention, router, head) runs per request on exactly
the shapes a single-process run uses; experts run one token row at a time and the top-k
outputs are summed in a fixed k order, all in float32 (``ftengine.backends.cpu_moe``).
So a distributed run, with any placement and any batch mix, reproduces the single-process
reference bit for bit on one machine (``reference.LOGITS_ATOL`` only covers BLAS variation).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch

from ftengine.errors import ConfigError

Tensor = torch.Tensor


@attrs.frozen
class ModelConfig:
    """Model sizes read from a checkpoint's ``config.json`` (HF Qwen3-MoE key names)."""

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
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Build from a HF config dict; raises ConfigError naming a missing key."""
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            return cls(
                hidden=hidden,
                intermediate=int(config["moe_intermediate_size"]),
                num_experts=int(config["num_experts"]),
                top_k=int(config["num_experts_per_tok"]),
                num_layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads", heads)),
                head_dim=int(config.get("head_dim", hidden // heads)),
                vocab=int(config["vocab_size"]),
                rms_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(config.get("rope_theta", 10000.0)),
            )
        except KeyError as exc:
            raise ConfigError(
                f"checkpoint config.json lacks {exc.args[0]!r}; expected a Qwen3-MoE style "
                "config as written by `ftengine make-checkpoint`"
            ) from exc


@attrs.frozen(eq=False)
class LayerWeights:
    """One decoder layer's dense weights (float32, HF ``[out, in]`` layout)."""

    input_norm: Tensor  # [H]
    q: Tensor  # [heads * head_dim, H]
    k: Tensor  # [kv_heads * head_dim, H]
    v: Tensor  # [kv_heads * head_dim, H]
    o: Tensor  # [H, heads * head_dim]
    post_norm: Tensor  # [H]
    router: Tensor  # [E, H]


@attrs.frozen(eq=False)
class DenseWeights:
    """Every non-expert weight of the model (float32)."""

    embed: Tensor  # [V, H]
    layers: tuple[LayerWeights, ...]
    final_norm: Tensor  # [H]
    lm_head: Tensor  # [V, H]

    @classmethod
    def load(cls, read: Callable[[str], Tensor], num_layers: int) -> DenseWeights:
        """Read the dense tensors by HF name through ``read`` (e.g. ``CheckpointIndex.read``)."""

        def get(name: str) -> Tensor:
            return read(name).to(torch.float32).contiguous()

        layers = []
        for layer in range(num_layers):
            p = f"model.layers.{layer}"
            layers.append(
                LayerWeights(
                    input_norm=get(f"{p}.input_layernorm.weight"),
                    q=get(f"{p}.self_attn.q_proj.weight"),
                    k=get(f"{p}.self_attn.k_proj.weight"),
                    v=get(f"{p}.self_attn.v_proj.weight"),
                    o=get(f"{p}.self_attn.o_proj.weight"),
                    post_norm=get(f"{p}.post_attention_layernorm.weight"),
                    router=get(f"{p}.mlp.gate.weight"),
                )
            )
        return cls(
            embed=get("model.embed_tokens.weight"),
            layers=tuple(layers),
            final_norm=get("model.norm.weight"),
            lm_head=get("lm_head.weight"),
        )


class MoeLayerFn(Protocol):
    """Runs one MoE layer for this rank's tokens (locally or over the EP group).

    ``hidden [T, H]`` float32, ``topk_ids [T, k]`` int64 logical experts, ``topk_weights
    [T, k]`` float32, ``keys [T]`` int64 (replica choice); returns ``[T, H]``. Ranks with no
    tokens still call it with ``T = 0`` so that collectives stay in lockstep.
    """

    def __call__(
        self, layer: int, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, keys: Tensor
    ) -> Tensor: ...


@attrs.define
class RequestState:
    """One request's decoding state on the rank that serves it (its KV cache stays there)."""

    request_id: str
    num_tokens: int = 0  # tokens already in the cache
    cache: list[tuple[Tensor, Tensor]] = attrs.field(factory=list)  # per layer K, V


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotary embedding (half-split) of ``x [T, heads, d]`` at integer ``positions [T]``."""
    d = x.shape[-1]
    half = d // 2
    inv = 1.0 / (theta ** (torch.arange(half, dtype=torch.float32) / half))
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention(
    cfg: ModelConfig, w: LayerWeights, h: Tensor, state: RequestState, layer: int
) -> Tensor:
    """Causal GQA attention of ``h [T, H]`` (new tokens) against the request's KV cache."""
    t = h.shape[0]
    start = state.num_tokens
    positions = torch.arange(start, start + t)
    q = _rope((h @ w.q.T).view(t, cfg.heads, cfg.head_dim), positions, cfg.rope_theta)
    k = _rope((h @ w.k.T).view(t, cfg.kv_heads, cfg.head_dim), positions, cfg.rope_theta)
    v = (h @ w.v.T).view(t, cfg.kv_heads, cfg.head_dim)
    if layer < len(state.cache):
        k_old, v_old = state.cache[layer]
        k, v = torch.cat([k_old, k]), torch.cat([v_old, v])
        state.cache[layer] = (k, v)
    else:
        state.cache.append((k, v))
    group = cfg.heads // cfg.kv_heads
    kk = k.repeat_interleave(group, dim=1)  # [S, heads, d]
    vv = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, kk) / math.sqrt(cfg.head_dim)
    total = kk.shape[0]
    allowed = torch.arange(total)[None, :] <= positions[:, None]  # [T, S]
    scores = scores.masked_fill(~allowed[None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hts,shd->thd", probs, vv).reshape(t, cfg.heads * cfg.head_dim)
    return out @ w.o.T


def route(router: Tensor, hidden: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Top-k softmax routing: ``(ids [T, k] int64, weights [T, k] float32)``, renormalised."""
    probs = torch.softmax(hidden @ router.T, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


def forward_step(
    cfg: ModelConfig,
    weights: DenseWeights,
    batch: Sequence[tuple[RequestState, Sequence[int]]],
    moe: MoeLayerFn,
) -> list[Tensor]:
    """Run one step for this rank's requests; returns each request's last-token logits [V].

    ``batch`` pairs each request with its new token ids (the prompt on the first step,
    then the previous output); caches grow in place. An empty batch still runs every MoE
    layer with zero tokens (the lockstep dummy step).
    """
    xs = [weights.embed[torch.tensor(list(ids), dtype=torch.long)] for _, ids in batch]
    keys = torch.cat(
        [torch.arange(s.num_tokens, s.num_tokens + len(ids)) for s, ids in batch]
        or [torch.zeros(0, dtype=torch.long)]
    )
    for layer, lw in enumerate(weights.layers):
        normed, ids_l, w_l = [], [], []
        for i, (state, _) in enumerate(batch):
            xs[i] = xs[i] + attention(
                cfg, lw, rms_norm(xs[i], lw.input_norm, cfg.rms_eps), state, layer
            )
            n = rms_norm(xs[i], lw.post_norm, cfg.rms_eps)
            topk, wts = route(lw.router, n, cfg.top_k)
            normed.append(n)
            ids_l.append(topk)
            w_l.append(wts)
        hidden = torch.cat(normed) if normed else torch.zeros(0, cfg.hidden)
        topk_ids = torch.cat(ids_l) if ids_l else torch.zeros(0, cfg.top_k, dtype=torch.long)
        topk_w = torch.cat(w_l) if w_l else torch.zeros(0, cfg.top_k)
        out = moe(layer, hidden, topk_ids, topk_w, keys)
        parts = torch.split(out, [x.shape[0] for x in xs])
        xs = [x + part for x, part in zip(xs, parts, strict=True)]
    logits = []
    for i, (state, ids) in enumerate(batch):
        state.num_tokens += len(ids)
        last = rms_norm(xs[i][-1:], weights.final_norm, cfg.rms_eps)
        logits.append((last @ weights.lm_head.T)[0])
    return logits
