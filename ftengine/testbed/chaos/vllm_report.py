"""The real-vLLM campaign's JSON object, with the cluster campaign's keys where they apply
(the same request checks, ``check_request`` / ``tally``, the same ``spread``), and the run:
the campaign, then the census of leftovers once every deployment stopped."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ftengine.testbed.chaos.census import Leftovers
from ftengine.testbed.chaos.findings import spread, summary_fields
from ftengine.testbed.chaos.interrupt import run_until_interrupted
from ftengine.testbed.chaos.invariants import check_request
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


def _verdicts(campaign: VllmCampaign, records: list[StreamRecord]) -> list[list[str]] | None:
    """Every stream checked against the reference, vLLM's coalesced chunks taken out (None:
    no reference, the first deployment never served)."""
    if not campaign.reference:
        return None
    want, limit = campaign.reference, campaign.options.max_tokens
    return [_vllm_verdict(r, check_request(r, want[r.prompt], limit)) for r in records]


def _coalesced(campaign: VllmCampaign, records: list[StreamRecord]) -> int:
    """Completed streams with a chunk of several tokens (see :func:`coalesced`)."""
    if not campaign.reference:
        return 0
    limit = campaign.options.max_tokens
    return sum(coalesced(r, check_request(r, campaign.reference[r.prompt], limit)) for r in records)


def summary(campaign: VllmCampaign, leftovers: Leftovers, duration_s: float) -> dict[str, Any]:
    """The campaign's JSON object."""
    records = campaign.records()
    return {
        **summary_fields(campaign, records, _verdicts(campaign, records), leftovers),
        "streams_coalesced": _coalesced(campaign, records),
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
