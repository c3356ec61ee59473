"""The single-process, fault-free reference run and the check that a cluster's outputs match it.

The reference holds every logical expert in its own slot (slot ``e`` = expert ``e``),
loaded and dequantised by the same weights code the workers use, and runs the same
model functions on the same per-request shapes with one torch thread. So token ids
must be identical and logits agree bit for bit in practice; ``LOGITS_ATOL`` (absolute,
float32) only leaves room for BLAS kernels that differ between processes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import attrs
import torch

from ftengine.testbed.cluster.checkpoint_check import validate_checkpoint
from ftengine.testbed.cluster.generation import Generation
from ftengine.testbed.cluster.model import DenseWeights, ModelConfig, RequestState, forward_step
from ftengine.testbed.cluster.prompts import Prompt, PromptTokenizer
from ftengine.testbed.cpu.moe import LocalMoe
from ftengine.weights.reload import load_experts_into_slots
from ftengine.weights.slots import ExpertSlots

LOGITS_ATOL = 1e-5
"""Largest absolute difference allowed between a cluster's and the reference's final logits."""


class _AllExperts:
    """Slot ``e`` holds logical expert ``e`` of every layer."""

    def __init__(self, slots: ExpertSlots) -> None:
        self._slots = slots
        self._cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def w13(self, layer: int, slot: int) -> torch.Tensor:
        return self._get(layer, slot)[0]

    def w2(self, layer: int, slot: int) -> torch.Tensor:
        return self._get(layer, slot)[1]

    def _get(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        if (layer, slot) not in self._cache:
            self._cache[(layer, slot)] = (
                self._slots.w13_float(layer, slot),
                self._slots.w2_float(layer, slot),
            )
        return self._cache[(layer, slot)]


@contextmanager
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reference_generate(
    checkpoint: str | Path, prompts: Sequence[Prompt], max_tokens: int
) -> list[Generation]:
    """Greedy-generate ``max_tokens`` tokens per prompt in this process, with no faults.

    Prompts are token ids or text (tokenised as the cluster does). Steps exactly as the
    cluster does: all prompts prefilled in step 0, then one token per request per step
    (no stop at the end-of-sequence token, like the cluster).
    """
    index = validate_checkpoint(checkpoint)
    token_ids = PromptTokenizer(checkpoint).encode_all(prompts)
    cfg = ModelConfig.from_hf(index.config)
    dense = DenseWeights.load(index.read, cfg)
    slots = ExpertSlots.allocate(index, cfg.num_layers, cfg.num_experts)
    load_experts_into_slots(
        index,
        slots,
        [(layer, e, e) for layer in range(cfg.num_layers) for e in range(cfg.num_experts)],
    )
    moe = LocalMoe(_AllExperts(slots))
    states = [RequestState(f"ref-{i}") for i in range(len(prompts))]
    generated: list[list[int]] = [[] for _ in prompts]
    final: list[tuple[float, ...]] = [() for _ in prompts]
    with _one_thread():
        for _ in range(max_tokens):
            feed = [p if not g else (g[-1],) for p, g in zip(token_ids, generated, strict=True)]
            logits = forward_step(cfg, dense, list(zip(states, feed, strict=True)), moe)
            for i, row in enumerate(logits):
                generated[i].append(int(torch.argmax(row)))
                final[i] = tuple(row.tolist())
    return [Generation(tuple(g), f) for g, f in zip(generated, final, strict=True)]


@attrs.frozen
class OutputsCheck:
    """How a cluster's outputs compare with the reference's.

    ``match``: every token id identical and every logit within ``atol``;
    ``token_mismatches``: indexes of prompts whose token ids differ;
    ``max_logit_diff``: the largest absolute final-logit difference seen.
    """

    match: bool
    token_mismatches: tuple[int, ...]
    max_logit_diff: float
    atol: float

    def to_dict(self) -> dict[str, object]:
        return {
            "match": self.match,
            "token_mismatches": list(self.token_mismatches),
            "max_logit_diff": self.max_logit_diff,
            "atol": self.atol,
        }


def compare_outputs(
    got: Sequence[Generation], want: Sequence[Generation], atol: float = LOGITS_ATOL
) -> OutputsCheck:
    """Compare generations prompt by prompt (token ids exactly, final logits within ``atol``)."""
    if len(got) != len(want):
        return OutputsCheck(False, tuple(range(max(len(got), len(want)))), float("inf"), atol)
    mismatches = tuple(
        i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g.token_ids != w.token_ids
    )
    diff = 0.0
    for g, w in zip(got, want, strict=True):
        a, b = torch.tensor(g.final_logits), torch.tensor(w.final_logits)
        diff = max(diff, float((a - b).abs().max()) if a.shape == b.shape else float("inf"))
    return OutputsCheck(not mismatches and diff <= atol, mismatches, diff, atol)
