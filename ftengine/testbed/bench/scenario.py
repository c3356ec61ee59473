"""The demo's scenario, SIGKILL then scale-down, driven end to end on a live cluster: serve,
SIGKILL a rank under traffic, see survivors UNHEALTHY and the victim DEAD, have the DEAD
engine reject retry, scale down, see survivors HEALTHY and answer as the reference does.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping, Sequence

import attrs

from ftengine.errors import FTEngineError
from ftengine.faults import HealthStatus
from ftengine.testbed.bench.breakdown import BreakdownRow, breakdown, interruption_s
from ftengine.testbed.bench.live import Reporter
from ftengine.testbed.bench.protocol import Compare, GenerationLike, ScenarioCluster, Watchable
from ftengine.testbed.bench.traffic import Sample, TrafficStream
from ftengine.testbed.bench.waits import serving_waiter, wait_until
from ftengine.testbed.control.snapshot import ClusterView, Episode

SCENARIO = "sigkill-scale-down"


@attrs.frozen
class Check:
    """One thing the scenario requires; ``detail`` says what was seen."""

    name: str
    ok: bool
    detail: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


@attrs.frozen
class ScenarioSettings:
    """``victim`` is the DP rank killed; ``policy`` the cluster's (``orchestrator``: this
    scenario sends the commands; ``auto``: the engines act alone). Timeouts in seconds."""

    victim: int = 3
    policy: str = "orchestrator"
    max_tokens: int = 8
    warmup_s: float = 1.0
    detect_timeout_s: float = 30.0
    recover_timeout_s: float = 120.0
    first_token_timeout_s: float = 30.0


@attrs.frozen
class ScenarioResult:
    """Everything the demo reports; ``phases`` are each engine's phase changes with ``at``
    in seconds since the demo started."""

    settings: ScenarioSettings
    checks: tuple[Check, ...]
    removed_ranks: tuple[int, ...]
    phases: Mapping[int, Sequence[Mapping[str, object]]]
    rows: tuple[BreakdownRow, ...]
    timings: Mapping[str, float | None]
    outputs: Mapping[str, object]

    @property
    def ok(self) -> bool:
        """True when every check held."""
        return all(check.ok for check in self.checks)

    @property
    def recovered(self) -> bool:
        """Survivors HEALTHY again with the victim removed."""
        return any(c.name == "survivors healthy" and c.ok for c in self.checks)

    @property
    def outputs_match(self) -> bool:
        """Outputs after recovery identical to the reference."""
        return any(c.name == "outputs match after recovery" and c.ok for c in self.checks)

    def to_dict(self) -> dict[str, object]:
        """The ``ftengine demo --json`` object."""
        return {
            "scenario": SCENARIO,
            "policy": self.settings.policy,
            "victim": self.settings.victim,
            "ok": self.ok,
            "recovered": self.recovered,
            "outputs_match": self.outputs_match,
            "removed_ranks": list(self.removed_ranks),
            "phases": {str(rank): list(changes) for rank, changes in self.phases.items()},
            "breakdown": [row.to_dict() for row in self.rows],
            "timings": dict(self.timings),
            "outputs": dict(self.outputs),
            "checks": [check.to_dict() for check in self.checks],
        }


class _Run:
    """One run of the scenario; collects checks as it goes."""

    def __init__(
        self,
        cluster: ScenarioCluster,
        settings: ScenarioSettings,
        reporter: Reporter,
        compare: Compare,
        flush: Callable[[], None],
    ) -> None:
        self.cluster = cluster
        self.settings = settings
        self.reporter = reporter
        self.compare = compare
        self.flush = flush
        self.checks: list[Check] = []
        self.outputs: dict[str, object] = {}

    def note(self, text: str) -> None:
        self.flush()
        self.reporter.note(time.monotonic(), text)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, ok, detail))
        self.note(f"check [{'ok ' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}")
        return ok

    def survivor_episodes(self, view: ClusterView) -> list[Episode]:
        episodes = [view.engine(rank).episode for rank in self.survivors(view)]
        return [episode for episode in episodes if episode is not None]

    def fault_and_recover(
        self, stream: TrafficStream
    ) -> tuple[float, ClusterView | None, float | None]:
        """Kill the victim, see detection, recover; (fault time, healthy view, first correct)."""
        settings = self.settings
        self.note(f"SIGKILL rank {settings.victim}")
        fault_at = time.monotonic()
        self.cluster.kill(settings.victim, signal.SIGKILL)
        detected = wait_until(self.cluster, self.detected, settings.detect_timeout_s)
        self.check("survivors UNHEALTHY, victim DEAD", detected is not None, _summary(detected))
        if detected is not None and settings.policy == "orchestrator":
            self.commands()
        healthy = wait_until(self.cluster, self.healthy, settings.recover_timeout_s)
        self.check("survivors healthy", healthy is not None, _summary(healthy))
        recovered_at = _recovered_at(self.survivor_episodes(healthy)) if healthy else None
        first = _first_correct(stream, fault_at, recovered_at, settings.first_token_timeout_s)
        self.check("correct answers resume", first is not None, f"{len(stream.samples)} requests")
        return fault_at, healthy, first

    def survivors(self, view: ClusterView) -> list[int]:
        return [e.id for e in view.engines if e.id != self.settings.victim]

    def detected(self, view: ClusterView) -> bool:
        victim = view.engine(self.settings.victim)
        others = [view.engine(rank) for rank in self.survivors(view)]
        if self.settings.policy == "auto":  # the engines may already have recovered
            return victim.status is HealthStatus.DEAD and all(e.episode for e in others)
        unhealthy = all(e.status is HealthStatus.UNHEALTHY for e in others)
        return victim.status is HealthStatus.DEAD and unhealthy

    def healthy(self, view: ClusterView) -> bool:
        others = [view.engine(rank) for rank in self.survivors(view)]
        return all(
            e.status is HealthStatus.HEALTHY and self.settings.victim in e.removed_ranks
            for e in others
        )

    def compare_outputs(
        self, name: str, prompts: Sequence[Sequence[int]], want: Sequence[GenerationLike]
    ) -> bool:
        try:
            got = self.cluster.generate_batch(prompts, self.settings.max_tokens)
        except FTEngineError as exc:
            return self.check(name, False, f"generation failed: {type(exc).__name__}: {exc}")
        check = self.compare(got, want)
        self.outputs[name] = check.to_dict()
        return self.check(name, bool(check.match), f"{check.to_dict()}")

    def commands(self) -> None:
        victim = self.settings.victim
        self.note("orchestrator: retry (the victim must refuse)")
        retry = self.cluster.apply("retry", {}, "demo-retry-1")
        self.check(
            "retry rejected by the dead engine",
            not retry.success and "status is DEAD" in (retry.reason or ""),
            str(retry.reason),
        )
        self.note(f"orchestrator: scale_down removed_dp_ranks=[{victim}]")
        scale = self.cluster.apply(
            "scale_down", {"removed_dp_ranks": [victim]}, "demo-scale-down-1"
        )
        self.check("scale_down succeeded", bool(scale.success), str(scale.reason))


def run_scenario(
    cluster: ScenarioCluster,
    prompts: Sequence[Sequence[int]],
    reference: Sequence[GenerationLike],
    *,
    settings: ScenarioSettings,
    reporter: Reporter,
    compare: Compare,
    t0: float,
    flush: Callable[[], None] = lambda: None,
) -> ScenarioResult:
    """Run the scenario on a launched cluster; ``reference`` is the fault-free output of
    ``prompts`` and ``t0`` the monotonic time the demo started (phases are relative to it).
    ``flush`` is called before each note so that watched phase changes print in order."""
    run = _Run(cluster, settings, reporter, compare, flush)
    run.compare_outputs("outputs match before the fault", prompts, reference)
    # One-token requests: the first correct answer after the fault is then the first correct
    # token, as the phase table names it (the full outputs are compared before and after).
    expected = [list(generation.token_ids[:1]) for generation in reference]
    stream = TrafficStream(
        cluster.generate,
        [list(p) for p in prompts],
        expected,
        max_tokens=1,
        ready=serving_waiter(cluster),
    )
    stream.start()
    try:
        time.sleep(settings.warmup_s)  # let the stream show steady traffic before the fault
        fault_at, healthy, first = run.fault_and_recover(stream)
    finally:
        stream.stop()
    run.compare_outputs("outputs match after recovery", prompts, reference)
    survivors = [] if healthy is None else run.survivor_episodes(healthy)
    return ScenarioResult(
        settings=settings,
        checks=tuple(run.checks),
        removed_ranks=tuple(sorted(healthy.removed_ranks) if healthy else ()),
        phases=phase_history(cluster, t0),
        rows=tuple(breakdown(survivors, fault_at=fault_at, first_correct_at=first)),
        timings=_timings(fault_at, survivors, first, stream.samples),
        outputs=run.outputs,
    )


def _timings(
    fault_at: float, survivors: Sequence[Episode], first: float | None, samples: Sequence[Sample]
) -> dict[str, float | None]:
    """Seconds from the fault to detection, recovery and the first correct token; requests."""
    return {
        "detect_s": _since(fault_at, min((e.started for e in survivors), default=None)),
        "recovered_s": _since(fault_at, _recovered_at(survivors)),
        "interruption_s": interruption_s(fault_at, first),
        "stream_requests": float(len(samples)),
        "stream_failed_requests": float(sum(1 for s in samples if not s.correct)),
    }


def phase_history(cluster: Watchable, t0: float) -> dict[int, list[dict[str, object]]]:
    """Each engine's phase changes (``at``: seconds since ``t0``), plus process exits."""
    history: dict[int, list[dict[str, object]]] = {}
    for rank, changes in cluster.phase_changes().items():
        history[rank] = [
            {"source": c.source, "dest": c.dest, "at": c.at - t0, "reason": c.reason}
            for c in changes
        ]
    for event in cluster.events():
        if event.kind == "exit" and event.rank is not None:
            entries = history.setdefault(event.rank, [])
            source = str(entries[-1]["dest"]) if entries else "running"
            entries.append(
                {"source": source, "dest": "dead", "at": event.at - t0, "reason": event.detail}
            )
    for entries in history.values():
        entries.sort(key=lambda entry: float(str(entry["at"])))
    return history


def _summary(view: ClusterView | None) -> str:
    if view is None:
        return "timed out"
    return ", ".join(f"{e.id}:{e.status.name}/{e.phase}" for e in view.engines)


def _recovered_at(episodes: Sequence[Episode]) -> float | None:
    """When the last survivor finished recovering (None if one has not)."""
    ended = [episode.ended for episode in episodes]
    done = [at for at in ended if at is not None]
    return max(done) if done and len(done) == len(ended) else None


def _since(start: float, at: float | None) -> float | None:
    return None if at is None else at - start


def _first_correct(
    stream: TrafficStream, fault_at: float, recovered_at: float | None, timeout_s: float
) -> float | None:
    """When the first correct answer to a request sent after the fault arrived."""
    if recovered_at is None:
        return None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for sample in stream.samples:
            if sample.correct and sample.start > fault_at and sample.end >= recovered_at:
                return sample.end
        time.sleep(0.02)
    return None
