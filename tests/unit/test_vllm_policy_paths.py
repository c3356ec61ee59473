"""Custom policies named by import path: checked at start-up wherever a policy is configured
(vLLM's --additional-config, ftengine serve's --policy / ClusterConfig), with an error
naming the path for every way it can be wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftengine.backends.npu_config import NpuFtConfig
from ftengine.clock import ManualClock
from ftengine.context import RecoveryContext
from ftengine.errors import ConfigError
from ftengine.faults import Fault, FaultKind, Phase
from ftengine.policies import Retry, WaitForOrchestrator, decide
from ftengine.policies.import_path import is_import_path, policy_from_import_path
from ftengine.testbed.cluster.config import ClusterConfig
from ftengine.testbed.cluster.policies import build_policy

GOOD = "tests.vllm_support:retry_transient_then_wait"


def ctx(kind: FaultKind, attempts: int = 0) -> RecoveryContext:
    now = ManualClock().now()
    fault = Fault(kind, rank=0, info="RuntimeError", at=now)
    return RecoveryContext(
        fault=fault, phase=Phase.QUARANTINED, now=now, episode_start=now, attempts=attempts
    )


def test_an_import_path_builds_the_factorys_policy() -> None:
    assert is_import_path(GOOD) and not is_import_path("auto")
    policy = policy_from_import_path(GOOD)
    assert policy(ctx(FaultKind.TRANSIENT)) == Retry(0.0)
    assert policy(ctx(FaultKind.TRANSIENT, attempts=1)) is None


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("tests.vllm_support:", r"expected an import path 'package\.module:factory'"),
        ("tests.no_such_module:make", r"cannot import tests\.no_such_module"),
        ("tests.vllm_support:missing", r"tests\.vllm_support has no missing"),
        ("tests.vllm_support:VOCAB", r"expected VOCAB to be a callable .* found int"),
        ("tests.vllm_support:not_a_policy_factory", r"expected not_a_policy_factory\(\) to return"),
    ],
)
def test_every_bad_path_is_refused_naming_it(path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        policy_from_import_path(path)
    assert repr(path) in str(refused.value)


def test_vllms_additional_config_takes_a_path_and_checks_it_at_start_up() -> None:
    config = NpuFtConfig.from_additional_config({"ftengine": {"policy": GOOD}})
    assert config.policy == GOOD
    with pytest.raises(
        ConfigError, match=r"ftengine\.policy: unknown policy 'sometimes': .* import path"
    ):
        NpuFtConfig.from_additional_config({"ftengine": {"policy": "sometimes"}})
    with pytest.raises(ConfigError, match="cannot import nowhere"):
        NpuFtConfig.from_additional_config({"ftengine": {"policy": "nowhere:make"}})


def test_a_custom_policy_falls_back_to_waiting_where_it_abstains() -> None:
    from ftengine.integrations.vllm.config import VllmFtSettings

    settings = VllmFtSettings(enabled=True, npu=NpuFtConfig(policy=GOOD, recovery_timeout_s=9))
    policy = settings.build_policy()
    assert decide(policy, ctx(FaultKind.TRANSIENT)) == Retry(0.0)
    assert isinstance(decide(policy, ctx(FaultKind.DEAD_PEER)), WaitForOrchestrator)


def test_the_cluster_and_ftengine_serve_take_a_path(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert ClusterConfig(tmp_path, policy=GOOD).policy == GOOD
    with pytest.raises(ConfigError, match="expected not_a_policy_factory"):
        ClusterConfig(tmp_path, policy="tests.vllm_support:not_a_policy_factory")
    assert decide(build_policy(GOOD, 5.0), ctx(FaultKind.TRANSIENT)) == Retry(0.0)
