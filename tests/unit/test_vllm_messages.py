"""ftengine <-> vLLM's real fault-tolerance message types and status enum."""

from __future__ import annotations

import msgspec
import pytest

from ftengine.commands import CommandResult
from ftengine.faults import HealthStatus
from ftengine.integrations.vllm.messages import VllmMessages, VllmUnavailable, import_vllm

utils = pytest.importorskip("vllm.v1.fault_tolerance.utils", reason="vllm is not installed")
EngineStatusType = pytest.importorskip("vllm.v1.engine").EngineStatusType


def test_the_types_are_vllms_and_health_values_agree() -> None:
    messages = VllmMessages.load()
    assert messages.request_type is utils.FaultToleranceRequest
    assert messages.result_type is utils.FaultToleranceResult
    assert messages.status_type == EngineStatusType
    for health in HealthStatus:
        assert int(EngineStatusType[health.name]) == int(health)
        assert messages.status_name(health) == health.name


def test_a_request_splits_into_ftengine_params_and_vllms_own() -> None:
    messages = VllmMessages.load()
    request = utils.FaultToleranceRequest(
        "scale_down", {"removed_dp_ranks": [3], "new_stateless_dp_group_ports": [1, 2]}, "id-1"
    )
    wire = msgspec.msgpack.encode(request)
    command = messages.split(msgspec.msgpack.decode(wire, type=utils.FaultToleranceRequest))
    assert (command.instruction, command.request_id) == ("scale_down", "id-1")
    assert dict(command.params) == {"removed_dp_ranks": [3]}
    assert dict(command.vllm_params) == {"new_stateless_dp_group_ports": [1, 2]}
    as_dict = messages.split({"instruction": "retry", "params": {}, "request_id": "id-2"})
    assert (as_dict.instruction, dict(as_dict.params), as_dict.request_id) == ("retry", {}, "id-2")


def test_results_become_vllms_result_and_survive_the_wire() -> None:
    messages = VllmMessages.load()
    result = messages.result(CommandResult("id-3", False, "status is DEAD"))
    assert isinstance(result, utils.FaultToleranceResult)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(result), type=utils.FaultToleranceResult)
    assert (back.request_id, back.success, back.reason) == ("id-3", False, "status is DEAD")


def test_a_missing_vllm_module_names_itself_and_the_fix() -> None:
    with pytest.raises(VllmUnavailable, match=r"vllm\.no_such_module.*install_vllm_cpu\.sh"):
        import_vllm("vllm.no_such_module")
