"""The campaign's report: the JSON summary (counts, per-kind detection and recovery
statistics, every violation with its history excerpt) and the optional plot."""

from __future__ import annotations

import collections
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ftengine.testbed.chaos.campaign import PROMPTS, Campaign
from ftengine.testbed.chaos.deployment import Leftovers
from ftengine.testbed.chaos.invariants import Violation, check_request, fault_at, tally

NOT_COVERED = {
    "net_cut": "not injected: this cluster mode runs every worker in the root network "
    "namespace (run with --netns for hosts in network namespaces), so a link cannot be cut alone"
}


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


def request_violations(campaign: Campaign, reference: Sequence[Sequence[int]]) -> tuple[Any, ...]:
    """Check every stream; returns the tally and the violations (blamed on the fault
    injected last before the stream ended)."""
    records = list(campaign.traffic.records)
    verdicts = [check_request(r, reference[r.prompt], campaign.options.max_tokens) for r in records]
    starts = [i.at for i in campaign.injections]
    order = sorted(range(len(starts)), key=starts.__getitem__)
    starts_sorted = [starts[i] for i in order]
    indices = [campaign.injections[i].fault.index for i in order]
    kinds = {f.index: f.kind.value for f in campaign.plan}
    violations = []
    for record, problems in zip(records, verdicts, strict=True):
        for problem in problems:
            name, _, detail = problem.partition(": ")
            ended = record.ended if record.ended is not None else record.started
            blamed = fault_at(starts_sorted, indices, ended)
            kind = None if blamed is None else kinds[blamed]
            excerpt = tuple(campaign.history.excerpt(record.started - 1.0, ended + 1.0))
            violations.append(Violation(name, blamed, kind, None, detail, excerpt))
    return tally(records, verdicts), violations, records


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


def summary(
    campaign: Campaign, reference: Sequence[Sequence[int]], leftovers: Leftovers, duration_s: float
) -> dict[str, Any]:
    """The campaign's JSON object."""
    counts, request_problems, records = request_violations(campaign, reference)
    violations = run_violations(
        [*campaign.violations, *request_problems], campaign.error, leftovers, campaign.rss_ratios
    )
    ratio = max(campaign.rss_ratios, default=None)
    names = collections.Counter(v.invariant for v in violations)
    hang_entries = [e for e in campaign.history.entries() if e.what in ("hang", "command_stuck")]
    unfinished = sum(1 for r in records if r.ended is None)
    return {
        "faults_injected": len(campaign.results),
        "faults_planned": len(campaign.plan),
        "only": None if campaign.options.only is None else list(campaign.options.only),
        "interrupted": campaign.interrupted.is_set(),
        **fault_counts(campaign.results),
        "hangs": names["stuck_unhealthy"] + len(hang_entries) + unfinished,
        "stuck_unhealthy": names["stuck_unhealthy"],
        "split_brain": names["split_brain"],
        **counts.fields(),
        "orphans": leftovers.count,
        "orphan_detail": leftovers.to_dict(),
        "rss_growth_ratio": None if ratio is None else round(ratio, 4),
        "max_recoveries_per_deployment": max(campaign.recoveries_per_deployment, default=0),
        "detect_s": by_kind(campaign.results, "detect_s"),
        "recover_s": by_kind(campaign.results, "recover_s"),
        "outcomes": dict(collections.Counter(r.outcome for r in campaign.results)),
        "rebuilds": campaign.rebuilds,
        "unplanned_faults": campaign.unplanned,
        "violations": [v.to_dict() for v in violations],
        **_about(campaign, duration_s),
    }


def _about(campaign: Campaign, duration_s: float) -> dict[str, Any]:
    """What ran: the mode, the sizes, the time it took and the plan."""
    return {
        "not_covered": {} if campaign.options.netns else NOT_COVERED,
        "netns": campaign.options.netns,
        "seed": campaign.options.seed,
        "policy": campaign.options.policy,
        "dp_size": campaign.options.dp_size,
        "clients": campaign.options.clients,
        "prompts": len(PROMPTS),
        "duration_s": round(duration_s, 1),
        "plan": [f.describe() for f in campaign.plan],
    }


def plot(campaign: Campaign, path: Path) -> None:
    """Detection and recovery time of every fault, by fault number, coloured by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    kinds = sorted({r.kind.value for r in campaign.results})
    for kind in kinds:
        rows = [r for r in campaign.results if r.kind.value == kind]
        for axis, field in zip(axes, ("detect_s", "recover_s"), strict=True):
            points = [(r.index, getattr(r, field)) for r in rows if getattr(r, field) is not None]
            axis.scatter([p[0] for p in points], [p[1] for p in points], s=14, label=kind)
    axes[0].axhline(campaign.options.op_timeout_s + 1.0, color="grey", ls="--", lw=0.8)
    axes[0].set_ylabel("detection (s)")
    axes[1].set_ylabel("recovery (s)")
    axes[1].set_xlabel("fault number")
    axes[0].legend(fontsize=7, ncol=4)
    fig.suptitle(f"ftengine chaos: {len(campaign.results)} faults, seed {campaign.options.seed}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
