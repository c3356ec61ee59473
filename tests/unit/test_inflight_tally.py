"""The in-flight benchmark's counts: lost requests, mismatched / repeated / missing tokens
and the extra latency of the requests in flight at the fault, on hand-made streams."""

from __future__ import annotations

import attrs
import pytest

from ftengine.testbed.bench.inflight_tally import in_flight_at, stalls, tally, targets_met

WANT = [7, 8, 9, 10]


@attrs.define
class FakeStream:
    """The fields of ``inflight_stream.Stream`` the tally reads."""

    tokens: list[int]
    finish_reason: str | None = "length"
    error: str | None = None
    start_s: float = 0.0
    end_s: float | None = 10.0
    arrivals: list[float] = attrs.field(factory=list)
    refusals: int = 0
    admitted_s: float = attrs.field(
        default=attrs.Factory(lambda self: self.start_s, takes_self=True)
    )

    @property
    def completed(self) -> bool:
        return self.error is None and self.finish_reason == "length"


def test_exact_streams_meet_the_targets_and_report_extra_latency() -> None:
    streams = [FakeStream(list(WANT), end_s=12.0), FakeStream(list(WANT), end_s=4.0)]
    row = tally(streams, [WANT, WANT], fault_s=5.0, baseline_s=[10.0, 4.0])
    assert row["requests_completed"] == 2 and row["requests_lost"] == 0
    assert row["requests_in_flight_at_fault"] == 1  # the second ended before the fault
    assert row["extra_latency_s"] == {"median": 2.0, "max": 2.0, "n": 1}
    assert targets_met(row)


def test_the_stall_is_the_longest_wait_for_a_chunk_of_a_request_in_flight() -> None:
    paused = FakeStream(list(WANT), arrivals=[1.0, 1.5, 4.5, 5.0])  # 3 s between 2nd and 3rd
    ended = FakeStream(list(WANT), end_s=0.5, arrivals=[0.1, 0.2, 0.3, 0.4])
    row = tally([paused, ended], [WANT, WANT], fault_s=2.0, baseline_s=[10.0, 0.5])
    assert row["stall_s"] == {"median": 3.0, "max": 3.0, "n": 1}


def test_a_fault_free_rounds_stalls_count_its_completed_streams() -> None:
    slow = FakeStream(list(WANT), end_s=6.0, arrivals=[1.0, 3.5, 4.0, 5.0])  # 2.5 s
    quick = FakeStream(list(WANT), end_s=1.0, arrivals=[0.5, 0.6, 0.7, 0.8])  # 0.5 s
    unfinished = FakeStream(list(WANT)[:2], finish_reason=None, end_s=None, arrivals=[0.1, 9.0])
    assert stalls([slow, quick, unfinished]) == {"median": 1.5, "max": 2.5, "n": 2}


def test_a_repeat_a_gap_a_wrong_token_and_an_abort_are_each_counted() -> None:
    streams = [
        FakeStream([7, 8, 8, 9, 10]),  # 8 repeated: shifts three positions, one token extra
        FakeStream([7, 9, 10], finish_reason="length"),  # a gap
        FakeStream([7, 8, 0, 10]),
        FakeStream([7], finish_reason="abort"),
        FakeStream([], finish_reason=None, error="ReadError: boom", end_s=None),
    ]
    row = tally(streams, [WANT] * 5, fault_s=1.0, baseline_s=[9.0] * 5)
    assert row["requests_lost"] == 2 and row["requests_completed"] == 3
    assert row["tokens_duplicated"] == 1
    assert row["tokens_missing"] == 1  # only completed streams count as having a gap
    assert row["tokens_mismatched"] == 2 + 2 + 1
    assert row["finish_reasons"] == {"length": 3, "abort": 1, "error": 1}
    assert row["errors"] == ["ReadError: boom"]
    assert row["extra_latency_s"]["n"] == 3 and row["extra_latency_s"]["max"] == 1.0
    assert not targets_met(row)


def test_in_flight_means_started_before_and_not_ended_by_the_fault() -> None:
    streams = [
        FakeStream(WANT, start_s=0.0, end_s=2.0),
        FakeStream(WANT, start_s=3.0, end_s=9.0),
        FakeStream(WANT, start_s=0.0, end_s=None),
        FakeStream(WANT, start_s=1.0, end_s=6.0),
    ]
    assert in_flight_at(streams, 2.5) == [2, 3]


def test_one_reference_and_baseline_per_stream_is_required() -> None:
    with pytest.raises(ValueError, match="one reference and one baseline per stream"):
        tally([FakeStream(WANT)], [WANT, WANT], 0.0, [1.0])


def test_a_stream_refused_before_admission_and_asked_again_is_counted_apart() -> None:
    # Asked at 1 s, refused while the cluster recovered, admitted at 7 s: not in flight.
    refused = FakeStream(list(WANT), refusals=2, start_s=1.0, admitted_s=7.0, end_s=12.0)
    streams = [refused, FakeStream(list(WANT))]
    row = tally(streams, [WANT, WANT], fault_s=5.0, baseline_s=[4.0, 4.0])
    assert row["requests_refused_then_retried"] == 1
    assert row["requests_in_flight_at_fault"] == 1  # the second one only
    assert row["requests_lost"] == 0 and targets_met(row)
