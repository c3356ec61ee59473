"""Run one campaign end to end on any target: the campaign (SIGINT / SIGTERM: no more
faults, report what ran), the census of leftovers after everything stopped, the summary
and the plot."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftengine.testbed.chaos.campaign import Campaign
from ftengine.testbed.chaos.interrupt import run_until_interrupted
from ftengine.testbed.chaos.report import plot as draw
from ftengine.testbed.chaos.report import summary
from ftengine.testbed.chaos.target import Target


def run_campaign(
    target: Target,
    progress: Callable[[str], None],
    *,
    plot: Path | None = None,
) -> dict[str, Any]:
    """The campaign's JSON object (``plot``: also draw its timings there)."""
    started = time.monotonic()
    campaign = Campaign(target, progress)
    leftovers = run_until_interrupted(campaign, progress)
    report = summary(campaign, leftovers, time.monotonic() - started)
    if plot is not None:
        draw(campaign, plot, report["seed"])
    return report
