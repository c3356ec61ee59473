"""What a campaign found, whichever target it ran on (the CPU cluster or real vLLM): the
violations of each fault and of each stream, those of the run as a whole, and the timing
statistics its report gives per fault kind."""

from __future__ import annotations

import collections
import statistics
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

from ftengine.testbed.chaos.catalogue import Injected, PlannedFault
from ftengine.testbed.chaos.census import Leftovers
from ftengine.testbed.chaos.history import History
from ftengine.testbed.chaos.invariants import FaultResult, Violation, fault_at, tally
from ftengine.testbed.chaos.shares import (
    answered_share,
    by_kind_shares,
    minority_side,
    unanswered_reasons,
)
from ftengine.testbed.chaos.traffic import StreamRecord


@attrs.define
class Findings:
    """What a campaign found as it ran, on either target: every fault's result and
    violations, every injection, and for each deployment that recovered at least once, its
    workers' largest memory growth and its recoveries."""

    results: list[FaultResult] = attrs.field(factory=list)
    violations: list[Violation] = attrs.field(factory=list)
    injections: list[Injected] = attrs.field(factory=list)
    rss_ratios: list[float] = attrs.field(factory=list)
    recoveries_per_deployment: list[int] = attrs.field(factory=list)

    def judged(
        self,
        result: FaultResult,
        injected: Injected,
        step: int | None,
        problems: Sequence[str],
        until: float,
        history: History,
    ) -> None:
        """Fault ``result`` was judged: keep it, and its ``problems`` as violations with the
        history from its injection to the end of its recovery (``until``)."""
        self.results.append(result)
        self.violations += fault_violations(injected, step, problems, until, history)

    def deployment_ended(
        self, rss_start: Mapping[int, int], rss_end: Mapping[int, int], recoveries: int
    ) -> None:
        """A deployment stopped after ``recoveries`` recoveries, its workers' resident sizes
        measured at its first fault (``rss_start``) and now."""
        ratio = rss_ratio(rss_start, rss_end)
        if ratio is not None and recoveries:
            self.rss_ratios.append(ratio)
            self.recoveries_per_deployment.append(recoveries)


class Judged(Protocol):
    """What either campaign keeps as it runs, for :func:`summary_fields`."""

    plan: list[PlannedFault]
    found: Findings
    history: History
    interrupted: threading.Event
    error: str | None

    @property
    def rebuilds(self) -> int: ...


def spread(values: Sequence[float]) -> dict[str, float] | None:
    """``{median, p90, max}`` of ``values`` (seconds, 3 decimals), None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {
        "median": round(statistics.median(ordered), 3),
        "p90": round(p90, 3),
        "max": round(ordered[-1], 3),
    }


def by_kind(results: Sequence[Any], field: str) -> dict[str, dict[str, float] | None]:
    """``spread`` of one timing ``field`` of the fault results, per fault kind."""
    values: dict[str, list[float]] = collections.defaultdict(list)
    for result in results:
        value = getattr(result, field)
        if value is not None:
            values[result.kind.value].append(value)
    return {kind: spread(v) for kind, v in sorted(values.items())}


def fault_counts(results: Sequence[Any]) -> dict[str, Any]:
    """How many faults of each kind ran, and how many during a recovery."""
    return {
        "by_kind": dict(sorted(collections.Counter(r.kind.value for r in results).items())),
        "during_recovery": sum(1 for r in results if r.when.value == "recovery"),
    }


def request_violations(
    records: Sequence[StreamRecord],
    verdicts: Sequence[list[str]],
    injections: Sequence[Injected],
    plan: Sequence[PlannedFault],
    history: History,
) -> list[Violation]:
    """The problems of every stream (``verdicts``, one list per record), each blamed on the
    fault injected last before that stream ended, with the history around the stream."""
    shots = sorted(injections, key=lambda shot: shot.at)
    starts, indices = [s.at for s in shots], [s.fault.index for s in shots]
    kinds = {f.index: f.kind.value for f in plan}
    violations = []
    for record, problems in zip(records, verdicts, strict=True):
        for problem in problems:
            name, _, detail = problem.partition(": ")
            ended = record.ended if record.ended is not None else record.started
            blamed = fault_at(starts, indices, ended)
            kind = None if blamed is None else kinds[blamed]
            excerpt = tuple(history.excerpt(record.started - 1.0, ended + 1.0))
            violations.append(Violation(name, blamed, kind, None, detail, excerpt))
    return violations


def fault_violations(
    injected: Injected, step: int | None, problems: Sequence[str], until: float, history: History
) -> list[Violation]:
    """A judged fault's ``problems`` (``"invariant: detail"``) as violations, with the
    history from just before it was injected to just after its recovery ended (``until``)."""
    fault = injected.fault
    excerpt = tuple(history.excerpt(injected.at - 1.0, until + 1.0))
    violations = []
    for problem in problems:
        name, _, detail = problem.partition(": ")
        violations.append(Violation(name, fault.index, fault.kind.value, step, detail, excerpt))
    return violations


def rss_ratio(start: Mapping[int, int], end: Mapping[int, int]) -> float | None:
    """The largest end / start resident size of the ranks measured at both (None: none)."""
    return max((end[rank] / size for rank, size in start.items() if rank in end), default=None)


def run_violations(
    found: Sequence[Violation],
    error: str | None,
    leftovers: Leftovers,
    rss_ratios: Sequence[float],
) -> list[Violation]:
    """``found`` (per fault, per request) plus those of the run as a whole: an error that
    ended it, leftovers, and survivors' memory growing past 10 %."""
    violations = list(found)
    if error is not None:
        violations.append(Violation("campaign_error", None, None, None, error))
    if leftovers.count:
        violations.append(Violation("orphans", None, None, None, str(leftovers.to_dict())))
    ratio = max(rss_ratios, default=None)
    if ratio is not None and ratio > 1.10:
        violations.append(Violation("rss_growth", None, None, None, f"ratio {ratio:.3f} > 1.10"))
    return violations


def summary_fields(
    campaign: Judged,
    records: Sequence[StreamRecord],
    verdicts: Sequence[list[str]] | None,
    leftovers: Leftovers,
) -> dict[str, Any]:
    """The keys both campaigns' JSON objects share: the faults, the streams (``verdicts``:
    each record's problems; None where there was no reference to check them against), the
    hangs, leftovers, memory, timings, and every violation, per fault, per stream and of the
    run as a whole."""
    found = campaign.found
    checked = records if verdicts is not None else ()
    verdicts = verdicts if verdicts is not None else ()
    request_problems = request_violations(
        checked, verdicts, found.injections, campaign.plan, campaign.history
    )
    violations = run_violations(
        [*found.violations, *request_problems],
        campaign.error,
        leftovers,
        found.rss_ratios,
    )
    ratio = max(found.rss_ratios, default=None)
    names = collections.Counter(v.invariant for v in violations)
    hang_entries = [e for e in campaign.history.entries() if e.what in ("hang", "command_stuck")]
    unfinished = sum(1 for r in records if r.ended is None)
    return {
        "faults_injected": len(found.results),
        "faults_planned": len(campaign.plan),
        "interrupted": campaign.interrupted.is_set(),
        **fault_counts(found.results),
        "hangs": names["stuck_unhealthy"] + names["hang"] + len(hang_entries) + unfinished,
        "stuck_unhealthy": names["stuck_unhealthy"],
        "split_brain": names["split_brain"],
        **tally(checked, verdicts).fields(),
        "requests_answered_share": answered_share(records),
        "requests_ended_by_minority": sum(minority_side(r) for r in records),
        "unanswered_reasons": unanswered_reasons(records),
        "per_kind": by_kind_shares(found.results, records, found.injections),
        "orphans": leftovers.count,
        "orphan_detail": leftovers.to_dict(),
        "rss_growth_ratio": None if ratio is None else round(ratio, 4),
        "max_recoveries_per_deployment": max(found.recoveries_per_deployment, default=0),
        "detect_s": by_kind(found.results, "detect_s"),
        "recover_s": by_kind(found.results, "recover_s"),
        "outcomes": dict(collections.Counter(r.outcome for r in found.results)),
        "rebuilds": campaign.rebuilds,
        "violations": [v.to_dict() for v in violations],
    }
