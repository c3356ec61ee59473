"""The one policy-name registry: names, factories, ``Deployment``, and every surface using it."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import attrs
import pytest

from ftengine.backends.npu_config import NpuFtConfig
from ftengine.errors import ConfigError
from ftengine.faults import FaultKind
from ftengine.policies import AutoRecovery, Deployment, OrchestratorDriven, by_name
from ftengine.policies.registry import (
    LOCAL_FAULT_KINDS,
    POLICIES,
    POLICY_NAMES,
    PolicyName,
    check_name,
    factory_of,
)
from ftengine.testbed.cluster import ClusterConfig
from ftengine.testbed.cluster.policies import build_policy

# What "auto" meant in the cluster and in vLLM before there was one registry.
DEPLOYED_AUTO = AutoRecovery(
    retry_kinds=frozenset({FaultKind.TRANSIENT, FaultKind.DEVICE_ERROR})
) | OrchestratorDriven(recovery_timeout=10.0)


def test_registry_builds_policies_by_name() -> None:
    assert by_name("orchestrator") == OrchestratorDriven()
    assert by_name("orchestrator", recovery_timeout=30.0) == OrchestratorDriven(30.0)
    assert by_name("auto", max_attempts=5) == AutoRecovery(max_attempts=5)


def test_registry_errors_name_the_choices() -> None:
    with pytest.raises(ConfigError, match="unknown policy 'magic': expected one of 'auto', "):
        by_name("magic")
    with pytest.raises(ConfigError, match="does not take parameters"):
        by_name("auto", recovery_timeout=3.0)
    with pytest.raises(ConfigError, match="recovery_timeout must be finite seconds > 0"):
        by_name("orchestrator", recovery_timeout=0)


def test_the_registry_and_the_typed_names_agree() -> None:
    assert set(POLICIES) == set(get_args(PolicyName)) == set(POLICY_NAMES)
    assert POLICY_NAMES == ("auto", "orchestrator")  # sorted, as error messages list them


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_factory_takes_the_same_arguments(name: str) -> None:
    factory = factory_of(name)
    assert callable(factory(None)) and callable(factory(Deployment(recovery_timeout=5.0)))


def test_deployed_policies_are_what_the_cluster_and_vllm_always_ran() -> None:
    deployment = Deployment(recovery_timeout=10.0)
    assert by_name("orchestrator", deployment=deployment) == OrchestratorDriven(10.0)
    assert by_name("auto", deployment=deployment) == DEPLOYED_AUTO
    assert frozenset({FaultKind.TRANSIENT, FaultKind.DEVICE_ERROR}) == LOCAL_FAULT_KINDS
    assert deployment.fallback() == OrchestratorDriven(10.0)


def test_the_cluster_builds_its_policy_from_the_registry() -> None:
    assert build_policy("auto", 10.0) == DEPLOYED_AUTO
    assert build_policy("orchestrator", 10.0) == OrchestratorDriven(recovery_timeout=10.0)


def test_a_deployment_keeps_the_other_parameters_of_a_policy() -> None:
    deployed = by_name("auto", deployment=Deployment(10.0), max_attempts=5)
    assert deployed == AutoRecovery(max_attempts=5, retry_kinds=LOCAL_FAULT_KINDS) | (
        OrchestratorDriven(10.0)
    )
    mine = by_name("auto", deployment=Deployment(10.0), retry_kinds=[FaultKind.TRANSIENT])
    assert mine == AutoRecovery(retry_kinds=[FaultKind.TRANSIENT]) | OrchestratorDriven(10.0)


def test_a_deployment_sets_the_recovery_timeout_itself() -> None:
    with pytest.raises(ConfigError, match="'orchestrator' does not take parameters"):
        by_name("orchestrator", deployment=Deployment(10.0), recovery_timeout=3.0)
    with pytest.raises(ConfigError, match=r"Deployment\.recovery_timeout must be finite seconds"):
        Deployment(recovery_timeout=0)


@pytest.mark.parametrize("name", ["eager", "", ["auto"], None, 3])
def test_check_name_refuses_anything_unregistered_listing_the_names(name: object) -> None:
    with pytest.raises(ConfigError, match="expected one of 'auto', 'orchestrator'"):
        check_name(name)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_surface_accepts_every_registered_name(name: PolicyName, tmp_path: Path) -> None:
    assert check_name(name) == name
    assert NpuFtConfig.from_options({"policy": name}).policy == name
    assert ClusterConfig(tmp_path, policy=name).policy == name
    assert callable(build_policy(name, 1.0))


def test_the_cluster_config_names_the_registered_policies() -> None:
    # ClusterConfig's field takes its type and its allowed names from the registry.
    field = attrs.fields(ClusterConfig).policy
    assert "PolicyName" in str(field.type)
    for name in POLICY_NAMES:
        assert ClusterConfig(Path("ckpt"), policy=name).policy == name
    with pytest.raises(ValueError, match="policy"):
        ClusterConfig(Path("ckpt"), policy="eager")
