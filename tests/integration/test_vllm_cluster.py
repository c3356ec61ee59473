"""The vLLM adapter inside the CPU reference cluster's workers, driven by vLLM's messages.

Each worker process answers commands through ``FtengineWorkerSentinel.handle_ft_command``
with vLLM's ``FaultToleranceRequest`` / ``FaultToleranceResult`` (msgpack-encoded, as they
cross processes in vLLM); the test drives the cluster with the same types. The seed's
scale-down scenario must pass: SIGKILL rank 3 mid-traffic, DEAD rejects retry, scale_down
re-hosts its experts, the survivors answer exactly as the fault-free reference.

The cluster has no seam for a command adapter yet, so this module swaps the workers'
process entry point (``supervisor.worker_main``) for :func:`vllm_worker_main`, which runs
E's worker with its sentinel wrapped by the adapter (see the report for the hook wanted).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import pytest

import ftengine.cluster.supervisor as supervisor
import ftengine.cluster.worker as cluster_worker
from ftengine.cluster import Cluster, Generation, RequestAborted, compare_outputs
from ftengine.commands import CommandResult
from ftengine.faults import Fault, FaultKind, HealthStatus, Phase
from ftengine.integrations.vllm.messages import VllmMessages
from ftengine.integrations.vllm.sentinel import FtengineWorkerSentinel
from ftengine.sentinel import WorkerSentinel
from ftengine.status import EngineStatus, PhaseChange
from tests.integration.conftest import MAX_TOKENS, PROMPTS, TIMINGS, Launcher
from tests.integration.test_cluster_e2e import Traffic, engines, wait_statuses

pytest.importorskip("vllm.v1.fault_tolerance.utils", reason="vllm is not installed")
pytestmark = pytest.mark.integration

HEALTHY, DEAD, UNHEALTHY = (
    int(s) for s in (HealthStatus.HEALTHY, HealthStatus.DEAD, HealthStatus.UNHEALTHY)
)


class VllmFacingSentinel:
    """The cluster worker's sentinel as seen through vLLM: commands go through the adapter
    as vLLM messages; everything else is the ftengine sentinel's."""

    def __init__(self, inner: WorkerSentinel, rank: int) -> None:
        self.inner = inner
        self.messages = VllmMessages.load()
        self.adapter = FtengineWorkerSentinel(inner, engine_index=rank, messages=self.messages)

    def handle_ft_command(
        self, instruction: str, params: dict[str, Any], request_id: str
    ) -> CommandResult:
        request_type: Any = self.messages.request_type
        wire = msgspec.msgpack.encode(request_type(instruction, params, request_id))
        result = self.adapter.handle_ft_command(msgspec.msgpack.decode(wire, type=request_type))
        return CommandResult(result.request_id, result.success, result.reason)

    @property
    def serving(self) -> bool:
        return self.inner.serving

    @property
    def phase(self) -> Phase:
        return self.inner.phase

    def on_fault(self, exc: BaseException, step: int | None = None) -> Fault:
        return self.adapter.on_fault(exc, step)

    def peer_fault(self, kind: FaultKind, rank: int | None, info: str) -> None:
        self.inner.peer_fault(kind, rank, info)

    def poll(self) -> None:
        self.adapter.poll()

    def status(self) -> EngineStatus:
        return self.inner.status()

    def subscribe(self, listener: Callable[[PhaseChange], None]) -> None:
        self.inner.subscribe(listener)


class VllmClusterWorker(cluster_worker.ClusterWorker):
    """E's cluster worker whose commands pass through the vLLM adapter."""

    def __init__(self, spec: cluster_worker.WorkerSpec, link: cluster_worker.Link) -> None:
        super().__init__(spec, link)
        self.sentinel = VllmFacingSentinel(self.sentinel, spec.rank)  # type: ignore[assignment]


def vllm_worker_main(spec: cluster_worker.WorkerSpec, conn: Connection) -> None:
    """Worker process entry point (runs in the spawned child)."""
    cluster_worker.ClusterWorker = VllmClusterWorker  # type: ignore[misc]
    cluster_worker.worker_main(spec, conn)


def apply(cluster: Cluster, instruction: str, params: dict[str, Any], request_id: str) -> Any:
    """Drive the cluster with vLLM's request type; answer with vLLM's result type."""
    messages = VllmMessages.load()
    request_type: Any = messages.request_type
    wire = msgspec.msgpack.encode(request_type(instruction, params, request_id))
    request = msgspec.msgpack.decode(wire, type=request_type)
    result = cluster.apply(request.instruction, request.params, request.request_id)
    return messages.result(result)


@pytest.fixture
def vllm_launch(launch: Launcher, monkeypatch: pytest.MonkeyPatch) -> Launcher:
    monkeypatch.setattr(supervisor, "worker_main", vllm_worker_main)
    return launch


@pytest.mark.timeout(240)
def test_seed_scale_down_through_the_vllm_adapter(
    vllm_launch: Launcher, reference: list[Generation]
) -> None:
    cluster = vllm_launch(start_timeout_s=180.0)
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
    TIMINGS["vllm adapter: kill rank 3"] = {
        "detect": detect,
        "recover": recover,
        "kill_to_healthy": time.monotonic() - killed,
    }
