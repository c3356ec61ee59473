"""The campaign's report: the JSON summary (counts, per-kind detection and recovery
statistics, every violation with its history excerpt) and the optional plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ftengine.testbed.chaos.campaign import Campaign
from ftengine.testbed.chaos.census import Leftovers
from ftengine.testbed.chaos.findings import summary_fields
from ftengine.testbed.chaos.invariants import check_request
from ftengine.testbed.chaos.traffic import PROMPTS

NOT_COVERED = {
    "net_cut": "not injected: this cluster mode runs every worker in the root network "
    "namespace (run with --netns for hosts in network namespaces), so a link cannot be cut alone"
}


def summary(
    campaign: Campaign, reference: Sequence[Sequence[int]], leftovers: Leftovers, duration_s: float
) -> dict[str, Any]:
    """The campaign's JSON object."""
    records = list(campaign.traffic.records)
    limit = campaign.options.max_tokens
    verdicts = [check_request(r, reference[r.prompt], limit) for r in records]
    return {
        **summary_fields(campaign, records, verdicts, leftovers),
        "only": None if campaign.options.only is None else list(campaign.options.only),
        "unplanned_faults": campaign.unplanned,
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

    results = campaign.found.results
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    kinds = sorted({r.kind.value for r in results})
    for kind in kinds:
        rows = [r for r in results if r.kind.value == kind]
        for axis, field in zip(axes, ("detect_s", "recover_s"), strict=True):
            points = [(r.index, getattr(r, field)) for r in rows if getattr(r, field) is not None]
            axis.scatter([p[0] for p in points], [p[1] for p in points], s=14, label=kind)
    axes[0].axhline(campaign.options.op_timeout_s + 1.0, color="grey", ls="--", lw=0.8)
    axes[0].set_ylabel("detection (s)")
    axes[1].set_ylabel("recovery (s)")
    axes[1].set_xlabel("fault number")
    axes[0].legend(fontsize=7, ncol=4)
    fig.suptitle(f"ftengine chaos: {len(results)} faults, seed {campaign.options.seed}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
