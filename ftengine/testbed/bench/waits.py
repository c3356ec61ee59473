"""Waiting for a cluster's status to reach a state: woken by every status change where the
cluster offers it, polling otherwise. The demo and the recovery benchmark time recoveries
with these, so a wait must not add a poll interval to what it measures."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from ftengine.testbed.bench.protocol import Watchable
from ftengine.testbed.control.snapshot import ClusterView


@runtime_checkable
class StatusWaitable(Protocol):
    """A cluster that wakes waiters when its status changes (``Cluster.wait_for``)."""

    def wait_for(
        self, predicate: Callable[[Mapping[str, Any]], bool], timeout: float
    ) -> float | None: ...


def wait_until(
    cluster: Watchable, predicate: Callable[[ClusterView], bool], timeout_s: float
) -> ClusterView | None:
    """Wait until ``predicate`` holds; the view that satisfied it, or None on timeout.

    Woken by every status change when the cluster offers ``wait_for`` (a fixed poll
    interval would add up to its length to each recovery the demo and benchmark time);
    otherwise polls status every 20 ms.
    """
    if isinstance(cluster, StatusWaitable):
        seen: list[ClusterView] = []

        def holds(status: Mapping[str, Any]) -> bool:
            view = ClusterView.from_status(status)
            if predicate(view):
                seen.append(view)
            return bool(seen)

        cluster.wait_for(holds, timeout_s)
        return seen[0] if seen else None
    deadline = time.monotonic() + timeout_s
    while True:
        view = ClusterView.from_status(cluster.status())
        if predicate(view):
            return view
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def serving(view: ClusterView) -> bool:
    """Every live engine HEALTHY and every dead one scaled away by all of them."""
    dead = [engine.id for engine in view.engines if not engine.live]
    return view.healthy and all(rank in e.removed_ranks for e in view.live for rank in dead)


def serving_waiter(cluster: Watchable) -> Callable[[float], bool]:
    """A ``TrafficStream`` ``ready`` hook: waits up to the given seconds for :func:`serving`."""
    return lambda timeout_s: wait_until(cluster, serving, timeout_s) is not None
