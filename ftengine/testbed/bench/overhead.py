"""Fault-tolerance overhead: steady-state step time of a cluster with fault tolerance on vs the
same checkpoint on a cluster with it off (``ClusterConfig(fault_tolerance=False)``).

All clusters stay up and are measured in interleaved rounds (which one goes first rotates)
so that drift in the machine's load lands on every one; the ratio of the medians is the
estimate and the per-round ratios show the noise. Two launches of the same configuration
differ by a few percent on a small shared machine (where their memory landed, which core
their processes share), so each side can have several launches: the medians pool them,
and the same-mode ratios (launch 0 over launch 1 of one side) show that noise beside the
estimate. While one cluster runs, the others idle; the CPU the other side's workers burn
meanwhile is measured, because idle FT-on clusters' heartbeats and engine polls fall on
the FT-off rounds (idle FT-off clusters burn none).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs
import psutil

from ftengine.testbed.bench.protocol import BenchCluster
from ftengine.testbed.bench.trials import quantile, spread, step_time_s


def cpu_seconds(pids: Iterable[int | None]) -> float:
    """User + system CPU seconds used so far by the live processes among ``pids``."""
    total = 0.0
    for pid in pids:
        if pid is None:
            continue
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


@attrs.frozen
class OverheadRounds:
    """Seconds per decode step of each round, per cluster launch, FT on and off (round ``i``
    of every launch is one set); ``idle_cores`` is the CPU (in cores) the other side's
    workers used during each side's rounds."""

    on_s: tuple[tuple[float, ...], ...]
    off_s: tuple[tuple[float, ...], ...]
    idle_cores: Mapping[str, float]

    @property
    def ratio(self) -> float:
        """Median FT-on step time over median FT-off step time, pooled over the launches."""
        return _median(_pooled(self.on_s)) / _median(_pooled(self.off_s))

    def to_dict(self) -> dict[str, object]:
        """The benchmark's JSON fields."""
        rounds = zip(zip(*self.on_s, strict=True), zip(*self.off_s, strict=True), strict=True)
        paired = [_mean(on) / _mean(off) for on, off in rounds]
        return {
            "ft_overhead_ratio": self.ratio,
            "ft_overhead_round_ratios": spread(paired),
            "ft_overhead_launch_ratios": {
                f"on{i}/off{j}": _median(on) / _median(off)
                for i, on in enumerate(self.on_s)
                for j, off in enumerate(self.off_s)
            },
            "ft_overhead_same_mode_ratios": _same_mode(self.on_s, "on")
            | _same_mode(self.off_s, "off"),
            "step_time_ft_on_s": spread(_pooled(self.on_s)),
            "step_time_ft_off_s": spread(_pooled(self.off_s)),
            "ft_overhead_idle_cores": dict(self.idle_cores),
        }


def _pooled(launches: Sequence[Sequence[float]]) -> list[float]:
    return [value for launch in launches for value in launch]


def _median(values: Sequence[float]) -> float:
    return quantile(values, 0.5)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _same_mode(launches: Sequence[Sequence[float]], side: str) -> dict[str, float]:
    """Launch ``i`` over launch ``i + 1`` of the same mode: the method's own noise."""
    return {
        f"{side}{i}/{side}{i + 1}": _median(a) / _median(b)
        for i, (a, b) in enumerate(itertools.pairwise(launches))
    }


StepTime = Callable[[BenchCluster, Sequence[Sequence[int]], int], float]
"""``step_time(cluster, prompts, tokens)``: seconds per decode step of one round."""


def interleaved_rounds(
    on: Sequence[BenchCluster],
    off: Sequence[BenchCluster],
    prompts: Sequence[Sequence[int]],
    tokens: int,
    rounds: int,
    *,
    cpu: Callable[[Iterable[int | None]], float] = cpu_seconds,
    step_time: StepTime = step_time_s,
) -> OverheadRounds:
    """One warm-up round each, then ``rounds`` rounds in which every launch runs ``tokens``
    decode steps over ``prompts``. Launches alternate between the sides (on, off, on, ...)
    and each round starts one launch later, so that no launch always runs first."""
    if not on or not off:
        raise ValueError(f"need at least one cluster per side, got {len(on)} on, {len(off)} off")
    clusters = {"on": list(on), "off": list(off)}
    order = [
        (side, k)
        for k in range(max(len(on), len(off)))
        for side in ("on", "off")
        if k < len(clusters[side])
    ]
    for side, k in order:
        step_time(clusters[side][k], prompts, tokens)
    times: dict[str, list[list[float]]] = {side: [[] for _ in clusters[side]] for side in clusters}
    idle_cpu = {"on": 0.0, "off": 0.0}
    for index in range(rounds):
        shift = index % len(order)
        for side, k in order[shift:] + order[:shift]:
            other = [
                pid for c in clusters["off" if side == "on" else "on"] for pid in c.pids().values()
            ]
            before = cpu(other)
            times[side][k].append(step_time(clusters[side][k], prompts, tokens))
            idle_cpu[side] += cpu(other) - before
    seconds = {side: sum(map(sum, values)) * tokens for side, values in times.items()}
    idle = {
        "ft_on_idle_during_off_rounds": idle_cpu["off"] / max(seconds["off"], 1e-9),
        "ft_off_idle_during_on_rounds": idle_cpu["on"] / max(seconds["on"], 1e-9),
    }
    return OverheadRounds(tuple(map(tuple, times["on"])), tuple(map(tuple, times["off"])), idle)
