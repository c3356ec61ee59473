"""The nine end-to-end fault scenarios on a real DP=4 CPU cluster (processes, signals, gloo)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from ftengine.faults import HealthStatus
from ftengine.testbed.cluster import (
    INJECT_ENV_VAR,
    Cluster,
    FaultSpec,
    Generation,
    RequestAborted,
    compare_outputs,
    reference_generate,
)
from tests.integration.conftest import MAX_TOKENS, PROMPTS, TIMINGS, Launcher

pytestmark = pytest.mark.integration

HEALTHY, DEAD, UNHEALTHY = (
    int(s) for s in (HealthStatus.HEALTHY, HealthStatus.DEAD, HealthStatus.UNHEALTHY)
)


def engines(cluster: Cluster) -> dict[int, dict[str, Any]]:
    return {e["id"]: e for e in cluster.status()["engines"]}


def statuses_are(want: Mapping[int, int]) -> Any:
    def check(status: Mapping[str, Any]) -> bool:
        got = {e["id"]: e["status"] for e in status["engines"]}
        return all(got[rank] == value for rank, value in want.items())

    return check


def wait_statuses(cluster: Cluster, want: Mapping[int, int], timeout: float) -> float:
    waited = cluster.wait_for(statuses_are(want), timeout)
    assert waited is not None, f"expected statuses {want} within {timeout}s, got {engines(cluster)}"
    return waited


def assert_matches(cluster: Cluster, reference: list[Generation]) -> None:
    check = compare_outputs(cluster.generate_batch(PROMPTS, MAX_TOKENS), reference)
    assert check.match, check


class Traffic:
    """Keeps a long generation running in a thread so that a fault lands mid-step."""

    def __init__(self, cluster: Cluster) -> None:
        self.error: BaseException | None = None
        self._cluster = cluster
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while cluster.steps_run < 3 and time.monotonic() < deadline:
            time.sleep(0.01)

    def _run(self) -> None:
        try:
            self._cluster.generate_batch(PROMPTS, 100_000)
        except BaseException as exc:  # the test inspects it
            self.error = exc

    def stopped(self, timeout: float = 30.0) -> BaseException | None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the in-flight generation never ended"
        return self.error


def others(excluded: Iterable[int], n: int = 4) -> list[int]:
    return [r for r in range(n) if r not in set(excluded)]


def kill_and_scale_down(
    cluster: Cluster, victim: int, reference: list[Generation], removed: list[int], name: str
) -> None:
    """SIGKILL ``victim`` mid-traffic, check detection, DEAD rejects retry, scale down."""
    survivors = others(removed)
    traffic = Traffic(cluster)
    killed = time.monotonic()
    cluster.kill(victim, signal.SIGKILL)
    detect = wait_statuses(cluster, {victim: DEAD} | dict.fromkeys(survivors, UNHEALTHY), 10.0)
    assert isinstance(traffic.stopped(), RequestAborted)
    retry = cluster.apply("retry", {}, f"{name}-retry")
    assert not retry.success and retry.reason is not None and "status is DEAD" in retry.reason
    assert all(engines(cluster)[r]["status"] == UNHEALTHY for r in survivors)
    start = time.monotonic()
    result = cluster.apply("scale_down", {"removed_dp_ranks": removed}, f"{name}-scale-down")
    recover = time.monotonic() - start
    assert result.success, result.reason
    state = engines(cluster)
    for rank in survivors:
        assert state[rank]["status"] == HEALTHY, state[rank]
        assert state[rank]["removed_ranks"] == sorted(removed)
    assert state[victim]["status"] == DEAD
    assert_matches(cluster, reference)
    TIMINGS[name] = {
        "detect": detect,
        "recover": recover,
        "kill_to_healthy": time.monotonic() - killed,
    }


@pytest.mark.timeout(120)
def test_1_injected_fault_retry_recovers_all_ranks(
    launch: Launcher, reference: list[Generation]
) -> None:
    cluster = launch(inject_fault=FaultSpec.parse("rank=3,step=4,kind=raise"))
    traffic = Traffic(cluster)
    assert isinstance(traffic.stopped(), RequestAborted)
    detect = wait_statuses(cluster, dict.fromkeys(range(4), UNHEALTHY), 10.0)
    state = engines(cluster)
    assert state[3]["fault_info"] == "InjectedFault"
    start = time.monotonic()
    result = cluster.apply("retry", {}, "s1-retry")
    recover = time.monotonic() - start
    assert result.success, result.reason
    assert all(e["status"] == HEALTHY and e["epoch"] == 1 for e in engines(cluster).values())
    assert_matches(cluster, reference)
    # Peers learn of rank 3's fault through their op timeout: the last one quarantines
    # within op_timeout (+ slack) of rank 3 itself.
    quarantined = [
        next(e.at for e in events if e.dest == "quarantined")
        for events in cluster.phase_changes().values()
    ]
    spread = max(quarantined) - min(quarantined)
    assert spread <= cluster.config.op_timeout_s + 1.0
    TIMINGS["1 raise+retry"] = {"peers_detect": spread, "recover": recover, "wait": detect}


@pytest.mark.timeout(120)
def test_2_sigkill_rank3_scale_down(launch: Launcher, reference: list[Generation]) -> None:
    cluster = launch()
    kill_and_scale_down(cluster, 3, reference, [3], "2 kill rank 3")


@pytest.mark.timeout(120)
def test_3_sigkill_rank0_scale_down(launch: Launcher, reference: list[Generation]) -> None:
    cluster = launch()
    kill_and_scale_down(cluster, 0, reference, [0], "3 kill rank 0")


@pytest.mark.timeout(150)
def test_4_two_successive_scale_downs(launch: Launcher, reference: list[Generation]) -> None:
    cluster = launch()
    kill_and_scale_down(cluster, 3, reference, [3], "4a 4->3")
    kill_and_scale_down(cluster, 1, reference, [1, 3], "4b 3->2")
    repairs = [engines(cluster)[r]["timeline"]["repair"] for r in (0, 2)]
    assert sum(rep["reloads"] for rep in repairs) >= repairs[0]["reload_lower_bound"] > 0


@pytest.mark.timeout(120)
def test_5_sigstop_is_detected_fenced_and_scaled_down(
    launch: Launcher, reference: list[Generation]
) -> None:
    cluster = launch()
    op_timeout = cluster.config.op_timeout_s
    traffic = Traffic(cluster)
    stopped = time.monotonic()
    cluster.kill(2, signal.SIGSTOP)
    detect = wait_statuses(cluster, dict.fromkeys((0, 1, 3), UNHEALTHY), op_timeout + 1.0)
    assert isinstance(traffic.stopped(), RequestAborted)
    wait_statuses(cluster, {2: DEAD}, cluster.config.heartbeat_timeout_s + 5.0)
    fenced = time.monotonic() - stopped
    assert any(e.kind == "fence" and e.rank == 2 for e in cluster.events())
    start = time.monotonic()
    result = cluster.apply("scale_down", {"removed_dp_ranks": [2]}, "s5-scale-down")
    assert result.success, result.reason
    recover = time.monotonic() - start
    assert_matches(cluster, reference)
    TIMINGS["5 sigstop"] = {"detect": detect, "fenced": fenced, "recover": recover}


@pytest.mark.timeout(120)
def test_5b_hung_main_thread_from_env_var_is_fenced_and_scaled_down(
    launch: Launcher, reference: list[Generation], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(INJECT_ENV_VAR, "rank=2,step=4,kind=hang")
    cluster = launch()
    traffic = Traffic(cluster)
    # The hung rank keeps beating (only its main thread is stuck): its peers' op timeout
    # finds it, then the supervisor fences it for not answering the step.
    assert isinstance(traffic.stopped(), RequestAborted)
    wait_statuses(cluster, {2: DEAD} | dict.fromkeys((0, 1, 3), UNHEALTHY), 10.0)
    assert any(
        e.kind == "fence" and e.rank == 2 and "no reply" in e.detail for e in cluster.events()
    )
    result = cluster.apply("scale_down", {"removed_dp_ranks": [2]}, "s5b-scale-down")
    assert result.success, result.reason
    assert_matches(cluster, reference)


@pytest.mark.timeout(120)
def test_6_a_failed_recovery_step_waits_for_the_next_command_which_recovers(
    launch: Launcher, reference: list[Generation]
) -> None:
    """One survivor's reload fails once inside the scale-down: the engines stay
    ``unhealthy`` (as vLLM keeps an engine whose command failed), saying why, and the same
    command sent again succeeds; only the attempts bound (3 per episode) ends them DEAD."""
    cluster = launch(inject_fault="rank=1,kind=reload_error")
    cluster.kill(3, signal.SIGKILL)
    wait_statuses(cluster, {3: DEAD} | dict.fromkeys((0, 1, 2), UNHEALTHY), 10.0)
    start = time.monotonic()
    result = cluster.apply("scale_down", {"removed_dp_ranks": [3]}, "s6-scale-down")
    assert not result.success
    assert result.reason is not None and "reload_error" in result.reason
    settle = wait_statuses(cluster, {3: DEAD} | dict.fromkeys((0, 1, 2), UNHEALTHY), 30.0)
    state = engines(cluster)
    assert "WeightLoadError" in state[1]["ft_error"]
    again = cluster.apply("scale_down", {"removed_dp_ranks": [3]}, "s6-scale-down-again")
    assert again.success, again.reason
    assert_matches(cluster, reference)
    TIMINGS["6 reload_error"] = {"command": time.monotonic() - start, "unhealthy": settle}


@pytest.mark.timeout(120)
def test_7_idle_cluster_goes_unhealthy_without_traffic(launch: Launcher) -> None:
    cluster = launch()
    bound = cluster.config.heartbeat_timeout_s
    cluster.kill(1, signal.SIGKILL)
    detect = wait_statuses(cluster, {1: DEAD} | dict.fromkeys((0, 2, 3), UNHEALTHY), bound)
    assert cluster.steps_run == 0  # no request was sacrificed to find the fault
    TIMINGS["7 idle kill"] = {"detect": detect, "bound": bound}


@pytest.mark.timeout(120)
def test_7b_idle_sigstop_goes_unhealthy_through_heartbeats(launch: Launcher) -> None:
    cluster = launch()
    bound = cluster.config.heartbeat_timeout_s
    cluster.kill(2, signal.SIGSTOP)
    detect = wait_statuses(cluster, {2: DEAD} | dict.fromkeys((0, 1, 3), UNHEALTHY), bound + 1.0)
    assert any(e.kind == "fence" and e.rank == 2 for e in cluster.events())
    TIMINGS["7b idle sigstop"] = {"detect": detect, "bound": bound}


@pytest.mark.timeout(120)
def test_8_auto_recovery_scales_down_without_commands(
    launch: Launcher, reference: list[Generation]
) -> None:
    cluster = launch(policy="auto")
    traffic = Traffic(cluster)
    killed = time.monotonic()
    cluster.kill(3, signal.SIGKILL)
    assert isinstance(traffic.stopped(), RequestAborted)
    recovered = wait_statuses(cluster, {3: DEAD} | dict.fromkeys((0, 1, 2), HEALTHY), 30.0)
    state = engines(cluster)
    assert all(state[r]["removed_ranks"] == [3] and state[r]["epoch"] == 1 for r in (0, 1, 2))
    assert all(state[r]["last_ft_request_id"] is None for r in (0, 1, 2))
    assert cluster.removed_ranks == {3}
    assert_matches(cluster, reference)
    TIMINGS["8 auto"] = {"kill_to_healthy": time.monotonic() - killed, "wait": recovered}


@pytest.mark.timeout(120)
def test_8b_auto_recovery_retries_a_transient_fault_without_commands(
    launch: Launcher, reference: list[Generation]
) -> None:
    cluster = launch(policy="auto", inject_fault="rank=1,step=3,kind=raise")
    traffic = Traffic(cluster)
    assert isinstance(traffic.stopped(), RequestAborted)
    recovered = wait_statuses(cluster, dict.fromkeys(range(4), HEALTHY), 30.0)
    state = engines(cluster)
    assert all(state[r]["epoch"] == 1 and state[r]["removed_ranks"] == [] for r in range(4))
    assert_matches(cluster, reference)
    TIMINGS["8b auto retry"] = {"abort_to_healthy": recovered}


@pytest.mark.timeout(150)
def test_9_w8a8_checkpoint_scale_down(launch: Launcher, w8a8_checkpoint: Path) -> None:
    reference = reference_generate(w8a8_checkpoint, PROMPTS, MAX_TOKENS)
    cluster = launch(checkpoint=w8a8_checkpoint)
    assert_matches(cluster, reference)
    kill_and_scale_down(cluster, 3, reference, [3], "9 w8a8 kill rank 3")
