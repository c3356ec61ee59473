"""The Qwen3-MoE decoder the CPU cluster serves, computed as transformers'
``modeling_qwen3_moe`` defines it and written so that its numbers do not depend on
batching or on which rank hosts an expert.

Per layer: RMSNorm, attention (q/k/v projections, per-head RMSNorm of q and k over
head_dim, rotary embedding with transformers' ``rotate_half`` convention, GQA, scaled
softmax), residual, RMSNorm, a softmax top-k router (renormalised when ``norm_topk_prob``)
and SiLU-gated experts, residual; then the final norm and the (tied or untied) head.
Every dense op runs per request on exactly the shapes a single-process run uses; experts
run one token row at a time and the top-k outputs are summed in a fixed k order, all in
float32 (``ftengine.testbed.cpu.moe``). So a distributed run, with any placement and any
batch mix, reproduces the single-process reference bit for bit on one machine
(``reference.LOGITS_ATOL`` only covers BLAS variation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import torch
import torch.nn.functional as F

from ftengine.testbed.cluster.model_config import ModelConfig
from ftengine.weights import hf_names

__all__ = [
    "DenseWeights",
    "LayerWeights",
    "ModelConfig",
    "MoeLayerFn",
    "RequestState",
    "attention",
    "forward_step",
    "rms_norm",
    "rope",
    "route",
]

Tensor = torch.Tensor


@attrs.frozen(eq=False)
class LayerWeights:
    """One decoder layer's dense weights (float32, HF ``[out, in]`` layout).

    Field names are the keys of ``hf_names.LAYER_TENSORS`` (their checkpoint names).
    """

    input_norm: Tensor  # [H]
    q: Tensor  # [heads * head_dim, H]
    k: Tensor  # [kv_heads * head_dim, H]
    v: Tensor  # [kv_heads * head_dim, H]
    o: Tensor  # [H, heads * head_dim]
    q_norm: Tensor  # [head_dim]
    k_norm: Tensor  # [head_dim]
    post_norm: Tensor  # [H]
    router: Tensor  # [E, H]


@attrs.frozen(eq=False)
class DenseWeights:
    """Every non-expert weight of the model (float32); ``lm_head`` is ``embed`` when tied."""

    embed: Tensor  # [V, H]
    layers: tuple[LayerWeights, ...]
    final_norm: Tensor  # [H]
    lm_head: Tensor  # [V, H]

    @classmethod
    def load(cls, read: Callable[[str], Tensor], cfg: ModelConfig) -> DenseWeights:
        """Read the dense tensors by HF name through ``read`` (e.g. ``CheckpointIndex.read``)."""

        def get(name: str) -> Tensor:
            return read(name).to(torch.float32).contiguous()

        def layer(index: int) -> LayerWeights:
            names = {
                field: hf_names.layer_tensor_name(index, field) for field in hf_names.LAYER_TENSORS
            }
            return LayerWeights(**{field: get(name) for field, name in names.items()})

        layers = tuple(layer(index) for index in range(cfg.num_layers))
        embed = get(hf_names.EMBED)
        return cls(
            embed=embed,
            layers=layers,
            final_norm=get(hf_names.FINAL_NORM),
            lm_head=embed if cfg.tie_word_embeddings else get(hf_names.LM_HEAD),
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
    """RMSNorm over the last dim (``Qwen3MoeRMSNorm``: normalise, then scale by ``weight``)."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (transformers' rotary convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotary embedding of ``x [T, heads, d]`` at integer ``positions [T]`` with base ``theta``.

    The same float ops as transformers' default rope: ``inv_freq = 1 / theta^(2i/d)``,
    angles ``position * inv_freq`` repeated over both halves, ``x cos + rotate_half(x) sin``.
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, d]
    return x * emb.cos() + rotate_half(x) * emb.sin()


def _project_qkv(
    cfg: ModelConfig, w: LayerWeights, h: Tensor, positions: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """q ``[T, heads, d]``, k and v ``[T, kv_heads, d]``; q and k RMS-normed per head, roped."""
    t, eps = h.shape[0], cfg.rms_eps
    q = rms_norm(F.linear(h, w.q).view(t, cfg.heads, cfg.head_dim), w.q_norm, eps)
    k = rms_norm(F.linear(h, w.k).view(t, cfg.kv_heads, cfg.head_dim), w.k_norm, eps)
    v = F.linear(h, w.v).view(t, cfg.kv_heads, cfg.head_dim)
    return rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta), v


def attention(
    cfg: ModelConfig, w: LayerWeights, h: Tensor, state: RequestState, layer: int
) -> Tensor:
    """Causal GQA attention of ``h [T, H]`` (new tokens) against the request's KV cache."""
    t = h.shape[0]
    positions = torch.arange(state.num_tokens, state.num_tokens + t)
    q, k, v = _project_qkv(cfg, w, h, positions)
    if layer < len(state.cache):
        k_old, v_old = state.cache[layer]
        k, v = torch.cat([k_old, k]), torch.cat([v_old, v])
        state.cache[layer] = (k, v)
    else:
        state.cache.append((k, v))
    group = cfg.heads // cfg.kv_heads
    kk = k.repeat_interleave(group, dim=1).permute(1, 2, 0)  # [heads, d, S]
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, S, d]
    scores = torch.matmul(q.transpose(0, 1), kk) * cfg.head_dim**-0.5  # [heads, T, S]
    allowed = torch.arange(kk.shape[-1])[None, :] <= positions[:, None]  # [T, S]
    scores = scores.masked_fill(~allowed[None, :, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vv)  # [heads, T, d]
    return F.linear(out.transpose(0, 1).reshape(t, cfg.heads * cfg.head_dim), w.o)


def route(
    router: Tensor, hidden: Tensor, top_k: int, *, norm_topk_prob: bool
) -> tuple[Tensor, Tensor]:
    """Top-k softmax routing: ``(ids [T, k] int64, weights [T, k] float32)``.

    The softmax is over all experts; with ``norm_topk_prob`` the k weights are rescaled to
    sum to 1 (``Qwen3MoeTopKRouter``).
    """
    probs = torch.softmax(F.linear(hidden, router), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


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
            topk, wts = route(lw.router, n, cfg.top_k, norm_topk_prob=cfg.norm_topk_prob)
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
        logits.append(F.linear(last, weights.lm_head)[0])
    return logits
