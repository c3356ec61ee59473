"""Load generated checkpoints into vLLM's own ``Qwen3MoeForCausalLM`` with vLLM's weight loader
and report, as JSON on stdout, which parameters stayed unloaded and which loaded tensors
differ from the files. Run as ``python -m tests.integration.vllm_load_check PORT PATH...``
with ``VLLM_TARGET_DEVICE=cpu``: it initialises torch.distributed (a world of one over
gloo), so it runs in its own process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


def _join_world_of_one(port: str) -> None:
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        parallel_state,
    )

    state: Any = parallel_state  # model_parallel_is_initialized is untyped
    if state.model_parallel_is_initialized():
        return
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
    )
    initialize_model_parallel(1, 1)


def check(path: Path, port: str) -> dict[str, Any]:
    """What vLLM's loader did with the checkpoint at ``path``."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.models import qwen3_moe

    model_class: Any = qwen3_moe.Qwen3MoeForCausalLM  # abstract to mypy (lora_manager)

    config = VllmConfig(
        model_config=ModelConfig(model=str(path), dtype="float32", skip_tokenizer_init=True)
    )
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    with set_current_vllm_config(config):
        _join_world_of_one(port)
        model = model_class(vllm_config=config)
        loaded = model.load_weights(iter(tensors.items()))
    params = dict(model.named_parameters())
    layer = "model.layers.1"
    experts = params[f"{layer}.mlp.experts.routed_experts.w13_weight"]  # [E, 2I, H]
    inter = experts.shape[1] // 2
    same = {
        "k_norm": torch.equal(
            params[f"{layer}.self_attn.k_norm.weight"],
            tensors[f"{layer}.self_attn.k_norm.weight"].float(),
        ),
        "expert_up": torch.equal(
            experts[2, inter:], tensors[f"{layer}.mlp.experts.2.up_proj.weight"].float()
        ),
        # A tied head is the embedding's parameter, so named_parameters() lists it once.
        "head": torch.equal(
            model.lm_head.weight,
            tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]).float(),
        ),
    }
    return {"unloaded": sorted(set(params) - set(loaded)), "equal": same}


def main(port: str, *paths: str) -> None:
    print(json.dumps({path: check(Path(path), port) for path in paths}))


if __name__ == "__main__":
    main(*sys.argv[1:])
