"""ClusterConfig validation, the timeouts derived from it, and the worker spec built from it."""

from __future__ import annotations

import pickle
from pathlib import Path

import attrs
import pytest

from ftengine.errors import ConfigError
from ftengine.testbed.cluster import ClusterConfig, FaultSpec, InjectKind
from ftengine.testbed.cluster.worker import WorkerSpec


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
        {"worker_start": "fork"},  # forking the supervisor's threads: never offered
    ],
)
def test_invalid_values_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises((ConfigError, ValueError)):
        ClusterConfig("/tmp/ckpt", **kwargs)  # type: ignore[arg-type]


# A value for every ClusterConfig field, none of them its default, so that a field a worker
# spec drops or resets shows; a new field fails the coverage test until it is added here.
NON_DEFAULT: dict[str, object] = {
    "checkpoint": Path("/tmp/other-ckpt"),
    "dp_size": 3,
    "policy": "auto",
    "op_timeout_s": 2.5,
    "heartbeat_s": 0.5,
    "heartbeat_misses": 5,
    "recovery_timeout_s": 33.0,
    "num_redundant_experts": 6,
    "inject_fault": FaultSpec(2, InjectKind.HANG, 9),
    "start_timeout_s": 44.0,
    "host": "127.0.0.2",
    "torch_threads": 2,
    "command_adapter": "pkg.module:factory",
    "fault_tolerance": False,
    "rejoin_grown": "keep",
    "reinference": False,
    "max_reinference": 5,
    "worker_netns": ("ns0", "ns1", "ns2"),
    "worker_start": "forkserver",
}


def test_the_sample_sets_every_config_field_off_its_default() -> None:
    fields = attrs.fields(ClusterConfig)
    assert set(NON_DEFAULT) == {field.name for field in fields}
    for field in fields:
        assert NON_DEFAULT[field.name] != field.default, field.name


def test_a_worker_spec_carries_every_config_field() -> None:
    config = ClusterConfig(**NON_DEFAULT)  # type: ignore[arg-type]
    spec = WorkerSpec.from_config(
        config, 2, store_port=1234, num_redundant=6, inject_fault=config.inject_fault
    )
    sent = pickle.loads(pickle.dumps(spec))  # as the spawn start method sends it
    assert sent == spec and sent.config == config
    for field in attrs.fields(ClusterConfig):
        assert getattr(sent.config, field.name) == NON_DEFAULT[field.name], field.name
    assert (sent.rank, sent.store_port, sent.world_size, sent.num_redundant) == (2, 1234, 3, 6)


def test_a_worker_spec_carries_what_the_supervisor_resolved() -> None:
    config = ClusterConfig("/tmp/ckpt")  # slot count and fault are resolved at spawn
    fault = FaultSpec(1, InjectKind.RAISE, 5)
    spec = WorkerSpec.from_config(config, 0, store_port=1, num_redundant=8, inject_fault=fault)
    assert (spec.num_redundant, spec.config.inject_fault) == (8, fault)
    assert attrs.evolve(spec.config, num_redundant_experts=None, inject_fault=None) == config
    zero = WorkerSpec.from_config(config, 0, store_port=1, num_redundant=0, inject_fault=None)
    assert zero.num_redundant == 0


def test_a_worker_spec_refuses_an_unresolved_slot_count() -> None:
    with pytest.raises(ConfigError, match="num_redundant_experts must be resolved"):
        WorkerSpec(ClusterConfig("/tmp/ckpt"), 0, 1)
