"""The anchor nobody here wrote: transformers' own Qwen3-MoE on the same checkpoint.

transformers loads each generated checkpoint (float32, eager attention, eager experts, CPU)
with no missing or unexpected key; for a fixed prompt set (token ids and text) the
cluster's single-process reference and a DP=4 cluster must give greedy token ids identical
to ``model.generate(do_sample=False)`` and final-step logits within ``HF_LOGITS_ATOL``
(the DP=4 run for the unquantised and the W8A8 checkpoint).
Three checkpoints: the default one (bfloat16, untied head, ``norm_topk_prob``), a float32
one with a tied head, no top-k renormalisation, a different rope theta and 4 query heads
per KV head, and a W8A8 one, which the cluster serves as it is while transformers loads
its float32 copy dequantised by the cluster's own code (``write_dequantised``).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Qwen3MoeConfig
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

from ftengine.testbed.cluster import Generation, compare_outputs, reference_generate
from ftengine.testbed.cluster.model import rope, route
from ftengine.testbed.cluster.prompts import Prompt, PromptTokenizer
from ftengine.weights.checkpoint_gen import make_checkpoint
from ftengine.weights.dequantise import write_dequantised
from tests.integration.conftest import PROMPTS, SIZES, TIMINGS, Launcher

pytestmark = pytest.mark.integration

ANCHOR_PROMPTS: tuple[Prompt, ...] = (*PROMPTS, "w5 w6 w7 w8", "w42 w1 and w3 w3")
MAX_TOKENS = 6

HF_LOGITS_ATOL = 4e-6
"""Largest absolute final-logit difference allowed against transformers.

Both sides compute in float32 from the same values, so what is left is rounding from a
different order of the same operations: transformers runs each prompt as one batched
matrix product per projection, applies gate and up as one fused ``gate_up_proj`` product,
sums a token's top-k expert outputs in expert-id order (``index_add_``) and adds an
additive mask; the cluster runs experts row by row and sums in top-k order. Each differs
by a few units in the last place. Measured: at most 1.2e-6 over these checkpoints and
prompts (and over the same ones with seed 11), on logits of magnitude 2-4, where one
float32 ulp is 2.4e-7-4.8e-7; the bound leaves about 3x for other BLAS kernels and thread
counts. A real modelling difference
(a norm, rope or routing detail) moves logits by 1e-2 or more and changes tokens.
"""

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "tied": {
        "dtype": "float32",
        "tie_word_embeddings": True,
        "norm_topk_prob": False,
        "rope_theta": 10000.0,
        "kv_heads": 1,
    },
    "w8a8": {"quant": "w8a8_dynamic"},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def anchor(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(name, checkpoint the cluster serves, checkpoint transformers loads)."""
    name = str(request.param)
    root = tmp_path_factory.mktemp(f"anchor-{name}")
    served = make_checkpoint(root / "served", **{**SIZES, **VARIANTS[name]})
    loaded = write_dequantised(served, root / "dequantised") if name == "w8a8" else served
    return name, served, loaded


def load_hf(path: Path) -> PreTrainedModel:
    """transformers' Qwen3-MoE from ``path``: float32, eager, CPU, every tensor used."""
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
        output_loading_info=True,
    )
    model, info = loaded
    unused = {key: value for key, value in info.items() if value}
    assert not unused, f"transformers did not load {path} cleanly: {unused}"
    assert isinstance(model, hf.Qwen3MoeForCausalLM)
    return model


def hf_generate(path: Path, prompts: Sequence[Prompt]) -> list[Generation]:
    """Greedy generations by transformers, one prompt at a time (no padding)."""
    model: Any = load_hf(path)  # PreTrainedModel.generate is typed loosely in transformers
    tokenizer: Any = AutoTokenizer.from_pretrained(path)
    out: list[Generation] = []
    for prompt in prompts:
        ids = list(prompt) if not isinstance(prompt, str) else tokenizer(prompt)["input_ids"]
        input_ids = torch.tensor([ids])
        result = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,  # the cluster generates max_tokens, never stopping early
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = tuple(int(t) for t in result.sequences[0, len(ids) :])
        assert len(tokens) == MAX_TOKENS
        out.append(Generation(tokens, tuple(result.logits[-1][0].tolist())))
    return out


@pytest.fixture(scope="module")
def expected(anchor: Any) -> list[Generation]:
    return hf_generate(anchor[2], ANCHOR_PROMPTS)


def test_the_tokenizers_agree(anchor: Any) -> None:
    hf_tokenizer: Any = AutoTokenizer.from_pretrained(anchor[2])
    ours = PromptTokenizer(anchor[1])
    for text in (p for p in ANCHOR_PROMPTS if isinstance(p, str)):
        assert ours.encode(text) == tuple(hf_tokenizer(text)["input_ids"])
    assert ours.encode("w42 w1 and") == (42, 1, SIZES["vocab"] - 4)  # "and" is <unk>


def test_the_reference_matches_transformers(anchor: Any, expected: list[Generation]) -> None:
    check = compare_outputs(
        reference_generate(anchor[1], ANCHOR_PROMPTS, MAX_TOKENS), expected, HF_LOGITS_ATOL
    )
    assert check.match, check


# The tied variant differs only in dense math, which workers run through the same functions
# as the reference (checked above); a cluster launch costs ~15 s on this machine.
@pytest.mark.parametrize("anchor", ["default", "w8a8"], indirect=True)
@pytest.mark.timeout(240)
def test_a_dp4_cluster_matches_transformers(
    anchor: Any, expected: list[Generation], launch: Launcher
) -> None:
    started = time.monotonic()
    cluster = launch(checkpoint=anchor[1], start_timeout_s=180.0)
    launched = time.monotonic()
    got = cluster.generate_batch(ANCHOR_PROMPTS, MAX_TOKENS)
    TIMINGS[f"anchor {anchor[0]}"] = {
        "launch": launched - started,
        "generate": time.monotonic() - launched,
    }
    check = compare_outputs(got, expected, HF_LOGITS_ATOL)
    assert check.match, check


def test_a_modelling_detail_changed_is_caught(anchor: Any, expected: list[Generation]) -> None:
    """The anchor can fail: the same weights with ``norm_topk_prob`` flipped miss it."""
    served = anchor[1]
    flipped = served.parent / "flipped"
    shutil.copytree(served, flipped)
    config = json.loads((flipped / "config.json").read_text())
    config["norm_topk_prob"] = not config["norm_topk_prob"]
    (flipped / "config.json").write_text(json.dumps(config))
    check = compare_outputs(reference_generate(flipped, ANCHOR_PROMPTS, MAX_TOKENS), expected)
    assert check.max_logit_diff > 1e3 * HF_LOGITS_ATOL, check


def _hf_config(**overrides: Any) -> Qwen3MoeConfig:
    settings: dict[str, Any] = {
        "hidden_size": 16,
        "num_attention_heads": 2,
        "head_dim": 8,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
    }
    return Qwen3MoeConfig(**{**settings, **overrides})


def test_rope_and_routing_are_transformers_own() -> None:
    """Bit for bit: the same float ops in the same order as transformers' functions."""
    g = torch.Generator().manual_seed(3)
    x, positions = torch.randn(5, 2, 8, generator=g), torch.arange(3, 8)
    cos, sin = hf.Qwen3MoeRotaryEmbedding(_hf_config())(x, positions[None, :])
    heads_first = x.transpose(0, 1)[None]  # transformers' [batch, heads, T, d]
    want, _ = hf.apply_rotary_pos_emb(heads_first, heads_first, cos, sin)
    assert torch.equal(rope(x, positions, 5e5), want[0].transpose(0, 1))
    for norm in (True, False):
        router: Any = hf.Qwen3MoeTopKRouter  # untyped in transformers
        router = router(_hf_config(norm_topk_prob=norm))
        torch.nn.init.normal_(router.weight, generator=g)
        hidden = torch.randn(4, 16, generator=g)
        with torch.no_grad():
            _, weights, ids = router(hidden)
            ours_ids, ours_weights = route(router.weight, hidden, 2, norm_topk_prob=norm)
        assert torch.equal(ours_ids, ids) and torch.equal(ours_weights, weights)
