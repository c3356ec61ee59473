"""ftengine's metrics on vLLM's own ``/metrics``: a Prometheus collector in each vLLM API
server that reads the FSM state its engines' workers leave in their status files
(``engine_agent.StatusFile``), at scrape time, so nothing is pushed between processes.

Names match the control plane's (``ftengine/testbed/control/metrics.py``): ``ftengine_engine_phase``
(1 for the phase an engine is in), ``ftengine_engine_epoch``, plus
``ftengine_engine_removed_ranks`` and ``ftengine_engine_recovery_attempts``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
from prometheus_client.core import REGISTRY, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ftengine.faults import Phase

STATUS_FILE = re.compile(r"ftengine-status-(?P<pid>\d+)-(?P<rank>\d+)\.json$")


def engine_states(root: int | None = None) -> dict[int, dict[str, object]]:
    """DP rank -> the worker FSM fields of every engine core under process ``root``
    (default: this process), read from their status files."""
    pids = {os.getpid() if root is None else root}
    with contextlib.suppress(psutil.Error):
        pids |= {c.pid for c in psutil.Process(root).children(recursive=True)}
    states: dict[int, dict[str, object]] = {}
    for path in Path(tempfile.gettempdir()).glob("ftengine-status-*.json"):
        match = STATUS_FILE.search(path.name)
        if match is None or int(match["pid"]) not in pids:
            continue
        with contextlib.suppress(OSError, ValueError):
            loaded = json.loads(path.read_text())
            if isinstance(loaded, dict):
                states[int(match["rank"])] = loaded
    return states


class EngineStateCollector(Collector):
    """Collects :func:`engine_states` as gauges, labelled by engine (DP rank)."""

    def collect(self) -> Iterator[Metric]:
        phase = GaugeMetricFamily(
            "ftengine_engine_phase", "1 for the phase an engine is in, 0 otherwise",
            labels=["engine", "phase"],
        )  # fmt: skip
        epoch = GaugeMetricFamily("ftengine_engine_epoch", "process-group epoch", labels=["engine"])
        removed = GaugeMetricFamily(
            "ftengine_engine_removed_ranks", "DP ranks removed by scale-down", labels=["engine"]
        )
        attempts = GaugeMetricFamily(
            "ftengine_engine_recovery_attempts",
            "recoveries started this episode",
            labels=["engine"],
        )
        for rank, state in sorted(engine_states().items()):
            engine = str(rank)
            for name in Phase:
                phase.add_metric([engine, name.value], float(state.get("phase") == name.value))
            epoch.add_metric([engine], float(_number(state.get("epoch"))))
            removed.add_metric([engine], float(len(_list(state.get("removed_ranks")))))
            attempts.add_metric([engine], float(_number(state.get("attempts"))))
        yield from (phase, epoch, removed, attempts)


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def _list(value: object) -> list[object]:
    return list(value) if isinstance(value, list) else []


_registered: list[Collector] = []


def register_collector() -> None:
    """Add the collector to prometheus_client's default registry, which vLLM's single API
    server serves on ``/metrics`` (idempotent)."""
    if not _registered:
        collector = EngineStateCollector()
        REGISTRY.register(collector)
        _registered.append(collector)
