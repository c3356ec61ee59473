"""Decoding and validation of fault-tolerance commands: every bad input names its problem."""

from __future__ import annotations

import json

import pytest

from ftengine.control.messages import (
    Command,
    FaultToleranceRequest,
    InvalidCommand,
    decode_request,
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
    command = validate_request(request, world_size=4)
    assert command == Command("scale_down", "r1", (3,))
    assert command.params() == {"removed_dp_ranks": [3]}


def test_retry_params_default_to_empty() -> None:
    command = validate_request(
        decode_request(_body(instruction="retry", request_id="x")), world_size=4
    )
    assert command == Command("retry", "x")
    assert command.params() == {}


def test_cumulative_ranks_are_sorted() -> None:
    request = decode_request(
        _body(instruction="scale_down", params={"removed_dp_ranks": [3, 1]}, request_id="r")
    )
    assert validate_request(request, world_size=4, removed=frozenset({3})).removed_dp_ranks == (
        1,
        3,
    )


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "does not match FaultToleranceRequest"),
        (_body(instruction="reboot", params={}, request_id="r"), "unknown instruction 'reboot'"),
        (_body(params={}, request_id="r"), "missing required field `instruction`"),
        (_body(instruction="retry", params={}), "missing required field `request_id`"),
        (_body(instruction="retry", request_id=""), "length >= 1"),
        (_body(instruction="retry", request_id="r" * 129), "length <= 128"),
        (_body(instruction="retry", params=[], request_id="r"), "Expected `object`"),
        (_body(instruction="retry", request_id="r", extra=1), "unknown field `extra`"),
    ],
)
def test_malformed_bodies_are_rejected_with_a_reason(body: bytes, needle: str) -> None:
    with pytest.raises(InvalidCommand, match=None) as info:
        decode_request(body)
    assert needle in str(info.value)


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
        validate_request(request, world_size=4, removed=frozenset(removed))
    assert needle in str(info.value)
