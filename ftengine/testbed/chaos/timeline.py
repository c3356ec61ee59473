"""A campaign over time, for its plot: the tokens streamed per second in fixed bins (each
ended stream's tokens spread evenly over its life: chunks carry no clock), and each fault's
injection time with its kind, detection and recovery times. Times are seconds from the
campaign's start."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from ftengine.testbed.chaos.history import Entry
from ftengine.testbed.chaos.invariants import FaultResult
from ftengine.testbed.chaos.traffic import StreamRecord

BIN_S = 10.0


@attrs.frozen
class FaultMark:
    """One fault on the time axis."""

    at_s: float
    index: int
    kind: str
    detect_s: float | None
    recover_s: float | None


@attrs.frozen
class Timeline:
    """``tokens_per_s[i]``: the rate over ``[i * bin_s, (i + 1) * bin_s)``."""

    bin_s: float
    tokens_per_s: tuple[float, ...]
    faults: tuple[FaultMark, ...]


def throughput(
    records: Sequence[StreamRecord], origin: float, bin_s: float = BIN_S
) -> tuple[float, ...]:
    """Tokens per second in consecutive ``bin_s`` bins from ``origin`` (monotonic) to the
    last stream's end; a stream that never ended counts nowhere."""
    if bin_s <= 0:
        raise ValueError(f"bin_s: expected seconds > 0, found {bin_s}")
    ended = [r for r in records if r.ended is not None and r.tokens]
    if not ended:
        return ()
    end = max(float(r.ended) for r in ended if r.ended is not None) - origin
    tokens = [0.0] * max(1, math.ceil(end / bin_s))
    for record in ended:
        assert record.ended is not None
        start, stop = record.started - origin, record.ended - origin
        first, last = int(max(start, 0.0) // bin_s), min(int(stop // bin_s), len(tokens) - 1)
        if stop - start <= 0.0:  # no measurable life: all of it in its bin
            tokens[last] += len(record.tokens)
            continue
        rate = len(record.tokens) / (stop - start)
        for i in range(first, last + 1):
            overlap = min(stop, (i + 1) * bin_s) - max(start, i * bin_s)
            tokens[i] += rate * max(overlap, 0.0)
    return tuple(t / bin_s for t in tokens)


def timeline(
    entries: Sequence[Entry],
    records: Sequence[StreamRecord],
    results: Sequence[FaultResult],
    origin: float,
    bin_s: float = BIN_S,
) -> Timeline:
    """The campaign's throughput and its faults (from the ``inject`` entries of its
    history, matched to ``results`` by fault index) from ``origin`` (monotonic)."""
    injected = {e.fault: e.at - origin for e in entries if e.what == "inject"}
    marks = tuple(
        FaultMark(injected[r.index], r.index, r.kind.value, r.detect_s, r.recover_s)
        for r in results
        if r.index in injected
    )
    return Timeline(bin_s, throughput(records, origin, bin_s), marks)
