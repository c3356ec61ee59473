"""The invariants a campaign checks after every fault and over every request, as pure
functions of what was recorded, so a planted violation is caught in a unit test.

Per fault: detected within its bound (``op_timeout + 1 s`` for the silent kinds, a stopped
process or a cut link; ``op_timeout`` for the rest, which close sockets or raise); no
engine stuck ``unhealthy``; every ``dead`` engine with a reason; the victims ``dead``; at
most one side of a cut serving. Per request: a completed stream is the reference token for
token, one token per chunk; a partial one is a prefix of it; one that did not complete
ended ``abort``/``error`` with a reason (else it is lost)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import attrs

from ftengine.testbed.chaos.catalogue import RANKS_LOST, SILENT_KINDS, ChaosKind, When
from ftengine.testbed.chaos.traffic import StreamRecord


@attrs.frozen
class Violation:
    """One invariant that did not hold: which, for which fault (index, kind, the cluster
    step it landed at), what was seen, and the history around it."""

    invariant: str
    fault: int | None
    kind: str | None
    step: int | None
    detail: str
    excerpt: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class FaultResult:
    """What one fault did, as the campaign measured it (times in seconds from injection)."""

    index: int
    kind: ChaosKind
    when: When
    step: int
    victims: tuple[int, ...]
    detect_s: float | None
    recover_s: float | None
    outcome: str  # settled | dead | stuck
    engines: tuple[dict[str, Any], ...]
    both_sides_served: bool = False


def detection_bound(kind: ChaosKind, op_timeout_s: float) -> float:
    """Seconds within which ``kind`` must be detected."""
    return op_timeout_s + 1.0 if kind in SILENT_KINDS else op_timeout_s


def check_fault(result: FaultResult, op_timeout_s: float) -> list[str]:
    """The invariants ``result`` violates, each as ``name: detail``."""
    problems = []
    bound = detection_bound(result.kind, op_timeout_s)
    if result.detect_s is None:
        # A fault landing during another's recovery may be absorbed into that episode.
        if result.when is When.STEADY:
            problems.append(f"detection: not detected (bound {bound:.1f} s)")
    elif result.detect_s > bound:
        problems.append(f"detection: {result.detect_s:.3f} s > bound {bound:.1f} s")
    if result.outcome == "stuck":
        problems.append("stuck_unhealthy: recovery neither settled nor ended dead")
    for engine in result.engines:
        if engine["status"] == "unhealthy" and result.outcome != "stuck":
            problems.append(f"stuck_unhealthy: engine {engine['id']} unhealthy at the end")
        if engine["status"] == "dead" and not (engine.get("ft_error") or engine.get("fault_info")):
            problems.append(f"dead_without_reason: engine {engine['id']}")
    by_id = {e["id"]: e for e in result.engines}
    if RANKS_LOST[result.kind]:  # (a step exception or a poison request kills no one)
        alive = [v for v in result.victims if by_id.get(v, {}).get("status") != "dead"]
        if alive:
            problems.append(f"victims_dead: victims {alive} are not dead")
    if result.both_sides_served:
        problems.append("split_brain: both sides of the cut served")
    return problems


def refused(record: StreamRecord) -> bool:
    """Turned away before it started, with a reason: a 503 naming why the cluster is not
    serving (an engine ended DEAD and the campaign has not rebuilt yet)."""
    return bool(record.error and record.error.startswith("HTTP 503: ") and not record.chunks)


def answered(record: StreamRecord) -> bool:
    """The request got its whole answer: it ran to its token limit with no error."""
    return record.finish_reason == "length" and record.error is None


@attrs.frozen
class RequestTally:
    """Every request's verdict, counted."""

    completed: int = 0
    lost: int = 0
    aborted_with_reason: int = 0
    refused: int = 0
    wrong_tokens: int = 0
    gaps_or_repeats: int = 0
    answered_after_refusal: int = 0  # completed once asked again (a 503 or no server first)
    resumed_after_cut: int = 0  # completed on another server after its connection broke

    def fields(self) -> dict[str, int]:
        """The counts as a campaign's JSON names them."""
        return {
            "requests_completed": self.completed,
            "requests_answered_after_refusal": self.answered_after_refusal,
            "requests_resumed_after_cut": self.resumed_after_cut,
            "requests_lost": self.lost,
            "requests_aborted_with_reason": self.aborted_with_reason,
            "requests_refused_503": self.refused,
            "wrong_tokens": self.wrong_tokens,
            "stream_gaps_or_repeats": self.gaps_or_repeats,
        }


def check_request(record: StreamRecord, reference: Sequence[int], max_tokens: int) -> list[str]:
    """The invariants one stream violates, each as ``name: detail``."""
    tokens, problems = record.tokens, []
    want = list(reference[:max_tokens])
    if answered(record):
        if tokens != want:
            problems.append(f"wrong_tokens: got {tokens}, reference {want}")
        if len(tokens) != len(want) or any(len(c) > 1 for c in record.chunks):
            problems.append(f"stream_gaps_or_repeats: chunks {record.chunks}")
        return problems
    if tokens != want[: len(tokens)]:
        problems.append(f"wrong_tokens: partial {tokens} is no prefix of {want}")
    if record.finish_reason in ("abort", "error") and record.stop_reason:
        return problems
    if refused(record):
        return problems
    return [*problems, f"lost: ended {record.finish_reason!r} error {record.error!r}"]


def tally(records: Sequence[StreamRecord], verdicts: Sequence[list[str]]) -> RequestTally:
    """Count completed, lost, aborted-with-reason, wrong and gapped requests."""
    counts = {"completed": 0, "lost": 0, "aborted_with_reason": 0, "refused": 0}
    wrong = gaps = after_refusal = after_cut = 0
    for record, problems in zip(records, verdicts, strict=True):
        names = {p.split(":", 1)[0] for p in problems}
        wrong += "wrong_tokens" in names
        gaps += "stream_gaps_or_repeats" in names
        if "lost" in names:
            counts["lost"] += 1
        elif answered(record):
            counts["completed"] += 1
            after_refusal += record.refusals > 0
            after_cut += record.resumes > 0
        elif refused(record):
            counts["refused"] += 1
        else:
            counts["aborted_with_reason"] += 1
    return RequestTally(
        wrong_tokens=wrong, gaps_or_repeats=gaps, answered_after_refusal=after_refusal,
        resumed_after_cut=after_cut, **counts,
    )  # fmt: skip


def fault_at(starts: Sequence[float], indices: Sequence[int], at: float) -> int | None:
    """The fault injected last before monotonic ``at`` (``starts`` ascending), if any."""
    position = bisect.bisect_right(list(starts), at) - 1
    return indices[position] if position >= 0 else None
