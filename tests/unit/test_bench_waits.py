"""Waiting on the cluster: status predicates wake on the cluster's own status changes
(``wait_for``) when it has them, and the request stream resumes when the cluster serves."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ftengine.errors import BackendError
from ftengine.testbed.bench.traffic import READY_CHECK_S, TrafficStream
from ftengine.testbed.bench.waits import serving, serving_waiter, wait_until
from ftengine.testbed.control.snapshot import ClusterView


def _status(*engines: tuple[int, int, list[int]]) -> dict[str, Any]:
    """Engines as (id, vLLM status: 0 healthy / 1 dead / 2 unhealthy, removed ranks)."""
    return {
        "schema_version": 1,
        "total_engines": len(engines),
        "engines": [
            {"id": rank, "status": status, "phase": "x", "removed_ranks": removed}
            for rank, status, removed in engines
        ],
    }


RECOVERING = _status((0, 2, []), (1, 2, []), (2, 1, []))
SCALED_DOWN = _status((0, 0, [2]), (1, 0, [2]), (2, 1, []))


class _WaitingCluster:
    """Serves a fixed sequence of statuses, one per ``wait_for`` wake-up."""

    def __init__(self, statuses: Sequence[dict[str, Any]]) -> None:
        self.statuses = list(statuses)
        self.wakes = 0
        self.timeouts: list[float] = []

    def status(self) -> dict[str, Any]:
        return self.statuses[min(self.wakes, len(self.statuses) - 1)]

    def phase_changes(self) -> dict[int, list[Any]]:
        return {}

    def events(self) -> list[Any]:
        return []

    def wait_for(
        self, predicate: Callable[[Mapping[str, Any]], bool], timeout: float
    ) -> float | None:
        self.timeouts.append(timeout)
        while not predicate(self.status()):
            if self.wakes >= len(self.statuses) - 1:
                return None
            self.wakes += 1
        return 0.0


def test_serving_needs_every_live_engine_healthy_and_the_dead_scaled_away() -> None:
    assert not serving(ClusterView.from_status(RECOVERING))
    assert serving(ClusterView.from_status(SCALED_DOWN))
    dead_not_removed = _status((0, 0, []), (1, 0, [2]), (2, 1, []))
    assert not serving(ClusterView.from_status(dead_not_removed))
    assert serving(ClusterView.from_status(_status((0, 0, []), (1, 0, []))))


def test_wait_until_uses_wait_for_and_returns_the_view_that_held() -> None:
    cluster = _WaitingCluster([RECOVERING, RECOVERING, SCALED_DOWN])
    view = wait_until(cluster, serving, 7.0)
    assert view is not None and view.engine(0).removed_ranks == frozenset({2})
    assert cluster.wakes == 2 and cluster.timeouts == [7.0]
    assert wait_until(_WaitingCluster([RECOVERING]), serving, 1.0) is None


def test_stream_waits_for_the_cluster_to_serve_after_an_error() -> None:
    calls: list[float] = []
    answers = {"n": 0}
    enough = threading.Event()

    def ready(timeout_s: float) -> bool:
        calls.append(timeout_s)
        return len(calls) >= 3  # recovering at the first two checks

    def generate(prompt: list[int], max_tokens: int) -> list[int]:
        answers["n"] += 1
        if answers["n"] == 1:
            raise BackendError("recovering")
        enough.set()
        return [7] * max_tokens

    # A backoff this long would stall the test: the stream must not use it once ready waits.
    stream = TrafficStream(
        generate, [[1]], [[7]], max_tokens=1, backoff_s=3600.0, ready=ready
    ).start()
    assert enough.wait(30), "the stream did not resume after the cluster served again"
    stream.stop()
    assert calls == [0.0, READY_CHECK_S, READY_CHECK_S]
    assert [s.correct for s in stream.samples[:2]] == [False, True]


def test_serving_waiter_reads_the_clusters_status() -> None:
    ready = serving_waiter(_WaitingCluster([RECOVERING, SCALED_DOWN]))
    assert ready(0.5)
    assert not serving_waiter(_WaitingCluster([RECOVERING]))(0.5)
