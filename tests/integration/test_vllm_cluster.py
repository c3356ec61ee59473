"""The vLLM adapter inside the CPU reference cluster's workers, driven by vLLM's messages.

The cluster is launched with ``command_adapter`` naming
``ftengine.testbed.vllm.cluster_adapter:vllm_command_adapter``: each worker process
answers commands through ``VllmCommands.run`` with vLLM's
``FaultToleranceRequest`` / ``FaultToleranceResult`` (msgpack-encoded, as they cross
processes in vLLM); the test drives the cluster with the same types. The SIGKILL + scale-down
run must pass: SIGKILL rank 3 mid-traffic, DEAD rejects retry, scale_down re-hosts its
experts, the survivors answer exactly as the fault-free reference.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ftengine.faults import HealthStatus
from ftengine.integrations.vllm.messages import VllmMessages
from ftengine.testbed.cluster import Cluster, Generation, RequestAborted, compare_outputs
from tests.integration.conftest import MAX_TOKENS, PROMPTS, TIMINGS, Launcher
from tests.integration.test_cluster_e2e import Traffic, engines, wait_statuses

pytest.importorskip("vllm.v1.fault_tolerance.utils", reason="vllm is not installed")
pytestmark = pytest.mark.integration

HEALTHY, DEAD, UNHEALTHY = (
    int(s) for s in (HealthStatus.HEALTHY, HealthStatus.DEAD, HealthStatus.UNHEALTHY)
)
VLLM_ADAPTER = "ftengine.testbed.vllm.cluster_adapter:vllm_command_adapter"


def apply(cluster: Cluster, instruction: str, params: dict[str, Any], request_id: str) -> Any:
    """Drive the cluster with vLLM's request type; answer with vLLM's result type."""
    messages = VllmMessages.load()
    request_type: Any = messages.request_type
    wire = msgspec.msgpack.encode(request_type(instruction, params, request_id))
    request = msgspec.msgpack.decode(wire, type=request_type)
    result = cluster.apply(request.instruction, request.params, request.request_id)
    return messages.result(result)


@pytest.mark.timeout(240)
def test_seed_scale_down_through_the_vllm_adapter(
    launch: Launcher, reference: list[Generation]
) -> None:
    cluster = launch(start_timeout_s=180.0, command_adapter=VLLM_ADAPTER)
    healthy = apply(cluster, "retry", {}, "too-early")
    # the workers' adapter answered, in vLLM's words, before any engine acted
    assert not healthy.success
    assert "[FT] Rejecting retry on engine 0: status is HEALTHY" in healthy.reason

    traffic = Traffic(cluster)
    killed = time.monotonic()
    cluster.kill(3, signal.SIGKILL)
    detect = wait_statuses(cluster, {3: DEAD, 0: UNHEALTHY, 1: UNHEALTHY, 2: UNHEALTHY}, 10.0)
    assert isinstance(traffic.stopped(), RequestAborted)

    retry = apply(cluster, "retry", {}, "vllm-retry")
    assert not retry.success and "status is DEAD" in retry.reason

    start = time.monotonic()
    result = apply(cluster, "scale_down", {"removed_dp_ranks": [3]}, "vllm-scale-down")
    recover = time.monotonic() - start
    assert type(result).__name__ == "FaultToleranceResult"
    assert (result.request_id, result.success, result.reason) == ("vllm-scale-down", True, None)
    state = engines(cluster)
    for rank in (0, 1, 2):
        assert state[rank]["status"] == HEALTHY, state[rank]
        assert state[rank]["removed_ranks"] == [3]
    assert state[3]["status"] == DEAD
    check = compare_outputs(cluster.generate_batch(PROMPTS, MAX_TOKENS), reference)
    assert check.match, check
    # The cluster's workers are no vLLM workers: their parent (this process, the
    # supervisor) is no engine core, so the adapter must leave no status file for it.
    left = list(Path(tempfile.gettempdir()).glob(f"ftengine-status-{os.getpid()}-*"))
    assert not left, f"the vLLM adapter left status files in a CPU cluster: {left}"
    TIMINGS["vllm adapter: kill rank 3"] = {
        "detect": detect,
        "recover": recover,
        "kill_to_healthy": time.monotonic() - killed,
    }
