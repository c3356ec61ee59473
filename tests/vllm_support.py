"""Shared set-up of the real-vLLM tests: the tiny Hugging Face Qwen3-MoE checkpoint they
serve, transformers' greedy answers on it, ports, and the policies named by import path.

The checkpoint is ``ftengine make-checkpoint``'s (``make_checkpoint``: the one writer of
checkpoints in this project, which the cluster, transformers and vLLM all load). It is
written in bfloat16 (the generator's default, as real checkpoints ship) and served with
``--dtype float32`` (``TEST_DTYPE``), the dtype transformers computes in here, so vLLM's
greedy tokens can be compared with transformers' token for token (docs/notebook.md,
"One checkpoint": served in bfloat16 they differ).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from ftengine.testbed.vllm.demo import TINY_SHAPE
from ftengine.testbed.vllm.launcher import free_port_run as free_port_run
from ftengine.weights.checkpoint_gen import make_checkpoint

VOCAB = TINY_SHAPE["vocab"]
TEST_DTYPE = "float32"
"""vLLM's ``--dtype`` in the tests: what transformers computes in (``load_hf``)."""


def write_tiny_qwen3_moe(path: Path, *, experts: int = 8, seed: int = 0) -> Path:
    """``make_checkpoint`` of a tiny Qwen3-MoE (vocab 512, hidden 128, 2 layers,
    ``experts`` experts, top-2, expert intermediate 64, bfloat16) at ``path``; returns it.

    Prompts are words ``w0 ..`` separated by spaces. Same ``seed``, same weights.
    """
    return make_checkpoint(path, **{**TINY_SHAPE, "experts": experts}, seed=seed)


def transformers_greedy(
    checkpoint: Path, prompts: Sequence[str], max_tokens: int
) -> list[list[int]]:
    """transformers' ``generate(do_sample=False)`` token ids of each prompt (float32, eager,
    one prompt at a time, ``max_tokens`` tokens: EOS does not stop it, as ``ignore_eos``)."""
    import torch
    from transformers import AutoTokenizer

    from tests.integration.test_transformers_anchor import load_hf

    model: Any = load_hf(checkpoint)
    tokenizer: Any = AutoTokenizer.from_pretrained(checkpoint)
    out: list[list[int]] = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        result = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
        )
        out.append([int(t) for t in result[0, ids.shape[1] :]])
    return out


@attrs.define
class Comm:
    """The part of vLLM's ``CpuCommunicator`` the CPU patches read."""

    world_size: int
    rank_in_group: int
    device_group: Any = None


def gloo_patch_rank(rank: int, init_file: str, out: Any) -> None:
    """Rank ``rank`` of 2 (a spawned process; no vLLM import): all-gatherv rows 3 + 1 and
    reduce-scatterv a ``[4, 2]`` tensor of ``rank + 1`` back as 3 + 1 rows; puts
    ``(rank, gathered lists, scattered list)`` on ``out``."""
    import torch
    import torch.distributed as dist

    from ftengine.integrations.vllm.worker.cpu_collectives import all_gatherv, reduce_scatterv

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        comm = Comm(2, rank, dist.group.WORLD)
        sizes = [3, 1]
        mine = torch.arange(sizes[rank] * 2, dtype=torch.float32).reshape(-1, 2) + 10 * rank
        ids = torch.full((sizes[rank], 2), rank, dtype=torch.int32)
        gathered = all_gatherv(comm, [mine, ids], dim=0, sizes=sizes)
        scattered = reduce_scatterv(comm, torch.ones(4, 2) * (rank + 1), dim=0, sizes=sizes)
        out.put((rank, [t.tolist() for t in gathered], scattered.tolist()))
    finally:
        dist.destroy_process_group()


def retry_transient_then_wait() -> Any:
    """A custom policy factory named by import path in the tests
    (``tests.vllm_support:retry_transient_then_wait``): retry once, else abstain."""
    from ftengine.faults import FaultKind
    from ftengine.policies import Retry, as_policy

    def policy(ctx: Any) -> Any:
        if ctx.fault.kind is FaultKind.TRANSIENT and ctx.attempts == 0:
            return Retry(0.0)
        return None

    return as_policy(policy)


def not_a_policy_factory() -> int:
    """Returns something that is not a policy (the start-up check must refuse it)."""
    return 7


def ft_lines(log: str, last: int = 60) -> str:
    """The last ``last`` ``[FT]`` lines of a rank's log (its stack traces left out): what a
    failed assertion shows, so a failure on a machine whose logs are gone can be read."""
    lines = [
        line for line in log.splitlines() if "[FT]" in line and "multiproc_executor" not in line
    ]
    return "\n".join(lines[-last:])
