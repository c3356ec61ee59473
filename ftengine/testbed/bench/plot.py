"""The recovery benchmark's figure: correct tokens per second over time, with the fault,
detection and recovery instants marked (matplotlib, Agg backend, PNG)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from ftengine.testbed.bench.traffic import Sample, tokens_per_second

MARK_STYLE = {
    "fault": ("tab:red", "-"),
    "detected": ("tab:orange", "--"),
    "recovered": ("tab:green", "--"),
    "first token": ("tab:blue", ":"),
}


@attrs.frozen
class Mark:
    """A vertical line at ``at`` (monotonic seconds): ``kind`` is a key of ``MARK_STYLE``."""

    at: float
    kind: str
    label: str = ""


def plot_throughput(
    samples: Sequence[Sample],
    marks: Sequence[Mark],
    path: Path,
    *,
    start: float,
    end: float,
    title: str,
    pauses: Sequence[tuple[float, float]] = (),
    bin_s: float = 0.5,
    unit: str = "tokens",
) -> Path:
    """Draw correct tokens/s in ``bin_s`` bins over [start, end], ``marks`` as vertical lines
    and ``pauses`` (spans when the benchmark itself held the cluster) shaded; save ``path``.
    ``unit`` names what a sample's ``tokens`` count (``completions`` where each is 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = tokens_per_second(samples, start=start, end=end, bin_s=bin_s)
    figure, axes = plt.subplots(figsize=(11, 5), dpi=120)
    times, values = [t for t, _ in rates], [r for _, r in rates]
    axes.step(times, values, where="post", color="black", lw=1.2,
              label=f"correct {unit}/s ({bin_s:g} s bins)")  # fmt: skip
    for index, (begin, finish) in enumerate(pauses):
        label = "reference check (holds the cluster)" if index == 0 else None
        axes.axvspan(begin - start, finish - start, color="0.85", lw=0, label=label)
    _draw_marks(axes, marks, start)
    axes.set_xlabel("seconds")
    axes.set_ylabel(f"correct {unit} / s")
    axes.set_title(title, fontsize=10)
    axes.set_xlim(0, end - start)
    axes.set_ylim(bottom=0)
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=6, fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def _draw_marks(axes: Any, marks: Sequence[Mark], start: float) -> None:
    seen: set[str] = set()
    for mark in marks:
        color, style = MARK_STYLE.get(mark.kind, ("gray", "-."))
        legend = mark.kind if mark.kind not in seen else None
        seen.add(mark.kind)
        axes.axvline(mark.at - start, color=color, linestyle=style, lw=1.0, label=legend)
        if mark.label:
            axes.annotate(
                mark.label,
                (mark.at - start, 0),
                xytext=(2, 4),
                textcoords="offset points",
                rotation=90,
                fontsize=7,
                color=color,
            )
