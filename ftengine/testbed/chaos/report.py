"""The campaign's report, on any target: the JSON summary (the keys every target shares:
counts, per-kind detection and recovery statistics, every violation with its history
excerpt; then the target's own), and the optional plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftengine.testbed.chaos.campaign import Campaign
from ftengine.testbed.chaos.catalogue import ChaosKind
from ftengine.testbed.chaos.census import Leftovers
from ftengine.testbed.chaos.findings import summary_fields
from ftengine.testbed.chaos.invariants import check_request
from ftengine.testbed.chaos.timeline import timeline


def summary(campaign: Campaign, leftovers: Leftovers, duration_s: float) -> dict[str, Any]:
    """The campaign's JSON object."""
    records = campaign.records()
    return {
        **summary_fields(campaign, records, _verdicts(campaign), leftovers),
        **campaign.target.about(campaign),
        "duration_s": round(duration_s, 1),
        "plan": [f.describe() for f in campaign.plan],
    }


def _verdicts(campaign: Campaign) -> list[list[str]] | None:
    """Every stream's problems against the reference, as the target counts them (None: no
    reference, the first deployment never served)."""
    want, target = campaign.reference, campaign.target
    if not want:
        return None
    return [
        target.verdict(r, check_request(r, want[r.prompt], target.bench.max_tokens))
        for r in campaign.records()
    ]


def plot(campaign: Campaign, path: Path, seed: int) -> None:
    """Throughput and faults over time (``timeline``): the tokens streamed per second with a
    line at each fault's injection, coloured by kind; below, each fault's detection and
    recovery time at its injection (the dashed line: a stopped worker's detection bound)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = campaign.history
    line = timeline(history.entries(), campaign.records(), campaign.found.results, history.origin)
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    bins = [(i + 0.5) * line.bin_s for i in range(len(line.tokens_per_s))]
    axes[0].plot(bins, line.tokens_per_s, color="black", lw=1.0)
    kinds = sorted({mark.kind for mark in line.faults})
    palette = plt.get_cmap("tab10")
    colours = {kind: palette(i % 10) for i, kind in enumerate(kinds)}
    for mark in line.faults:
        axes[0].axvline(mark.at_s, color=colours[mark.kind], lw=0.8, alpha=0.7)
    for kind in kinds:
        marks = [m for m in line.faults if m.kind == kind]
        for axis, field in zip(axes[1:], ("detect_s", "recover_s"), strict=True):
            points = [(m.at_s, getattr(m, field)) for m in marks if getattr(m, field) is not None]
            axis.scatter([p[0] for p in points], [p[1] for p in points], s=14,
                         color=colours[kind], label=kind)  # fmt: skip
    axes[1].axhline(
        campaign.target.detection_bound(ChaosKind.SIGSTOP), color="grey", ls="--", lw=0.8
    )
    axes[0].set_ylabel(f"tokens / s ({line.bin_s:.0f} s bins)")
    axes[1].set_ylabel("detection (s)")
    axes[2].set_ylabel("recovery (s)")
    axes[2].set_xlabel("seconds from the campaign's start")
    axes[1].legend(fontsize=7, ncol=5)
    fig.suptitle(f"ftengine chaos: {len(campaign.found.results)} faults, seed {seed}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
