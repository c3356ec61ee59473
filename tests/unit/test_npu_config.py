"""The vLLM-Ascend-style ``additional_config`` surface of the NPU backend."""

from __future__ import annotations

import pytest
import torch

from ftengine.backends.npu import NpuBackend
from ftengine.backends.npu_config import NpuFtConfig
from ftengine.backends.npu_host import NpuTopology
from ftengine.backends.npu_runtime import NpuRuntime
from ftengine.errors import ConfigError
from tests.fakes.npu_host import FakeNpuHost, RecordingGroupFactory
from tests.fakes.npu_state import Call, FakeNpuState
from tests.unit.npu_fixtures import TinyCheckpoints
from tests.unit.npu_fixtures import npu_state as npu_state
from tests.unit.npu_fixtures import tiny_checkpoints as tiny_checkpoints


def test_defaults_without_additional_config() -> None:
    assert NpuFtConfig.from_additional_config(None) == NpuFtConfig()
    assert NpuFtConfig() == NpuFtConfig(
        communication_abort_timeout_s=0,
        policy="orchestrator",
        scale_down=True,
        recovery_timeout_s=120.0,
        cpu_distributed_timeout_s=None,
    )


def test_full_surface_is_read() -> None:
    config = NpuFtConfig.from_additional_config(
        {
            "ft_communication_abort_timeout": 30,
            "ftengine": {
                "policy": "auto",
                "scale_down": False,
                "recovery_timeout_sec": 60,
                "cpu_distributed_timeout_sec": 30,
            },
            "torchair_graph_config": {"enabled": True},  # vLLM-Ascend's own key: left alone
        }
    )
    assert config == NpuFtConfig(
        communication_abort_timeout_s=30,
        policy="auto",
        scale_down=False,
        recovery_timeout_s=60.0,
        cpu_distributed_timeout_s=30.0,
    )


@pytest.mark.parametrize(
    ("sub", "key"),
    [
        ({"polcy": "auto"}, "ftengine.polcy"),
        ({"policy": "eager"}, "ftengine.policy"),
        ({"policy": ["auto"]}, "ftengine.policy"),
        ({"scale_down": "yes"}, "ftengine.scale_down"),
        ({"recovery_timeout_sec": 0}, "ftengine.recovery_timeout_sec"),
        ({"recovery_timeout_sec": True}, "ftengine.recovery_timeout_sec"),
        ({"cpu_distributed_timeout_sec": -5}, "ftengine.cpu_distributed_timeout_sec"),
    ],
)
def test_invalid_ftengine_options_name_the_key(sub: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        NpuFtConfig.from_additional_config({"ftengine": sub})


def test_an_unknown_policy_lists_the_registered_names() -> None:
    with pytest.raises(ConfigError) as raised:
        NpuFtConfig.from_options({"policy": "eager"})
    assert str(raised.value) == (
        "ftengine.policy: unknown policy 'eager': expected one of 'auto', 'orchestrator' "
        "or an import path 'package.module:factory'"
    )
    assert isinstance(raised.value.__cause__, ConfigError)


def test_ftengine_must_be_an_object() -> None:
    with pytest.raises(ConfigError, match="ftengine must be a JSON object"):
        NpuFtConfig.from_additional_config({"ftengine": "auto"})


def test_backend_from_additional_config_applies_the_timeout(
    npu_state: FakeNpuState, tiny_checkpoints: TinyCheckpoints
) -> None:
    index = tiny_checkpoints.index(layers=1, experts=4)
    env: dict[str, str] = {}
    backend = NpuBackend.from_additional_config(
        {"ft_communication_abort_timeout": 30, "ftengine": {"policy": "auto"}},
        FakeNpuHost(index, ep_size=1, ep_rank=0, num_redundant=2),
        NpuTopology(dp_rank=0, dp_size=1, device_index=0),
        runtime=NpuRuntime.load(),
        group_factory=RecordingGroupFactory(),
        environ=env,
        device=torch.device("cpu"),
    )
    assert backend.config.policy == "auto"
    assert env == {"TASK_QUEUE_ENABLE": "0", "HCCL_EVENT_TIMEOUT": "30", "HCCL_EXEC_TIMEOUT": "29"}
    assert npu_state.of("npu.set_op_timeout_ms") == [Call("npu.set_op_timeout_ms", (30000,))]
