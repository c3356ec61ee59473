"""Run one campaign end to end: the fault-free reference, the campaign, the census of
leftovers after everything stopped, the summary and the plot."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from ftengine.chaos.campaign import PROMPTS, Campaign, CampaignOptions
from ftengine.chaos.report import plot as draw
from ftengine.chaos.report import summary
from ftengine.cluster import reference_generate


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

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        progress(f"signal {signum}: no more faults; ending the campaign cleanly")
        campaign.interrupted.set()

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        campaign.run()
    except Exception as exc:  # reported with everything measured so far, never lost
        progress(f"campaign ended early: {exc!r}")
        campaign.error = f"{type(exc).__name__}: {exc}"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        leftovers = campaign.census.leftovers()
    report = summary(campaign, reference, leftovers, time.monotonic() - started)
    if plot is not None:
        draw(campaign, plot)
    return report
