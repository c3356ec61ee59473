"""Fixtures for the multi-process cluster tests: a tiny checkpoint, its reference outputs, and
a launcher that always shuts its clusters down (killing only their own worker pids)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from ftengine.testbed.cluster import Cluster, ClusterConfig, Generation, reference_generate
from ftengine.weights.checkpoint_gen import make_checkpoint

PROMPTS: tuple[tuple[int, ...], ...] = (
    (1, 2, 3, 4),
    (5, 6, 7),
    (8, 9, 10, 11, 12),
    (13, 14),
    (3, 1, 4, 1, 5, 9),
    (100, 7),
)
MAX_TOKENS = 6
SIZES: dict[str, Any] = {
    "layers": 2,
    "experts": 8,
    "hidden": 64,
    "intermediate": 32,
    "vocab": 128,
    "heads": 4,
    "kv_heads": 2,
    "top_k": 2,
    "seed": 7,
}

# Per-scenario measurements (seconds), printed at the end of the session.
TIMINGS: dict[str, dict[str, float]] = {}

Launcher = Callable[..., Cluster]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "bf16", **SIZES)


@pytest.fixture(scope="session")
def w8a8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "w8a8", quant="w8a8_dynamic", **SIZES)


@pytest.fixture(scope="session")
def reference(checkpoint: Path) -> list[Generation]:
    return reference_generate(checkpoint, PROMPTS, MAX_TOKENS)


@pytest.fixture
def launch(checkpoint: Path) -> Iterator[Launcher]:
    """``launch(**config)`` starts a DP=4 cluster on ``checkpoint`` (config overrides)."""
    clusters: list[Cluster] = []

    def _launch(**overrides: Any) -> Cluster:
        settings: dict[str, Any] = {
            "checkpoint": checkpoint,
            "dp_size": 4,
            "op_timeout_s": 2.0,
            "heartbeat_s": 0.25,
            "heartbeat_misses": 8,
            "recovery_timeout_s": 120.0,
            **overrides,
        }
        cluster = Cluster.launch(ClusterConfig(**settings))
        clusters.append(cluster)
        return cluster

    yield _launch
    pids = [pid for c in clusters for pid in c.pids().values() if pid is not None]
    for cluster in clusters:
        cluster.shutdown()
    leftovers = [pid for pid in pids if psutil.pid_exists(pid) and _not_zombie(pid)]
    assert not leftovers, f"worker processes left behind: {leftovers}"


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not TIMINGS:
        return
    terminalreporter.section("cluster scenario timings (s)")
    for name, values in TIMINGS.items():
        text = ", ".join(f"{key}={value:.3f}" for key, value in values.items())
        terminalreporter.write_line(f"{name}: {text}")
