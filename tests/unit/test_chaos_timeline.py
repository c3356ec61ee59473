"""The campaign's timeline (its plot's data): tokens per second in bins, each ended
stream's tokens spread over its life; faults placed at their injection."""

from __future__ import annotations

import pytest

from ftengine.testbed.chaos.catalogue import ChaosKind, When
from ftengine.testbed.chaos.history import Entry
from ftengine.testbed.chaos.invariants import FaultResult
from ftengine.testbed.chaos.timeline import throughput, timeline
from ftengine.testbed.chaos.traffic import StreamRecord

ORIGIN = 100.0


def record(start: float, end: float | None, tokens: int) -> StreamRecord:
    return StreamRecord(
        0, 0, ORIGIN + start, [[1] * tokens], ended=None if end is None else ORIGIN + end
    )


def test_a_streams_tokens_are_spread_over_the_bins_it_lived_in() -> None:
    # 30 tokens over 5-20 s: 5 s in bin 0, 10 s in bin 1 -> 10 and 20 tokens
    assert throughput([record(5.0, 20.0, 30)], ORIGIN, 10.0) == pytest.approx((1.0, 2.0))
    both = throughput([record(5.0, 20.0, 30), record(0.0, 2.0, 10)], ORIGIN, 10.0)
    assert both == pytest.approx((2.0, 2.0))


def test_unended_or_empty_streams_count_nowhere_and_a_bad_bin_is_refused() -> None:
    assert throughput([record(0.0, None, 5), record(0.0, 3.0, 0)], ORIGIN) == ()
    assert throughput([record(4.0, 4.0, 6)], ORIGIN, 10.0) == pytest.approx((0.6,))
    with pytest.raises(ValueError, match="bin_s: expected seconds > 0, found 0"):
        throughput([], ORIGIN, 0.0)


def test_faults_sit_at_their_injection_with_their_timings() -> None:
    entries = [
        Entry(ORIGIN + 3.0, "inject", 0, {"kind": "sigkill"}),
        Entry(ORIGIN + 4.0, "detected", 0, {}),
        Entry(ORIGIN + 9.5, "inject", 1, {"kind": "sigstop"}),
    ]
    results = [
        FaultResult(i, kind, When.STEADY, 0, (1,), 0.1 * (i + 1), 2.0, "settled", ())
        for i, kind in enumerate((ChaosKind.SIGKILL, ChaosKind.SIGSTOP))
    ]
    line = timeline(entries, [record(0.0, 10.0, 50)], results, ORIGIN, 5.0)
    assert line.tokens_per_s == pytest.approx((5.0, 5.0))
    assert [(m.at_s, m.index, m.kind, m.detect_s) for m in line.faults] == [
        (3.0, 0, "sigkill", 0.1),
        (9.5, 1, "sigstop", 0.2),
    ]
