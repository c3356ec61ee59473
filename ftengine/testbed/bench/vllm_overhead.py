"""The FT overhead inside real vLLM, measured so that it means something on a shared machine.

Two methods. ``alternating`` (the default): one deployment at a time, FT on and FT off
launched by turns (on, off, off, on, on, off, ...: a drift over the run falls on both sides
alike), each launch warmed up and then measured in ``rounds`` completions whose median is
the launch's figure; the ratio is of the medians of the launches' figures, and the noise
beside it the same ratio between one mode's earlier and later launches. No two deployments
share the two cores, which made the side-by-side method's noise larger than what it
measures. ``interleaved`` (side by side): an FT-on and an FT-off deployment run at once and
are measured in interleaved rounds (which one goes first alternates). Each round times one
greedy completion per side: wall seconds per token, and the user + system CPU seconds per
token of that deployment's engine cores and workers (psutil), which other jobs' contention
hardly changes (they slow a process down, they do not make it execute more). Beside each
ratio FT on / off stands the method's own noise: the same ratio between the even and the odd
rounds of one mode, which should be 1.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Sequence

import attrs

from ftengine.testbed.vllm.launcher import VllmDeployment

TARGET_RATIO = 1.01
ROLES = ("engine_core", "worker")  # the processes that run the model steps


@attrs.frozen
class Sample:
    """One round of one deployment: wall and CPU seconds per generated token;
    ``cpu_step_s``: the CPU clock's step per token (one clock tick over the tokens): CPU
    figures closer than that cannot be told apart."""

    wall_s: float
    cpu_s: float
    cpu_step_s: float = 0.0


CPU_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")  # the kernel's unit for a process's CPU times


def engine_pids(deployment: VllmDeployment) -> list[int]:
    """The engine-core and worker pids of every rank (the API servers only relay)."""
    return [pid for rank in deployment.pids().values() for r, pid in rank.items() if r in ROLES]


def measure(deployment: VllmDeployment, complete: Callable[[], int]) -> Sample:
    """Run ``complete`` (one completion; returns the tokens generated) and time it."""
    from ftengine.testbed.bench.overhead import cpu_seconds

    pids = engine_pids(deployment)
    cpu_before, start = cpu_seconds(pids), time.perf_counter()
    tokens = complete()
    wall = time.perf_counter() - start
    return Sample(wall / tokens, (cpu_seconds(pids) - cpu_before) / tokens, CPU_TICK_S / tokens)


def interleaved(
    run_on: Callable[[], Sample], run_off: Callable[[], Sample], rounds: int
) -> tuple[list[Sample], list[Sample]]:
    """One warm-up each, then ``rounds`` rounds of one sample per side; FT on goes first in
    even rounds, FT off in odd ones."""
    run_on(), run_off()
    on: list[Sample] = []
    off: list[Sample] = []
    for index in range(rounds):
        sides = [(run_on, on), (run_off, off)]
        for run, into in sides if index % 2 == 0 else sides[::-1]:
            into.append(run())
    return on, off


def alternating(
    launch: Callable[[bool, int], contextlib.AbstractContextManager[Callable[[], Sample]]],
    launches: int,
    rounds: int,
    progress: Callable[[str], None] = lambda _: None,
) -> tuple[list[Sample], list[Sample]]:
    """``launches`` launches per side, one deployment at a time, in ABBA order;
    ``launch(ft, index)`` starts one and yields its sampler. Each launch: one warm-up sample,
    then ``rounds`` samples; its figure is their median (wall and CPU apart). The figures of
    the FT-on launches and of the FT-off ones, in launch order."""
    if launches < 2 or rounds < 1:
        raise ValueError(f"need >= 2 launches per side and >= 1 round, found {launches}, {rounds}")
    on: list[Sample] = []
    off: list[Sample] = []
    order = [(index // 2) % 2 == index % 2 for index in range(2 * launches)]  # on off off on
    for index, ft in enumerate(order):
        with launch(ft, index) as sample:
            sample()
            taken = [sample() for _ in range(rounds)]
        figure = Sample(
            statistics.median(s.wall_s for s in taken),
            statistics.median(s.cpu_s for s in taken),
            max(s.cpu_step_s for s in taken),
        )
        (on if ft else off).append(figure)
        progress(
            f"launch {index + 1}/{2 * launches} (FT {'on' if ft else 'off'}): "
            f"{figure.wall_s * 1000:.2f} ms wall, {figure.cpu_s * 1000:.2f} ms CPU per token"
        )
    return on, off


def _noise(values: Sequence[float]) -> float:
    """Median of the even rounds over median of the odd rounds: a same-mode ratio."""
    return statistics.median(values[0::2]) / statistics.median(values[1::2])


NOISE_LIMIT = 0.01  # the method's own noise must stay under 1 % for a verdict of <= 1.01


def verdict(ratio: float, noise: Sequence[float], resolution: float = 0.0) -> str:
    """Which target holds: ``<= 1.01`` shown (the same-mode noise and the measure's
    ``resolution``, relative, both under 1 %), or not shown because either is larger, or
    within that noise, or not met."""
    same = max(abs(n - 1) for n in noise)
    spread = max(same, resolution)
    said = f"same-mode noise {same:.1%}" + (f", resolution {resolution:.1%}" if resolution else "")
    if ratio <= TARGET_RATIO and spread <= NOISE_LIMIT:
        return f"met: <= 1.01 ({said})"
    if ratio <= TARGET_RATIO:
        return f"not shown: <= 1.01, but {said} (> 1 %)"
    if abs(ratio - 1) <= spread:
        return f"within measured noise (not shown <= 1.01; {said})"
    return "not met: above 1.01 and outside the same-mode noise"


def compare(
    on: Sequence[float], off: Sequence[float], resolution_s: float = 0.0
) -> dict[str, object]:
    """Ratio of medians FT on / off, the same-mode noise of each side, the verdict; beside
    them ``ratio_p10``, of the 10 % quantiles: the least contended rounds (the machine's
    other jobs only add time, and CPU too: a rank waiting in a collective for a descheduled
    peer spins), so the likelier figure of what FT itself costs on a loaded machine.
    ``resolution_s``: the smallest step the measure shows (``resolution``: relative to FT
    off's median), as much a floor on what the ratio can show as the noise."""
    from ftengine.testbed.bench.trials import quantile, spread

    ratio = statistics.median(on) / statistics.median(off)
    noise = {"on": _noise(on), "off": _noise(off)}
    resolution = resolution_s / statistics.median(off)
    return {
        "ratio": ratio,
        "ratio_p10": quantile(on, 0.1) / quantile(off, 0.1),
        "same_mode_ratio": noise,
        "same_mode_spread": {"on": max(on) / min(on), "off": max(off) / min(off)},
        "per_token_on_s": spread(on),
        "per_token_off_s": spread(off),
        "resolution": resolution,
        "verdict": verdict(ratio, list(noise.values()), resolution),
    }


def overhead(
    on: Sequence[Sample], off: Sequence[Sample], method: str = "interleaved"
) -> dict[str, object]:
    """The benchmark's ``ft_overhead_ratio``: wall time and CPU time per token, compared
    (``on`` and ``off``: rounds side by side, or launches' figures when ``alternating``)."""
    if len(on) < 2 or len(off) < 2:
        raise ValueError(f"need >= 2 samples per side, found {len(on)} on, {len(off)} off")
    return {
        "method": method,
        "rounds" if method == "interleaved" else "launches": len(on),
        "wall": compare([s.wall_s for s in on], [s.wall_s for s in off]),
        "cpu": compare(
            [s.cpu_s for s in on],
            [s.cpu_s for s in off],
            max(s.cpu_step_s for s in (*on, *off)),
        ),
    }
