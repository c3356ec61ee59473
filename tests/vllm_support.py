"""Shared set-up of the real-vLLM tests: a tiny Hugging Face Qwen3-MoE checkpoint.

``write_tiny_qwen3_moe`` is the one place that writes it (transformers' ``Qwen3MoeConfig`` +
``save_pretrained`` and a ``tokenizers`` WordLevel tokenizer, REFERENCE.md section 9); when
``ftengine make-checkpoint`` writes real HF Qwen3-MoE checkpoints this is swapped for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

VOCAB = 512
WORDS = tuple(f"w{i}" for i in range(VOCAB - 2))
UNK, EOS = "<unk>", "<eos>"


def write_tiny_qwen3_moe(path: Path, *, experts: int = 8, seed: int = 0) -> Path:
    """A random-weight float32 Qwen3-MoE (vocab 512, hidden 128, 2 layers, ``experts``
    experts, top-2, moe_intermediate 64) and its tokenizer at ``path``; returns ``path``.

    Prompts are words ``w0 .. w509`` separated by spaces. Same ``seed``, same weights.
    """
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    settings: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=experts,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=512,
        # Wider than the default 0.02, so greedy picks are not near-ties that a different
        # float summation order (EP vs one process) could flip.
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=VOCAB - 1,
        pad_token_id=None,
        dtype="float32",
    )
    config = Qwen3MoeConfig(**settings)
    torch.manual_seed(seed)
    build: Any = Qwen3MoeForCausalLM  # transformers' stubs type its wrapped constructor oddly
    model = build(config).to(torch.float32).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path)
    return path


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {word: i for i, word in enumerate(WORDS)}
    vocab[UNK] = VOCAB - 2
    vocab[EOS] = VOCAB - 1
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK,
        "eos_token": EOS,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))


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

    from ftengine.integrations.vllm.patches import all_gatherv, reduce_scatterv

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


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """A port P with P .. P + count - 1 all free now (the launcher's rank r uses P + r)."""
    import socket

    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((host, 0))
            first = int(probe.getsockname()[1])
        if first + count > 65535:
            continue
        try:
            for port in range(first, first + count):
                with socket.socket() as sock:
                    sock.bind((host, port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no run of {count} free ports found on {host}")


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
