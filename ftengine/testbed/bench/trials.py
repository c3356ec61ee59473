"""The recovery benchmark's measurements on a live cluster: detection latency of a SIGKILLed
or SIGSTOPped rank, scale-down interruption (fault to first correct token), retry time,
full restart (with the checkpoint in the page cache, or evicted from it first: cold), and
steady-state step time. Times are ``time.monotonic`` seconds.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs

from ftengine.errors import FTEngineError
from ftengine.faults import HealthStatus
from ftengine.testbed.bench.page_cache import cached_fraction, evict
from ftengine.testbed.bench.protocol import BenchCluster, GenerationLike
from ftengine.testbed.bench.traffic import TrafficStream
from ftengine.testbed.bench.waits import wait_until
from ftengine.testbed.control.snapshot import ClusterView, Episode


class BenchError(FTEngineError, RuntimeError):
    """A benchmark step did not reach the state it waits for (names what and how long)."""


@attrs.frozen
class Trial:
    """One injected rank failure. ``detect_s``: fault to every survivor UNHEALTHY;
    ``interruption_s``: fault to the first correct token after the scale-down (None when
    the trial only measured detection); repair figures sum the survivors' reports."""

    kind: str  # "sigkill" | "sigstop"
    victim: int
    survivors: tuple[int, ...]
    fault_at: float
    detect_s: float
    detected_at: float
    recovered_at: float | None = None
    interruption_s: float | None = None
    reloads: int = 0
    reload_lower_bound: int = 0
    bytes_reloaded: int = 0
    outputs_match: bool | None = None


def _episodes_since(view: ClusterView, ranks: Sequence[int], since: float) -> list[Episode]:
    episodes = [view.engine(rank).episode for rank in ranks]
    return [e for e in episodes if e is not None and e.started >= since]


def wait_detected(
    cluster: BenchCluster, survivors: Sequence[int], since: float, timeout_s: float
) -> float:
    """When the last of ``survivors`` detected a fault that happened at ``since``."""
    view = wait_until(
        cluster,
        lambda v: len(_episodes_since(v, survivors, since)) == len(survivors),
        timeout_s,
    )
    if view is None:
        raise BenchError(f"survivors {list(survivors)} did not detect the fault in {timeout_s}s")
    return max(e.started for e in _episodes_since(view, survivors, since))


def wait_all(
    cluster: BenchCluster, ranks: Sequence[int], status: HealthStatus, timeout_s: float
) -> ClusterView:
    """Wait until every engine in ``ranks`` reports ``status``."""
    view = wait_until(
        cluster, lambda v: all(v.engine(r).status is status for r in ranks), timeout_s
    )
    if view is None:
        raise BenchError(f"engines {list(ranks)} not {status.name} within {timeout_s}s")
    return view


def wait_healthy(cluster: BenchCluster, ranks: Sequence[int], timeout_s: float) -> ClusterView:
    """Wait until every engine in ``ranks`` is HEALTHY."""
    return wait_all(cluster, ranks, HealthStatus.HEALTHY, timeout_s)


def first_correct(stream: TrafficStream, after: float, timeout_s: float) -> float:
    """When the first correct answer to a request sent after ``after`` arrived."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sample = stream.first_correct_after(after)
        if sample is not None:
            return sample.end
        time.sleep(0.005)
    raise BenchError(f"no correct answer within {timeout_s}s of the recovery")


@attrs.frozen
class TrialPlan:
    """How one trial runs: ``scale_down`` False only measures detection (the last rank of a
    chain); ``removed`` are the ranks already scaled away (cumulative)."""

    kind: str
    victim: int
    removed: frozenset[int]
    scale_down: bool
    detect_timeout_s: float
    recover_timeout_s: float = 120.0


def run_trial(
    cluster: BenchCluster,
    stream: TrafficStream,
    plan: TrialPlan,
    check_outputs: Callable[[], bool],
) -> Trial:
    """Fail ``plan.victim`` under ``stream``'s traffic and measure; ``check_outputs()`` runs
    the fixed prompts after recovery and returns True if they match the reference."""
    survivors = tuple(sorted(cluster.live_ranks() - {plan.victim}))
    sig = signal.SIGKILL if plan.kind == "sigkill" else signal.SIGSTOP
    fault_at = time.monotonic()
    cluster.kill(plan.victim, sig)
    detected_at = wait_detected(cluster, survivors, fault_at, plan.detect_timeout_s)
    trial = Trial(plan.kind, plan.victim, survivors, fault_at, detected_at - fault_at, detected_at)
    if not plan.scale_down:
        return trial
    removed = sorted(plan.removed | {plan.victim})
    result = cluster.apply("scale_down", {"removed_dp_ranks": removed}, f"bench-{fault_at:.6f}")
    if not result.success:
        raise BenchError(f"scale_down {removed} failed: {result.reason}")
    view = wait_healthy(cluster, survivors, plan.recover_timeout_s)
    episodes = _episodes_since(view, survivors, fault_at)
    recovered_at = max(e.ended or 0.0 for e in episodes)
    token_at = first_correct(stream, fault_at, plan.recover_timeout_s)
    repairs = [e.repair for e in episodes if e.repair is not None]
    return attrs.evolve(
        trial,
        recovered_at=recovered_at,
        interruption_s=token_at - fault_at,
        reloads=sum(r.reloads for r in repairs),
        reload_lower_bound=max((r.reload_lower_bound for r in repairs), default=0),
        bytes_reloaded=sum(r.bytes_reloaded for r in repairs),
        outputs_match=bool(check_outputs()),
    )


@attrs.frozen
class RetryTrial:
    """An injected transient fault and its retry: ``retry_s`` runs from the command to every
    engine HEALTHY again."""

    detected_at: float
    command_at: float
    healthy_at: float

    @property
    def retry_s(self) -> float:
        return self.healthy_at - self.command_at


def retry_trial(cluster: BenchCluster, timeout_s: float) -> RetryTrial:
    """Wait until traffic trips an injected ``raise`` fault (every engine UNHEALTHY), then
    send ``retry`` and wait until every engine is HEALTHY."""
    ranks = sorted(cluster.live_ranks())
    view = wait_all(cluster, ranks, HealthStatus.UNHEALTHY, timeout_s)
    detected = min(e.started for e in _episodes_since(view, ranks, 0.0))
    command_at = time.monotonic()
    result = cluster.apply("retry", {}, f"bench-retry-{command_at:.6f}")
    if not result.success:
        raise BenchError(f"retry failed: {result.reason}")
    wait_healthy(cluster, ranks, timeout_s)
    return RetryTrial(detected, command_at, time.monotonic())


def step_time_s(cluster: BenchCluster, prompts: Sequence[Sequence[int]], tokens: int) -> float:
    """Seconds per lockstep decode step: one batch of ``prompts`` generating ``tokens``."""
    start = time.monotonic()
    out: Sequence[GenerationLike] = cluster.generate_batch(prompts, tokens)
    if len(out) != len(prompts):
        raise BenchError(f"asked for {len(prompts)} generations, got {len(out)}")
    return (time.monotonic() - start) / tokens


@attrs.frozen
class Restart:
    """One full restart, launch to first token. ``cold``: the checkpoint was evicted from the
    page cache first (as after a real fault, the weights come from disk); ``cached`` is the
    fraction of it still cached after the eviction (None: warm, or unknowable)."""

    seconds: float
    cold: bool
    cached: float | None = None


def timed_restart(
    launch: Callable[[], BenchCluster], probe: list[int], checkpoint: Path, *, cold: bool
) -> tuple[BenchCluster, Restart]:
    """``launch()`` a cluster and generate one token from ``probe``: (cluster, restart)."""
    cached = None
    if cold:
        files = sorted(path for path in checkpoint.iterdir() if path.is_file())
        evict(files)
        cached = cached_fraction(files)
    start = time.monotonic()
    cluster = launch()
    cluster.generate(probe, 1)
    return cluster, Restart(time.monotonic() - start, cold, cached)


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of non-empty ``values``, by linear interpolation."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(values: Sequence[float]) -> Mapping[str, float | int | None]:
    """``{median, p90, max, n}`` (None for each when there are no values)."""
    if not values:
        return {"median": None, "p90": None, "max": None, "n": 0}
    return {
        "median": quantile(values, 0.5),
        "p90": quantile(values, 0.9),
        "max": max(values),
        "n": len(values),
    }


def spread(values: Sequence[float]) -> Mapping[str, float | int | None]:
    """``{min, p10, median, p90, max, n}``: how far repeated measurements scatter."""
    if not values:
        return {"min": None, "p10": None, "median": None, "p90": None, "max": None, "n": 0}
    return {
        "min": min(values),
        "p10": quantile(values, 0.1),
        **summary(values),
    }
