"""ClusterConfig validation and the timeouts derived from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftengine.cluster import ClusterConfig, FaultSpec, InjectKind
from ftengine.errors import ConfigError


def test_defaults_and_derived_timeouts() -> None:
    cfg = ClusterConfig("/tmp/ckpt", op_timeout_s=2.0, heartbeat_s=0.25, heartbeat_misses=8)
    assert cfg.checkpoint == Path("/tmp/ckpt")
    assert (cfg.dp_size, cfg.policy, cfg.inject_fault) == (4, "orchestrator", None)
    assert cfg.heartbeat_timeout_s == 2.0
    # A rebuild must outwait a peer still stuck in an op of the old epoch.
    assert cfg.rendezvous_timeout_s > cfg.op_timeout_s
    assert cfg.command_timeout_s > cfg.rendezvous_timeout_s + cfg.op_timeout_s


def test_inject_fault_accepts_text() -> None:
    cfg = ClusterConfig("/tmp/ckpt", inject_fault="rank=3,step=50,kind=raise")
    assert cfg.inject_fault == FaultSpec(3, InjectKind.RAISE, 50)
    assert ClusterConfig("/tmp/ckpt", inject_fault="").inject_fault is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"op_timeout_s": 0.0},
        {"heartbeat_s": -1.0},
        {"dp_size": 0},
        {"policy": "eager"},
        {"heartbeat_misses": 1},
    ],
)
def test_invalid_values_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises((ConfigError, ValueError)):
        ClusterConfig("/tmp/ckpt", **kwargs)  # type: ignore[arg-type]
