"""Fault-tolerance overhead: steady-state step time of a cluster with fault tolerance on vs the
same checkpoint on a cluster with it off (``ClusterConfig(fault_tolerance=False)``).

Both clusters stay up and are measured in interleaved rounds (which one goes first
alternates) so that drift in the machine's load lands on both; the ratio of the medians is
the estimate and the per-round ratios show the noise. While one cluster runs, the other
idles; the CPU its workers burn meanwhile is measured, because the idle FT-on cluster's
heartbeats and engine polls fall on the FT-off rounds (the idle FT-off cluster burns none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs
import psutil

from ftengine.control.bench_trials import BenchCluster, quantile, spread, step_time_s


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
    """Seconds per decode step of each round, FT on and off (round ``i`` of each is a pair);
    ``idle_cores`` is the CPU (in cores) the *other* cluster's workers used during each
    side's rounds."""

    on_s: tuple[float, ...]
    off_s: tuple[float, ...]
    idle_cores: Mapping[str, float]

    @property
    def ratio(self) -> float:
        """Median FT-on step time over median FT-off step time."""
        return quantile(self.on_s, 0.5) / quantile(self.off_s, 0.5)

    def to_dict(self) -> dict[str, object]:
        """The benchmark's JSON fields."""
        paired = [on / off for on, off in zip(self.on_s, self.off_s, strict=True)]
        return {
            "ft_overhead_ratio": self.ratio,
            "ft_overhead_round_ratios": spread(paired),
            "step_time_ft_on_s": spread(self.on_s),
            "step_time_ft_off_s": spread(self.off_s),
            "ft_overhead_idle_cores": dict(self.idle_cores),
        }


StepTime = Callable[[BenchCluster, Sequence[Sequence[int]], int], float]
"""``step_time(cluster, prompts, tokens)``: seconds per decode step of one round."""


def interleaved_rounds(
    on: BenchCluster,
    off: BenchCluster,
    prompts: Sequence[Sequence[int]],
    tokens: int,
    rounds: int,
    *,
    cpu: Callable[[Iterable[int | None]], float] = cpu_seconds,
    step_time: StepTime = step_time_s,
) -> OverheadRounds:
    """One warm-up round each, then ``rounds`` pairs of rounds of ``tokens`` decode steps
    over ``prompts``, alternating which cluster goes first."""
    clusters = {"on": on, "off": off}
    for cluster in clusters.values():
        step_time(cluster, prompts, tokens)
    times: dict[str, list[float]] = {"on": [], "off": []}
    idle_cpu = {"on": 0.0, "off": 0.0}
    for index in range(rounds):
        for name in ("on", "off") if index % 2 == 0 else ("off", "on"):
            other = clusters["off" if name == "on" else "on"].pids().values()
            before = cpu(other)
            times[name].append(step_time(clusters[name], prompts, tokens))
            idle_cpu[name] += cpu(other) - before
    seconds = {name: sum(values) * tokens for name, values in times.items()}
    idle = {
        "ft_on_idle_during_off_rounds": idle_cpu["off"] / max(seconds["off"], 1e-9),
        "ft_off_idle_during_on_rounds": idle_cpu["on"] / max(seconds["on"], 1e-9),
    }
    return OverheadRounds(tuple(times["on"]), tuple(times["off"]), idle)
