"""``scale_up`` over HTTP (ftengine's extension of vLLM's apply): a wrong ``added_dp_ranks``
is a 400 naming why (shape, range, not removed, not ready) and starts nothing; a replay is
judged against its record, not against today's state."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest

from ftengine.testbed.control.errors import InvalidCommand
from ftengine.testbed.control.messages import (
    FaultToleranceRequest,
    decode_request,
    validate_request,
)
from tests.unit.control_harness import APPLY, JSON, Api, error_object

pytestmark = pytest.mark.timeout(30)
ADDED = "params.added_dp_ranks"


@pytest.fixture
def api() -> Iterator[Api]:
    harness = Api()
    with harness.client:
        yield harness


def post(api: Api, ranks: object) -> tuple[int, dict[str, object]]:
    body = {"instruction": "scale_up", "params": {"added_dp_ranks": ranks}}
    answer = api.client.post(APPLY, content=msgspec.json.encode(body), headers=JSON)
    return answer.status_code, answer.json()


@pytest.mark.parametrize(
    ("ranks", "needle"),
    [
        ([], "added_dp_ranks is empty"),
        ([9], "added_dp_ranks [9] are out of range"),
        ([3, 3], "repeats a rank"),
        ([True], "list of integer DP ranks"),
        ([1], "added_dp_ranks [1] were not removed (removed: [])"),
    ],
)
def test_a_wrong_scale_up_is_a_400_naming_why(api: Api, ranks: object, needle: str) -> None:
    before = api.state()
    status, body = post(api, ranks)
    assert status == 400
    info = error_object(_Answer(status, body))
    assert needle in str(info["message"]) and info["param"] == ADDED
    assert api.state() == before  # nothing started


def test_a_rank_that_did_not_report_ready_is_a_400() -> None:
    request = decode_request(b'{"instruction": "scale_up", "params": {"added_dp_ranks": [3]}}')
    with pytest.raises(InvalidCommand, match=r"\[3\] are not ready"):
        validate_request(request, "u1", world_size=4, removed=frozenset({3}), ready=frozenset())
    command = validate_request(
        request, "u1", world_size=4, removed=frozenset({3}), ready=frozenset({3})
    )
    assert command.params() == {"added_dp_ranks": [3]}
    # A replay (ready=None) is not re-judged against today's state.
    replay = validate_request(request, "u1", world_size=4)
    assert replay == command


def test_scale_up_is_a_known_instruction_and_takes_only_added_dp_ranks() -> None:
    request = FaultToleranceRequest(instruction="scale_up", params={"removed_dp_ranks": [3]})
    with pytest.raises(InvalidCommand, match="scale_up takes only 'added_dp_ranks'"):
        validate_request(request, "u2", world_size=4, removed=frozenset({3}), ready=frozenset())


class _Answer:
    def __init__(self, status: int, body: dict[str, object]) -> None:
        self.status_code = status
        self._body = body

    def json(self) -> dict[str, object]:
        return self._body
