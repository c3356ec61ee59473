"""The chaos campaign's pure parts: the seeded plan replays and covers every kind, victims
are chosen among the live ranks, and every invariant catches a planted violation (so the
campaign's checks can fail), while a clean record passes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ftengine.testbed.chaos.catalogue import (
    ChaosKind,
    PlannedFault,
    When,
    parse_only,
    plan,
    sub_plan,
)
from ftengine.testbed.chaos.history import History
from ftengine.testbed.chaos.invariants import (
    FaultResult,
    check_fault,
    check_request,
    detection_bound,
    fault_at,
    tally,
)
from ftengine.testbed.chaos.orchestrate import _command, settled_state
from ftengine.testbed.chaos.traffic import StreamRecord

KINDS = tuple(ChaosKind)
REFERENCE = [11, 12, 13, 14]


def test_the_same_seed_replays_the_same_plan_and_another_seed_does_not() -> None:
    assert plan(7, 40, KINDS) == plan(7, 40, KINDS)
    assert plan(7, 40, KINDS) != plan(8, 40, KINDS)


def test_a_plan_covers_every_kind_and_lands_some_faults_during_recovery() -> None:
    faults = plan(3, 20, KINDS)
    assert {f.kind for f in faults} == set(KINDS)
    assert faults[0].when is When.STEADY
    assert any(f.when is When.RECOVERY for f in faults)
    assert [f.index for f in faults] == list(range(20))


def test_a_plan_needs_kinds() -> None:
    with pytest.raises(ValueError, match="at least one fault kind"):
        plan(0, 3, ())


def test_only_replays_the_named_faults_exactly_as_the_whole_plan_has_them() -> None:
    whole = plan(19, 200, KINDS)
    assert parse_only("29,30, 36") == (29, 30, 36)
    assert parse_only("24-26,30,25") == (24, 25, 26, 30)
    chosen = sub_plan(whole, parse_only("28-30,36"))
    assert chosen == [whole[28], whole[29], whole[30], whole[36]]
    assert sub_plan(whole, None) == whole


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "at least one"),
        ("a", "fault numbers like"),
        ("5-3", "low <= high"),
        ("-2", "fault numbers like"),
    ],
)
def test_only_refuses_what_is_no_list_of_fault_numbers(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_only(text)


def test_only_refuses_faults_the_plan_does_not_have() -> None:
    with pytest.raises(ValueError, match=r"faults \[20\] are not in a plan of 20"):
        sub_plan(plan(3, 20, KINDS), (19, 20))


@pytest.mark.parametrize(
    ("kind", "live", "want"),
    [
        (ChaosKind.RANK0, [0, 1, 2, 3], (0,)),
        (ChaosKind.RANK0, [1, 3], (3,)),  # rank 0 already gone: pick one live rank
        (ChaosKind.TWO_RANKS, [0, 1, 2, 3], (1, 2)),
        (ChaosKind.SIGKILL, [2, 3], (3,)),
    ],
)
def test_victims_are_live_ranks(kind: ChaosKind, live: list[int], want: tuple[int, ...]) -> None:
    fault = PlannedFault(index=0, kind=kind, when=When.STEADY, delay_steps=1, pick=5)
    assert fault.victims(live) == want


def engine(rank: int, status: str, phase: str, **extra: Any) -> dict[str, Any]:
    return {"id": rank, "status": status, "phase": phase, "removed_ranks": [], **extra}


def result(**changes: Any) -> FaultResult:
    fields: dict[str, Any] = {
        "index": 4,
        "kind": ChaosKind.SIGKILL,
        "when": When.STEADY,
        "step": 30,
        "victims": (3,),
        "detect_s": 0.05,
        "recover_s": 0.3,
        "outcome": "settled",
        "engines": (
            engine(0, "healthy", "healthy"),
            engine(3, "dead", "dead", ft_error="worker process killed by SIGKILL"),
        ),
    }
    fields.update(changes)
    return FaultResult(**fields)


def test_a_clean_fault_passes() -> None:
    assert check_fault(result(), op_timeout_s=2.0) == []


@pytest.mark.parametrize(
    ("changes", "name"),
    [
        ({"detect_s": 2.5}, "detection"),
        ({"detect_s": None}, "detection"),
        ({"kind": ChaosKind.SIGSTOP, "detect_s": 3.2}, "detection"),
        ({"outcome": "stuck"}, "stuck_unhealthy"),
        (
            {
                "engines": (
                    engine(0, "unhealthy", "quarantined"),
                    engine(3, "dead", "dead", ft_error="x"),
                )
            },
            "stuck_unhealthy",
        ),
        (
            {"engines": (engine(0, "healthy", "healthy"), engine(3, "dead", "dead"))},
            "dead_without_reason",
        ),
        (
            {"engines": (engine(0, "healthy", "healthy"), engine(3, "healthy", "healthy"))},
            "victims_dead",
        ),
        ({"kind": ChaosKind.NET_CUT, "both_sides_served": True}, "split_brain"),
    ],
)
def test_a_planted_fault_violation_is_caught(changes: dict[str, Any], name: str) -> None:
    problems = check_fault(result(**changes), op_timeout_s=2.0)
    assert [p.split(":")[0] for p in problems].count(name) >= 1, problems


def test_the_silent_kinds_get_the_op_timeout_plus_one_second() -> None:
    assert detection_bound(ChaosKind.SIGSTOP, 2.0) == 3.0
    assert detection_bound(ChaosKind.NET_CUT, 2.0) == 3.0
    assert detection_bound(ChaosKind.SIGKILL, 2.0) == 2.0
    # A fault landing during another's recovery may be absorbed into that episode.
    assert check_fault(result(when=When.RECOVERY, detect_s=None), 2.0) == []


def stream(chunks: list[list[int]], finish: str | None, **extra: Any) -> StreamRecord:
    record = StreamRecord(client=0, prompt=0, started=1.0, **extra)
    record.chunks, record.finish_reason, record.ended = chunks, finish, 2.0
    return record


@pytest.mark.parametrize(
    ("record", "names"),
    [
        (stream([[11], [12], [13], [14]], "length"), []),
        (stream([[11], [12], [99], [14]], "length"), ["wrong_tokens"]),
        (stream([[11], [12], [12], [13]], "length"), ["wrong_tokens"]),  # a repeat
        (stream([[11], [12], [14]], "length"), ["wrong_tokens", "stream_gaps_or_repeats"]),
        (stream([[11], [12, 13], [14]], "length"), ["stream_gaps_or_repeats"]),
        (stream([[11]], "abort", stop_reason="engine 0 is DEAD: x"), []),
        (stream([[11]], "abort"), ["lost"]),
        (stream([[12]], "abort", stop_reason="why"), ["wrong_tokens"]),
        (stream([], None, error="ReadTimeout: timed out"), ["lost"]),
        (stream([], None, error='HTTP 503: {"error": "not serving"}'), []),
    ],
)
def test_every_request_invariant_catches_its_planted_violation(
    record: StreamRecord, names: list[str]
) -> None:
    problems = check_request(record, REFERENCE, max_tokens=4)
    assert [p.split(":")[0] for p in problems] == names


def test_the_tally_counts_each_request_once() -> None:
    records = [
        stream([[11], [12], [13], [14]], "length"),
        stream([[11]], "abort", stop_reason="why"),
        stream([], None, error="boom"),
        stream([], None, error="HTTP 503: no"),
        stream([[11], [12], [99], [14]], "length"),
    ]
    counts = tally(records, [check_request(r, REFERENCE, 4) for r in records])
    # A completed stream with a wrong token is completed, and counted wrong.
    got = (counts.completed, counts.aborted_with_reason, counts.lost, counts.refused)
    assert got == (2, 1, 1, 1)
    assert counts.wrong_tokens == 1
    assert counts.answered_after_refusal == 0
    records[0].refusals = 2  # refused twice (503), then answered on another server
    records[3].refusals = 5  # refused to the end
    counts = tally(records, [check_request(r, REFERENCE, 4) for r in records])
    assert (counts.completed, counts.refused, counts.answered_after_refusal) == (2, 1, 1)
    assert counts.fields()["requests_answered_after_refusal"] == 1


def test_violations_are_blamed_on_the_fault_injected_last_before() -> None:
    assert fault_at([1.0, 5.0, 9.0], [0, 1, 2], 6.0) == 1
    assert fault_at([1.0, 5.0], [0, 1], 0.5) is None


def test_the_orchestrator_scales_down_past_the_dead_and_retries_otherwise() -> None:
    quarantined = engine(0, "unhealthy", "quarantined", removed_ranks=[2])
    dead = engine(3, "dead", "dead", ft_error="gone")
    assert _command([quarantined, dead]) == ("scale_down", {"removed_dp_ranks": [2, 3]})
    assert _command([quarantined]) == ("retry", {})
    # Someone still serves (a stopped rank not fenced yet) or recovery runs: wait.
    assert _command([quarantined, engine(3, "healthy", "healthy")]) is None
    assert _command([engine(0, "unhealthy", "scaling_down")]) is None


def test_recovery_settles_only_with_the_dead_removed() -> None:
    dead = engine(3, "dead", "dead", ft_error="gone", alive=False)
    assert settled_state([engine(0, "healthy", "healthy", removed_ranks=[3]), dead]) == "settled"
    assert settled_state([engine(0, "healthy", "healthy"), dead]) is None
    assert (
        settled_state([engine(0, "dead", "dead", alive=True, ft_error="gave up"), dead]) == "dead"
    )
    # One engine dead while another still recovers: not over yet (judged stuck at the end).
    recovering = engine(1, "unhealthy", "scaling_down")
    assert settled_state([engine(0, "dead", "dead", ft_error="x"), recovering, dead]) is None
    # A removed rank whose process has not exited yet still reads healthy: wait for it.
    fenced = engine(3, "healthy", "healthy", alive=True)
    assert settled_state([engine(0, "healthy", "healthy", removed_ranks=[3]), fenced]) is None


def test_history_excerpts_name_the_fault() -> None:
    history = History()
    entry = history.add("inject", 3, kind="sigkill")
    assert history.excerpt(entry.at - 1, entry.at + 1) == [entry.line(history.origin)]
    assert "#3 inject" in entry.line(history.origin)


def test_an_armed_injector_fires_once_at_its_next_step_on_its_rank_only() -> None:
    from ftengine.testbed.cluster.faults_inject import FaultInjector, FaultSpec, InjectKind

    mine, other = FaultInjector(None, rank=2), FaultInjector(None, rank=1)
    spec = FaultSpec(rank=2, kind=InjectKind.RAISE, step=0)
    mine.arm(spec)
    other.arm(spec)
    assert (mine.due(40), mine.due(41), other.due(40)) == (InjectKind.RAISE, None, None)
    mine.arm(FaultSpec(rank=2, kind=InjectKind.RELOAD_ERROR))  # re-armed: fires again
    assert (mine.due(42), mine.reload_due(), mine.reload_due()) == (None, True, False)


def test_nested_shard_faults_put_the_originals_back(tmp_path: Path) -> None:
    from ftengine.testbed.chaos.actions import break_shards

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    shard = checkpoint / "model-00001-of-00001.safetensors"
    shard.write_bytes(b"x" * 64)
    first = break_shards(checkpoint, ChaosKind.SHARD_TRUNCATED, tmp_path / "stash")
    assert shard.stat().st_size == 32
    second = break_shards(checkpoint, ChaosKind.SHARD_REMOVED, tmp_path / "stash")
    assert not shard.exists()
    second()  # newest first, as the campaign repairs
    first()
    assert shard.read_bytes() == b"x" * 64
