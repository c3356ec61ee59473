"""Prometheus metrics of the control plane, derived from cluster status snapshots.

Each engine reports its recent fault episodes (faults, phases, timed steps, repair report;
the cluster keeps each one's last state, so an episode that starts and ends between two
observations is still there) and a cumulative count of them. Every new fault, every
finished episode and every episode is counted exactly once, however often (or seldom) the
status is observed; only an observer that misses more episodes than the status keeps
(``ftengine.testbed.cluster.handles.EPISODE_HISTORY``) counts those episodes without their faults.
"""

from __future__ import annotations

import threading

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ftengine.faults import Phase
from ftengine.testbed.control.snapshot import ClusterView, EngineView, Episode
from ftengine.testbed.serving_api import FinishReason

RECOVERY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@attrs.define
class _Cursor:
    """What was already counted of one engine's current episode."""

    episode: int = -1
    faults: int = 0
    finished: bool = False
    episodes: int = 0  # of the engine's cumulative ``fault_episodes``


class ControlMetrics:
    """All control-plane metrics in one private registry (so many apps can coexist)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._declare_engine_metrics(self.registry)
        self._declare_recovery_metrics(self.registry)
        self._declare_request_metrics(self.registry)
        self._lock = threading.Lock()
        self._cursors: dict[int, _Cursor] = {}

    def _declare_engine_metrics(self, reg: CollectorRegistry) -> None:
        self.phase = Gauge(
            "ftengine_engine_phase", "1 for the phase an engine is in, 0 otherwise",
            ["engine", "phase"], registry=reg,
        )  # fmt: skip
        self.health = Gauge(
            "ftengine_engine_health", "vLLM health per engine: 0 HEALTHY, 1 DEAD, 2 UNHEALTHY",
            ["engine"], registry=reg,
        )  # fmt: skip
        self.epoch = Gauge("ftengine_engine_epoch", "process-group epoch", ["engine"], registry=reg)
        self.faults = Counter(
            "ftengine_faults", "faults reported to engines (each engine counts its own), by kind",
            ["kind"], registry=reg,
        )  # fmt: skip
        self.episodes = Counter(
            "ftengine_fault_episodes", "fault episodes (first fault to healthy or dead) per engine",
            ["engine"], registry=reg,
        )  # fmt: skip

    def _declare_recovery_metrics(self, reg: CollectorRegistry) -> None:
        self.recovery = Histogram(
            "ftengine_recovery_duration_seconds",
            "finished recovery steps by recovery kind (retry, scale_down, none) and step "
            "(detect, quarantine, device_reset, mask, comm_rebuild, expert_repair, validate; "
            "total: first fault to healthy)",
            ["kind", "step"], buckets=RECOVERY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.recoveries = Counter(
            "ftengine_recoveries", "finished fault episodes by recovery kind and outcome",
            ["kind", "outcome"], registry=reg,
        )  # fmt: skip
        self.experts_reloaded = Counter(
            "ftengine_experts_reloaded", "(layer, expert) weights reloaded from disk", registry=reg
        )
        self.bytes_reloaded = Counter(
            "ftengine_bytes_reloaded", "bytes of expert weights read from disk", registry=reg
        )
        self.reload_lower_bound = Gauge(
            "ftengine_reload_lower_bound",
            "fewest (layer, expert) reloads any plan could do, last scale-down", registry=reg,
        )  # fmt: skip

    def _declare_request_metrics(self, reg: CollectorRegistry) -> None:
        self.commands = Counter(
            "ftengine_commands", "fault-tolerance commands finished, by instruction and outcome",
            ["instruction", "outcome"], registry=reg,
        )  # fmt: skip
        self.completions = Counter(
            "ftengine_completions",
            "completions (one per prompt) finished, by finish_reason (length, stop, abort, error)",
            ["finish_reason"], registry=reg,
        )  # fmt: skip
        for reason in FinishReason:  # every reason shows, at 0 until it happens
            self.completions.labels(reason.value)
        self.completion_requests = Counter(
            "ftengine_completion_requests",
            "completion requests by outcome: accepted, rejected (bad input, 4xx), "
            "unavailable (503: the cluster was not serving)",
            ["outcome"], registry=reg,
        )  # fmt: skip
        self.tokens = Counter("ftengine_generated_tokens", "tokens generated", registry=reg)

    def observe(self, view: ClusterView) -> None:
        """Bring every metric up to date with one status snapshot (idempotent)."""
        with self._lock:
            for engine in view.engines:
                self._observe_engine(engine)

    def record_command(self, instruction: str, success: bool) -> None:
        """Count one finished command."""
        self.commands.labels(instruction, "success" if success else "failure").inc()

    def record_tokens(self, tokens: int, finish_reason: str | None = None) -> None:
        """Count generated tokens and, when ``finish_reason`` is given, one finished
        completion (one prompt) with that reason."""
        self.tokens.inc(tokens)
        if finish_reason is not None:
            self.completions.labels(finish_reason).inc()

    def record_completion_request(self, outcome: str) -> None:
        """Count one completion request (``outcome``: accepted, rejected, unavailable)."""
        self.completion_requests.labels(outcome).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def _observe_engine(self, engine: EngineView) -> None:
        label = str(engine.id)
        for phase in Phase:
            self.phase.labels(label, phase.value).set(1.0 if engine.phase == phase.value else 0.0)
        self.health.labels(label).set(int(engine.status))
        self.epoch.labels(label).set(engine.epoch)
        cursor = self._cursors.setdefault(engine.id, _Cursor())
        if engine.fault_episodes > cursor.episodes:
            self.episodes.labels(label).inc(engine.fault_episodes - cursor.episodes)
            cursor.episodes = engine.fault_episodes
        for episode in engine.episodes:
            if episode.number < cursor.episode:
                continue
            if episode.number > cursor.episode:
                cursor.episode, cursor.faults, cursor.finished = episode.number, 0, False
            self._observe_episode(cursor, episode)

    def _observe_episode(self, cursor: _Cursor, episode: Episode) -> None:
        for kind in episode.fault_kinds[cursor.faults :]:
            self.faults.labels(kind).inc()
        cursor.faults = max(cursor.faults, len(episode.fault_kinds))
        if cursor.finished or episode.ended is None:
            return
        cursor.finished = True
        kind = episode.recovery_kind or "none"
        self.recoveries.labels(kind, episode.outcome or "unknown").inc()
        for step in episode.steps:
            if step.seconds is not None and step.error is None:
                self.recovery.labels(kind, step.name).observe(step.seconds)
        if episode.outcome == Phase.HEALTHY.value:
            self.recovery.labels(kind, "total").observe(episode.ended - episode.started)
        if episode.repair is not None:
            self.experts_reloaded.inc(episode.repair.reloads)
            self.bytes_reloaded.inc(episode.repair.bytes_reloaded)
            self.reload_lower_bound.set(episode.repair.reload_lower_bound)
