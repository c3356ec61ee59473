"""Orchestrator commands: vLLM-style rejections, scale-down preconditions, idempotent replay."""

from __future__ import annotations

import pytest

from ftengine.context import RedundancyFacts
from ftengine.engine import CommandResult
from ftengine.faults import Phase
from tests.engine_support import Rig, dead_peer, make_rig, transient


def _unchanged(rig: Rig, before: tuple[object, ...]) -> bool:
    status = rig.engine.status()
    return (status, rig.backend.calls) == before


def _snapshot(rig: Rig) -> tuple[object, ...]:
    return (rig.engine.status(), rig.backend.calls)


@pytest.mark.parametrize("instruction", ["retry", "scale_down"])
def test_commands_while_serving_are_rejected_and_change_nothing(instruction: str) -> None:
    rig = make_rig()
    before = _snapshot(rig)
    result = rig.engine.apply(instruction, {"removed_dp_ranks": [3]}, "x")
    assert not result.success
    assert "status is HEALTHY (phase running)" in (result.reason or "")
    assert _unchanged(rig, before)


def test_commands_on_a_dead_engine_say_status_is_dead() -> None:
    rig = make_rig(lambda ctx: None)
    rig.engine.report_fault(transient())
    before = _snapshot(rig)
    result = rig.engine.apply("retry", {}, "x")
    assert result == CommandResult("x", False, result.reason)
    assert "engine 0 status is DEAD (phase dead)" in (result.reason or "")
    assert _unchanged(rig, before)


@pytest.mark.parametrize(
    ("instruction", "params", "expected"),
    [
        ("restart", {}, "unknown instruction 'restart'"),
        ("retry", {"removed_dp_ranks": [1]}, "retry takes no params"),
        ("retry", [1], "params must be a mapping"),
        ("scale_down", {}, "scale_down takes params"),
        ("scale_down", {"removed_dp_ranks": 3}, "scale_down takes params"),
        ("scale_down", {"removed_dp_ranks": [3], "force": True}, "scale_down takes params"),
        ("scale_down", {"removed_dp_ranks": [True]}, "must hold DP ranks"),
        ("scale_down", {"removed_dp_ranks": ["3"]}, "must hold DP ranks"),
        ("scale_down", {"removed_dp_ranks": [-1]}, "must hold DP ranks"),
    ],
)
def test_malformed_commands_are_rejected_in_quarantine(
    instruction: str, params: object, expected: str
) -> None:
    rig = make_rig()
    rig.engine.report_fault(dead_peer())
    before = _snapshot(rig)
    result = rig.engine.apply(instruction, params, "bad")  # type: ignore[arg-type]
    assert not result.success and expected in (result.reason or "")
    assert _unchanged(rig, before) and rig.engine.phase is Phase.QUARANTINED


@pytest.mark.parametrize(
    ("removed", "expected"),
    [
        ([], "removed_dp_ranks is empty"),
        ([3, 7], "ranks [7] are not initial DP ranks (0..3)"),
        ([0, 3], "contains this engine's own rank 0"),
        ([0, 1, 2, 3], "removes all 4 ranks"),
        ([1, 2], "the survivors cannot host every expert: 6 slots left < 8 logical experts"),
    ],
)
def test_scale_down_preconditions(removed: list[int], expected: str) -> None:
    rig = make_rig(redundancy=RedundancyFacts(ep_size=4, local_slots=3, num_logical=8))
    rig.engine.report_fault(dead_peer())
    before = _snapshot(rig)
    result = rig.engine.apply("scale_down", {"removed_dp_ranks": removed}, "s")
    assert not result.success
    assert (result.reason or "").startswith("scale_down rejected: ")
    assert expected in (result.reason or "")
    assert _unchanged(rig, before)


def test_the_removed_set_is_cumulative_and_must_name_a_newly_dead_rank() -> None:
    rig = make_rig()
    rig.engine.report_fault(dead_peer(3))
    assert rig.engine.apply("scale_down", {"removed_dp_ranks": [3]}, "a").success
    rig.engine.report_fault(dead_peer(2))
    forgot = rig.engine.apply("scale_down", {"removed_dp_ranks": [2]}, "b")
    assert "must include the ranks already removed [3]" in (forgot.reason or "")
    stale = rig.engine.apply("scale_down", {"removed_dp_ranks": [3]}, "c")
    assert "names no newly dead rank (already removed: [3])" in (stale.reason or "")


def test_every_broken_precondition_is_reported_at_once() -> None:
    rig = make_rig()
    rig.engine.report_fault(dead_peer())
    result = rig.engine.apply("scale_down", {"removed_dp_ranks": [0, 9]}, "s")
    assert "not initial DP ranks" in (result.reason or "")
    assert "own rank 0" in (result.reason or "")


def test_a_replayed_request_returns_the_recorded_result_without_acting() -> None:
    rig = make_rig()
    rig.engine.report_fault(transient())
    first = rig.engine.apply("retry", {}, "r1")
    rig.engine.report_fault(transient())
    before = _snapshot(rig)
    again = rig.engine.apply("retry", {}, "r1")
    other_instruction = rig.engine.apply("scale_down", {"removed_dp_ranks": [3]}, "r1")
    assert first.success and again == first and other_instruction == first
    assert _unchanged(rig, before) and rig.engine.phase is Phase.QUARANTINED


def test_a_replayed_rejection_stays_rejected() -> None:
    rig = make_rig()
    rejected = rig.engine.apply("retry", {}, "early")
    rig.engine.report_fault(transient())
    assert rig.engine.apply("retry", {}, "early") == rejected
    assert rig.engine.phase is Phase.QUARANTINED


def test_rejections_leave_the_last_request_id_alone() -> None:
    rig = make_rig()
    rig.engine.report_fault(transient())
    rig.engine.apply("retry", {}, "good")
    rig.engine.apply("retry", {}, "bad")
    assert rig.engine.status().last_ft_request_id == "good"


@pytest.mark.parametrize("request_id", ["", None, 7])
def test_a_request_id_must_be_a_non_empty_string(request_id: object) -> None:
    rig = make_rig()
    rig.engine.report_fault(transient())
    result = rig.engine.apply("retry", {}, request_id)  # type: ignore[arg-type]
    assert not result.success and "request_id must be a non-empty string" in (result.reason or "")
    assert rig.engine.phase is Phase.QUARANTINED
