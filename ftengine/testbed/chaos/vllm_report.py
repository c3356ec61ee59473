"""The real-vLLM campaign's JSON object, with the cluster campaign's keys where they apply
(the same request checks, ``check_request`` / ``tally``, the same ``spread``), and the run:
the campaign, then the census of leftovers once every deployment stopped."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from ftengine.testbed.chaos.census import Leftovers
from ftengine.testbed.chaos.findings import (
    by_kind,
    fault_counts,
    request_violations,
    run_violations,
    spread,
)
from ftengine.testbed.chaos.interrupt import run_until_interrupted
from ftengine.testbed.chaos.invariants import Violation, check_request, tally
from ftengine.testbed.chaos.traffic import StreamRecord
from ftengine.testbed.chaos.vllm_campaign import VllmCampaign
from ftengine.testbed.chaos.vllm_options import VllmCampaignOptions
from ftengine.testbed.chaos.vllm_plan import NOT_COVERED


def coalesced(record: StreamRecord, problems: list[str]) -> bool:
    """A completed stream whose only problem is a chunk of several tokens, the tokens all
    there in order: vLLM's ``RequestOutputCollector`` merges a request's deltas when the
    engine gets ahead of the API server's consumer (a loaded machine), which is no gap and
    no repeat (``wrong_tokens`` checks the whole sequence)."""
    names = {p.split(":", 1)[0] for p in problems}
    done = record.finish_reason == "length" and record.error is None
    return done and names == {"stream_gaps_or_repeats"}


def _vllm_verdict(record: StreamRecord, problems: list[str]) -> list[str]:
    """``check_request``'s verdict, vLLM's coalesced chunks taken out."""
    return [] if coalesced(record, problems) else problems


def _request_violations(
    campaign: VllmCampaign,
) -> tuple[Any, list[Violation], list[StreamRecord]]:
    """Every stream checked against the reference; each problem blamed on the fault injected
    last before that stream ended."""
    records = campaign.records()
    if not campaign.reference:  # no reference: the first deployment never served
        return tally([], []), [], records
    want, limit = campaign.reference, campaign.options.max_tokens
    verdicts = [_vllm_verdict(r, check_request(r, want[r.prompt], limit)) for r in records]
    violations = request_violations(
        records, verdicts, campaign.injections, campaign.plan, campaign.history
    )
    return tally(records, verdicts), violations, records


def _coalesced(campaign: VllmCampaign, records: list[StreamRecord]) -> int:
    """Completed streams with a chunk of several tokens (see :func:`coalesced`)."""
    if not campaign.reference:
        return 0
    limit = campaign.options.max_tokens
    return sum(coalesced(r, check_request(r, campaign.reference[r.prompt], limit)) for r in records)


def _violations(
    campaign: VllmCampaign, request_problems: list[Violation], leftovers: Leftovers
) -> list[Violation]:
    """Every violation: per fault, per request, and of the run as a whole."""
    found = [*campaign.violations, *request_problems]
    return run_violations(found, campaign.error, leftovers, campaign.rss_ratios)


def summary(campaign: VllmCampaign, leftovers: Leftovers, duration_s: float) -> dict[str, Any]:
    """The campaign's JSON object."""
    counts, request_problems, records = _request_violations(campaign)
    violations = _violations(campaign, request_problems, leftovers)
    ratio = max(campaign.rss_ratios, default=None)
    names = collections.Counter(v.invariant for v in violations)
    hangs = [e for e in campaign.history.entries() if e.what in ("hang", "command_stuck")]
    return {
        "faults_injected": len(campaign.results),
        "faults_planned": len(campaign.plan),
        "interrupted": campaign.interrupted.is_set(),
        **fault_counts(campaign.results),
        "hangs": names["stuck_unhealthy"] + len(hangs) + sum(r.ended is None for r in records),
        "stuck_unhealthy": names["stuck_unhealthy"],
        "split_brain": 0,
        **counts.fields(),
        "streams_coalesced": _coalesced(campaign, records),
        "orphans": leftovers.count,
        "orphan_detail": leftovers.to_dict(),
        "rss_growth_ratio": None if ratio is None else round(ratio, 4),
        "max_recoveries_per_deployment": max(campaign.recoveries_per_deployment, default=0),
        "detect_s": by_kind(campaign.results, "detect_s"),
        "recover_s": by_kind(campaign.results, "recover_s"),
        "outcomes": dict(collections.Counter(r.outcome for r in campaign.results)),
        "rebuilds": campaign.rebuilds,
        "violations": [v.to_dict() for v in violations],
        **_about(campaign, duration_s),
    }


def _about(campaign: VllmCampaign, duration_s: float) -> dict[str, Any]:
    """What ran: vLLM's deployment, the sizes, the time it took and the plan."""
    o = campaign.options
    return {
        "not_covered": NOT_COVERED,
        "vllm": True,
        "seed": o.seed,
        "policy": "orchestrator",
        "dp_size": o.dp_size,
        "clients": o.clients,
        "op_timeout_s": o.op_timeout_s,
        "fences": campaign.fences,
        "unplanned_faults": campaign.unplanned,
        "skipped": campaign.skipped,
        "deployment_start_s": spread(campaign.start_s),
        "rebuild_s": spread(campaign.rebuild_s),
        "rebuild_total_s": round(sum(campaign.rebuild_s), 1),
        "duration_s": round(duration_s, 1),
        "plan": [f.describe() for f in campaign.plan],
    }


def run_vllm_campaign(
    options: VllmCampaignOptions, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Run the campaign (SIGINT / SIGTERM: no more faults, report what ran) and report."""
    started = time.monotonic()
    campaign = VllmCampaign(options, progress)
    leftovers = run_until_interrupted(campaign, progress)
    return summary(campaign, leftovers, time.monotonic() - started)
