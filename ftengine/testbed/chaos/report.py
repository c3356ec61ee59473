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
    """Detection and recovery time of every fault, by fault number, coloured by kind (the
    dashed line: the detection bound of a stopped worker)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = campaign.found.results
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    kinds = sorted({r.kind.value for r in results})
    for kind in kinds:
        rows = [r for r in results if r.kind.value == kind]
        for axis, field in zip(axes, ("detect_s", "recover_s"), strict=True):
            points = [(r.index, getattr(r, field)) for r in rows if getattr(r, field) is not None]
            axis.scatter([p[0] for p in points], [p[1] for p in points], s=14, label=kind)
    bound = campaign.target.detection_bound(ChaosKind.SIGSTOP)
    axes[0].axhline(bound, color="grey", ls="--", lw=0.8)
    axes[0].set_ylabel("detection (s)")
    axes[1].set_ylabel("recovery (s)")
    axes[1].set_xlabel("fault number")
    axes[0].legend(fontsize=7, ncol=4)
    fig.suptitle(f"ftengine chaos: {len(results)} faults, seed {seed}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
