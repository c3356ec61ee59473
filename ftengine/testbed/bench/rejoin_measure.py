"""The rejoin benchmark's measurement: its setup, one stream's record, the pause an
admission caused and the throughput ratio with its noise (shared by every target)."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from typing import Any

import attrs

from ftengine.errors import FTEngineError


class RejoinBenchError(FTEngineError, RuntimeError):
    """The benchmark could not run (or a target is not available)."""


@attrs.frozen
class RejoinSetup:
    """What to run: ``dp`` ranks, ``victim`` killed and brought back, ``streams`` in flight
    of ``stream_tokens`` tokens each, throughput over ``trials`` batches of
    ``batch_requests`` x ``batch_tokens`` before and after; ``policy`` ``orchestrator``
    (a ``scale_up`` command admits) or ``auto`` (the survivors admit a ready rank)."""

    dp: int = 4
    victim: int = 3
    streams: int = 6
    stream_tokens: int = 400
    trials: int = 3
    batch_requests: int = 8
    batch_tokens: int = 48
    policy: str = "orchestrator"


@attrs.frozen
class Stream:
    """One in-flight stream: the monotonic time of each chunk, its tokens, how it ended."""

    prompt: tuple[int, ...]
    chunk_times: tuple[float, ...]
    tokens: tuple[int, ...]
    finish_reason: str | None
    detail: str | None = None


def pause_caused(streams: Sequence[Stream], start: float, end: float) -> tuple[float, float]:
    """``(longest, typical)``: the longest gap between two consecutive chunks of any stream
    that overlaps the admission window ``[start, end]``, and the median gap outside it
    (the noise floor the pause is read against)."""
    inside: list[float] = [0.0]
    outside: list[float] = []
    for stream in streams:
        times = stream.chunk_times
        for before, after in itertools.pairwise(times):
            gap = after - before
            (inside if before <= end and after >= start else outside).append(gap)
    return max(inside), statistics.median(outside) if outside else 0.0


def longest_gap(streams: Sequence[Stream]) -> float:
    """The longest gap between two consecutive chunks of any of ``streams`` (0 without
    one): read on fault-free streams of the full deployment, the machine's own stalls, the
    floor ``rejoin_pause_s`` is read against beside the median."""
    gaps = [b - a for s in streams for a, b in itertools.pairwise(s.chunk_times)]
    return max(gaps, default=0.0)


def summarize_ratio(before: Sequence[float], after: Sequence[float]) -> dict[str, Any]:
    """``after / before`` of the medians, with every trial and the spread of each side
    (max / min - 1) as the noise the ratio is read against."""

    def spread(values: Sequence[float]) -> float:
        return max(values) / min(values) - 1.0 if values and min(values) > 0 else 0.0

    ratio = statistics.median(after) / statistics.median(before)
    return {
        "throughput_after_over_before": round(ratio, 4),
        "throughput_before_tok_s": [round(v, 2) for v in before],
        "throughput_after_tok_s": [round(v, 2) for v in after],
        "throughput_noise": {
            "before_spread": round(spread(before), 4),
            "after_spread": round(spread(after), 4),
        },
    }


def header(
    target: str, setup: RejoinSetup, victim: int, in_flight: int, pause: tuple[float, float]
) -> dict[str, Any]:
    """The result's first fields, alike for every target: what ran, and the pause
    (``pause_caused``'s longest and typical gaps)."""
    return {
        "target": target,
        "dp": setup.dp,
        "victim": victim,
        "policy": setup.policy,
        "streams": setup.streams,
        "stream_tokens": setup.stream_tokens,
        "streams_in_flight_at_admission": in_flight,
        "rejoin_pause_s": round(pause[0], 4),
        "typical_chunk_gap_s": round(pause[1], 4),
    }
