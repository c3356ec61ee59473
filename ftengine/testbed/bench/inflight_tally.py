"""What the in-flight benchmark counts for one fault: how many requests completed or were
lost, how many streamed tokens differ from the fault-free reference, repeat or are missing,
and how much later than fault-free the requests that were in flight at the fault ended.

Definitions (docs/results/inflight.md uses them): a request is *completed* when its stream
ended normally with ``finish_reason == "length"``, else *lost* (aborted, error, broken or
never finished). For each stream ``got`` (every chunk's token ids concatenated) against the
reference ``want``: *mismatched* are positions ``i < min(len)`` with ``got[i] != want[i]``,
*duplicated* are tokens beyond ``len(want)`` (a repeat lengthens a stream), *missing* are
tokens a completed stream lacks (a gap shortens it). *In flight at the fault*: started
before the fault and not ended by then; its *extra latency* is its duration minus the same
prompt's fault-free duration (completed requests only), and its *stall* the longest wait
between two of its chunks (from its start), which shows the interruption itself where the
recovered cluster is faster or slower than before (fewer ranks on a shared CPU are faster)."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

from ftengine.testbed.bench.trials import summary


class StreamLike(Protocol):
    """``ftengine.testbed.bench.inflight_stream.Stream``'s fields the tally reads."""

    @property
    def tokens(self) -> list[int]: ...
    @property
    def completed(self) -> bool: ...

    finish_reason: str | None
    error: str | None
    arrivals: list[float]
    start_s: float
    end_s: float | None
    refusals: int
    admitted_s: float


def mismatched(got: Sequence[int], want: Sequence[int]) -> int:
    return sum(1 for g, w in zip(got, want, strict=False) if g != w)


def in_flight_at(streams: Sequence[StreamLike], fault_s: float) -> list[int]:
    """Indexes of the streams admitted before ``fault_s`` and not ended by then (one refused
    with a 503 was not in flight: it counts from the attempt the server admitted)."""
    return [
        i
        for i, s in enumerate(streams)
        if s.admitted_s < fault_s and (s.end_s is None or s.end_s > fault_s)
    ]


def stall_s(stream: StreamLike) -> float:
    """The longest wait for a chunk (the first one from the start)."""
    times = [stream.start_s, *stream.arrivals]
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def stalls(streams: Sequence[StreamLike]) -> dict[str, float | int | None]:
    """Median, max and count of the completed ``streams``' stalls: for a fault-free round,
    the machine's own longest waits for a chunk, which a fault's stall is read beside."""
    done = [stall_s(s) for s in streams if s.completed]
    return {k: summary(done)[k] for k in ("median", "max", "n")}


def durations(streams: Sequence[StreamLike]) -> list[float | None]:
    """Each stream's duration in seconds, None for one that has not ended."""
    return [None if s.end_s is None else s.end_s - s.start_s for s in streams]


def tally(
    streams: Sequence[StreamLike],
    reference: Sequence[Sequence[int]],
    fault_s: float,
    baseline_s: Sequence[float],
) -> dict[str, Any]:
    """The counts of one fault round (see the module docstring); ``reference`` and
    ``baseline_s`` (fault-free durations) are per stream, in the same order."""
    if not len(streams) == len(reference) == len(baseline_s):
        raise ValueError(
            f"expected one reference and one baseline per stream, found {len(streams)} "
            f"streams, {len(reference)} references, {len(baseline_s)} baselines"
        )
    completed = [s.completed for s in streams]
    held = in_flight_at(streams, fault_s)
    took = durations(streams)
    extra = [t - baseline_s[i] for i in held if completed[i] and (t := took[i]) is not None]
    pairs = list(zip(streams, reference, strict=True))
    return {
        "requests_total": len(streams),
        "requests_completed": sum(completed),
        "requests_lost": len(streams) - sum(completed),
        "requests_in_flight_at_fault": len(held),
        # Refused with a 503 before admission (the cluster was recovering), then asked again.
        "requests_refused_then_retried": sum(1 for s in streams if s.refusals),
        "tokens_mismatched": sum(mismatched(s.tokens, w) for s, w in pairs),
        "tokens_duplicated": sum(max(0, len(s.tokens) - len(w)) for s, w in pairs),
        "tokens_missing": sum(max(0, len(w) - len(s.tokens)) for s, w in pairs if s.completed),
        "finish_reasons": dict(
            Counter(s.finish_reason or ("error" if s.error else "unfinished") for s in streams)
        ),
        "errors": sorted({s.error[:200] for s in streams if s.error}),
        "extra_latency_s": {k: summary(extra)[k] for k in ("median", "max", "n")},
        "stall_s": {
            k: summary([stall_s(streams[i]) for i in held if completed[i]])[k]
            for k in ("median", "max", "n")
        },
    }


def targets_met(row: dict[str, Any]) -> bool:
    """No request lost and every streamed token exact (none mismatched, repeated, missing)."""
    keys = ("requests_lost", "tokens_mismatched", "tokens_duplicated", "tokens_missing")
    return all(row[key] == 0 for key in keys)
