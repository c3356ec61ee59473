"""vLLM's own Qwen3-MoE loader accepts the generated checkpoint: every parameter of vLLM's
``Qwen3MoeForCausalLM`` is loaded from it (q/k/v stacked into qkv_proj, per-expert
gate/up/down into the fused expert tensors, q_norm/k_norm, the head tied or not) and holds
the file's values. Runs ``tests/integration/vllm_load_check.py`` in its own process, since
vLLM initialises torch.distributed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ftengine.weights.checkpoint_gen import make_checkpoint
from tests.integration.conftest import SIZES

pytest.importorskip("vllm.model_executor.models.qwen3_moe", reason="vllm is not installed")
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.timeout(300)
def test_vllm_loads_every_parameter_from_the_checkpoint(tmp_path: Path) -> None:
    untied = make_checkpoint(tmp_path / "untied", **SIZES)
    tied = make_checkpoint(tmp_path / "tied", **SIZES, tie_word_embeddings=True)
    command = [sys.executable, "-m", "tests.integration.vllm_load_check", str(_free_port())]
    # The wheel here has no compiled kernels, so vLLM cannot detect a platform by itself;
    # the CPU one builds the model and runs its loader (nothing here runs a forward pass).
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run(
        [*command, str(untied), str(tied)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for path in (untied, tied):
        assert report[str(path)] == {
            "unloaded": [],
            "equal": {"k_norm": True, "expert_up": True, "head": True},
        }, path
