"""Run one campaign end to end: the fault-free reference, the campaign, the census of
leftovers after everything stopped, the summary and the plot."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftengine.testbed.chaos.campaign import Campaign, CampaignOptions
from ftengine.testbed.chaos.interrupt import run_until_interrupted
from ftengine.testbed.chaos.report import plot as draw
from ftengine.testbed.chaos.report import summary
from ftengine.testbed.chaos.traffic import PROMPTS
from ftengine.testbed.cluster import reference_generate


def run_campaign(
    options: CampaignOptions,
    checkpoint: Path,
    progress: Callable[[str], None],
    *,
    plot: Path | None = None,
) -> dict[str, Any]:
    """The campaign's JSON object (``plot``: also draw its timings there)."""
    started = time.monotonic()
    reference = [
        list(g.token_ids) for g in reference_generate(checkpoint, PROMPTS, options.max_tokens)
    ]
    campaign = Campaign(options, checkpoint, progress)
    leftovers = run_until_interrupted(campaign, progress)
    report = summary(campaign, reference, leftovers, time.monotonic() - started)
    if plot is not None:
        draw(campaign, plot)
    return report
