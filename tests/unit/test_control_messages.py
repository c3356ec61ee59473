"""Decoding and validation of fault-tolerance commands by vLLM's rules, and the status of
one engine as vLLM sends it."""

from __future__ import annotations

import json

import pytest

from ftengine.testbed.control.errors import InvalidCommand, InvalidRequest
from ftengine.testbed.control.messages import (
    Command,
    FaultToleranceRequest,
    FaultToleranceResult,
    decode_request,
    engine_wire,
    validate_request,
)


def _body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_decodes_vllm_shaped_scale_down() -> None:
    body = _body(instruction="scale_down", params={"removed_dp_ranks": [3]}, request_id="r1")
    request = decode_request(body)
    assert request == FaultToleranceRequest(
        instruction="scale_down", params={"removed_dp_ranks": [3]}, request_id="r1"
    )
    command = validate_request(request, "r1", world_size=4)
    assert command == Command("scale_down", "r1", (3,))
    assert command.params() == {"removed_dp_ranks": [3]}


def test_a_vllm_body_has_no_request_id_and_retry_params_default_to_empty() -> None:
    request = decode_request(_body(instruction="retry"))
    assert request.request_id is None and request.params == {}
    command = validate_request(request, "made-by-server", world_size=4)
    assert command == Command("retry", "made-by-server")
    assert command.params() == {}


def test_cumulative_ranks_are_sorted() -> None:
    request = decode_request(
        _body(instruction="scale_down", params={"removed_dp_ranks": [3, 1]}, request_id="r")
    )
    command = validate_request(request, "r", world_size=4, removed=frozenset({3}))
    assert command.removed_dp_ranks == (1, 3)


@pytest.mark.parametrize(
    ("body", "needle", "param"),
    [
        (b"{not json", "Invalid JSON format", None),
        (b"[1, 2]", "Request body must be a JSON object. Found list", None),
        (_body(instruction="reboot", params={}), "Invalid instruction: 'reboot'.", "instruction"),
        (_body(instruction=3), "Invalid instruction: '3'.", "instruction"),
        (_body(params={}), "'instruction' is required.", "instruction"),
        (_body(instruction=None), "'instruction' is required.", "instruction"),
        (_body(instruction="retry", params=[]), "'params' must be an object.", "params"),
        (_body(instruction="retry", request_id=""), "1 to 128 characters", "request_id"),
        (_body(instruction="retry", request_id="r" * 129), "1 to 128 characters", "request_id"),
        (_body(instruction="retry", request_id=["r"]), "found ['r']", "request_id"),
    ],
)
def test_malformed_bodies_are_rejected_with_a_reason(
    body: bytes, needle: str, param: str | None
) -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_request(body)
    assert needle in str(info.value) and info.value.param == param
    assert info.value.status == 400 and info.value.err_type == "Bad Request"


def test_unknown_fields_are_ignored_like_vllm() -> None:
    request = decode_request(_body(instruction="retry", request_id="r", extra=1))
    assert request == FaultToleranceRequest(instruction="retry", params={}, request_id="r")


@pytest.mark.parametrize(
    ("instruction", "params", "removed", "needle"),
    [
        ("retry", {"removed_dp_ranks": [3]}, (), "retry takes no params"),
        ("scale_down", {}, (), "list of integer DP ranks"),
        ("scale_down", {"removed_dp_ranks": 3}, (), "list of integer DP ranks"),
        ("scale_down", {"removed_dp_ranks": ["3"]}, (), "list of integer DP ranks"),
        ("scale_down", {"removed_dp_ranks": [True]}, (), "list of integer DP ranks"),
        ("scale_down", {"removed_dp_ranks": [1.0]}, (), "list of integer DP ranks"),
        ("scale_down", {"removed_dp_ranks": []}, (), "is empty"),
        ("scale_down", {"removed_dp_ranks": [3, 3]}, (), "repeats a rank"),
        ("scale_down", {"removed_dp_ranks": [4]}, (), "[4] are out of range"),
        ("scale_down", {"removed_dp_ranks": [-1, 2]}, (), "[-1] are out of range"),
        ("scale_down", {"removed_dp_ranks": [0, 1, 2, 3]}, (), "every one of the 4"),
        ("scale_down", {"removed_dp_ranks": [0, 1]}, (2, 3), "every one of the 4"),
        ("scale_down", {"removed_dp_ranks": [3], "force": True}, (), "unexpected params"),
    ],
)
def test_bad_params_are_rejected_with_a_reason(
    instruction: str, params: dict[str, object], removed: tuple[int, ...], needle: str
) -> None:
    request = decode_request(_body(instruction=instruction, params=params, request_id="r"))
    with pytest.raises(InvalidCommand) as info:
        validate_request(request, "r", world_size=4, removed=frozenset(removed))
    assert needle in str(info.value)
    assert info.value.param in ("params", "params.removed_dp_ranks")


ENGINE = {
    "id": 2,
    "status": 2,
    "phase": "quarantined",
    "fault_info": "PeerDead",
    "last_ft_request_id": None,
    "ft_error": None,
    "removed_ranks": [],
    "epoch": 0,
}


def test_an_engine_goes_out_with_vllms_status_name_and_optional_fields() -> None:
    unhealthy = engine_wire(ENGINE, None)
    assert unhealthy["status"] == "unhealthy" and unhealthy["fault_info"] == "PeerDead"
    assert "last_ft_request_id" not in unhealthy and "ft_error" not in unhealthy
    assert unhealthy["phase"] == "quarantined", "ftengine's extras stay"
    healthy = engine_wire({**ENGINE, "status": 0, "phase": "healthy"}, None)
    assert healthy["status"] == "healthy" and "fault_info" not in healthy
    dead = engine_wire({**ENGINE, "status": 1, "fault_info": "killed by SIGKILL"}, None)
    assert dead["status"] == "dead" and "fault_info" not in dead
    assert ENGINE["status"] == 2, "the cluster's dict is not changed"


def test_a_failed_command_shows_on_engines_that_did_not_record_it() -> None:
    refused = FaultToleranceResult(request_id="r1", success=False, reason="engine 3 is DEAD")
    shown = engine_wire(ENGINE, refused)
    assert (shown["last_ft_request_id"], shown["ft_error"]) == ("r1", "engine 3 is DEAD")
    own = {**ENGINE, "last_ft_request_id": "r1", "ft_error": "engine 2: its own reason"}
    assert engine_wire(own, refused)["ft_error"] == "engine 2: its own reason"
    done = FaultToleranceResult(request_id="r2", success=True)
    assert "ft_error" not in engine_wire(ENGINE, done)
    assert "last_ft_request_id" not in engine_wire(ENGINE, done)
