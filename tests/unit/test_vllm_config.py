"""vLLM's fault-tolerance flags -> ftengine settings, on vLLM's real ``ParallelConfig``.

``VllmConfig`` and vLLM's CLI parser cannot be built on this CPU machine (they fail to infer
a device type), so the flags' values are set on a real ``ParallelConfig`` (which does build)
held by a stand-in ``VllmConfig`` with the same three fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from ftengine.faults import FaultKind
from ftengine.integrations.vllm.config import VllmConfigError, VllmFtSettings
from ftengine.policies import AutoRecovery, Deployment, OrchestratorDriven, by_name
from tests.unit.test_vllm_standin import ModelConfig

config = pytest.importorskip("vllm.config", reason="vllm is not installed")


@dataclass
class VllmConfig:
    parallel_config: Any
    model_config: ModelConfig = field(default_factory=ModelConfig)
    additional_config: Any = field(default_factory=dict)


def settings(additional: Any = None, *, recovery: Any = 120, cpu: Any = None) -> VllmFtSettings:
    parallel = config.ParallelConfig(
        enable_fault_tolerance=True,
        fault_tolerance_config=config.FaultToleranceConfig(engine_recovery_timeout_sec=recovery),
        cpu_distributed_timeout_seconds=cpu,
    )
    return VllmFtSettings.from_vllm_config(VllmConfig(parallel, additional_config=additional))


def test_the_seed_command_maps_to_ftengine_settings() -> None:
    s = settings({"ft_communication_abort_timeout": 30}, recovery=32000, cpu=30)
    assert s.enabled and s.policy == "orchestrator"
    assert (s.recovery_timeout_s, s.cpu_distributed_timeout_s) == (32000.0, 30.0)
    assert s.npu.communication_abort_timeout_s == 30
    policy = s.build_policy()
    assert policy == OrchestratorDriven(recovery_timeout=32000.0)


def test_ftengine_keys_win_over_vllms_flags_but_never_disagree_on_the_recovery_wait() -> None:
    ours = {"ftengine": {"recovery_timeout_sec": 120, "cpu_distributed_timeout_sec": 4}}
    s = settings(ours, recovery=120, cpu=30)
    assert (s.recovery_timeout_s, s.cpu_distributed_timeout_s) == (120.0, 4.0)
    with pytest.raises(
        VllmConfigError,
        match=r"ftengine\.recovery_timeout_sec \(9\) must equal --fault-tolerance-config's "
        r"engine_recovery_timeout_sec \(120\)",
    ):
        settings({"ftengine": {"recovery_timeout_sec": 9}}, recovery=120)


def test_auto_policy_falls_back_to_waiting_for_the_orchestrator() -> None:
    s = settings({"ftengine": {"policy": "auto"}}, recovery=45)
    assert s.policy == "auto"
    assert "OrchestratorDriven(recovery_timeout=45.0, max_attempts=3)" in repr(s.build_policy())
    local = frozenset({FaultKind.TRANSIENT, FaultKind.DEVICE_ERROR})
    assert s.build_policy() == AutoRecovery(retry_kinds=local) | OrchestratorDriven(45.0)
    assert s.build_policy() == by_name("auto", deployment=Deployment(recovery_timeout=45.0))


def test_fault_tolerance_off_is_reported() -> None:
    parallel = config.ParallelConfig()
    assert not VllmFtSettings.from_vllm_config(VllmConfig(parallel)).enabled


@pytest.mark.parametrize(
    ("additional", "recovery", "cpu", "names"),
    [
        ({"ftengine": {"policy": "sometimes"}}, 120, None, "--additional-config: ftengine.policy"),
        ({"ftengine": {"polcy": "auto"}}, 120, None, "unknown option ftengine.polcy"),
        ({"ftengine": "auto"}, 120, None, "--additional-config: ftengine must be a JSON object"),
        ({"ft_communication_abort_timeout": 1}, 120, None, "ft_communication_abort_timeout"),
        ({}, -5, None, "--fault-tolerance-config: engine_recovery_timeout_sec"),
        ({}, 120, 0, "--cpu-distributed-timeout-seconds"),
        ("not-a-dict", 120, None, "--additional-config: expected a JSON object"),
    ],
)
def test_invalid_values_name_the_flag_and_key(
    additional: Any, recovery: Any, cpu: Any, names: str
) -> None:
    with pytest.raises(VllmConfigError) as raised:
        settings(additional, recovery=recovery, cpu=cpu)
    assert names in str(raised.value)
    assert isinstance(raised.value, ValueError)  # vLLM reports config errors as ValueError
