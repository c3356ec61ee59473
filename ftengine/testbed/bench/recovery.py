"""Recovery benchmark on the CPU cluster: SIGKILL/SIGSTOP detection, scale-down interruption
vs a full restart (warm and cold page cache), retry time, FT overhead against the same
checkpoint on a fault-tolerance-off cluster, and expert reloads, measured side by side on one
checkpoint. Prints one JSON object; with ``plot`` it draws tokens/s with fault and recovery
marks (``ftengine bench recovery``)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from ftengine.testbed.bench.overhead import interleaved_rounds
from ftengine.testbed.bench.plot import Mark, plot_throughput
from ftengine.testbed.bench.prompts import prompts_for
from ftengine.testbed.bench.protocol import BenchCluster, ConfigFor
from ftengine.testbed.bench.traffic import TrafficStream
from ftengine.testbed.bench.trials import (
    Restart,
    Trial,
    TrialPlan,
    retry_trial,
    run_trial,
    summary,
    timed_restart,
)
from ftengine.testbed.bench.waits import serving_waiter

CHAIN_VICTIMS = (1, 3, 2)  # rank 3 holds the last copies of rank 1's experts: 2nd kill reloads
CHECK_TOKENS = 4
FT_OFF_NOTE = (
    "a second cluster on the same checkpoint with ClusterConfig(fault_tolerance=False): torch's "
    "default gloo timeout, no heartbeats, no exit verdicts, no hung-step fencing, no engine "
    "polling, fault reports or status after steps"
)
logger = logging.getLogger(__name__)


@attrs.frozen
class RecoveryOptions:
    """What the benchmark's flags ask for: trial counts (each launch runs up to
    ``len(CHAIN_VICTIMS)`` trials of one kind), FT-overhead rounds, decode steps per round
    and launches per side, ``settle`` seconds of steady traffic before each fault, and the
    cluster's DP size, op timeout and heartbeat (seconds, reported beside the results)."""

    kill_trials: int = 10
    stop_trials: int = 10
    overhead_rounds: int = 16
    overhead_tokens: int = 8
    overhead_launches: int = 2
    settle: float = 1.0
    dp_size: int = 4
    op_timeout: float = 2.0
    heartbeat: float = 0.25
    plot: Path | None = None


def _chains(kills: int, stops: int) -> list[list[str]]:
    """Trials grouped per cluster launch: up to len(CHAIN_VICTIMS) trials of one kind each."""
    width = len(CHAIN_VICTIMS)
    chains: list[list[str]] = []
    for kind, count in (("sigkill", kills), ("sigstop", stops)):
        chains += [[kind] * min(width, count - i) for i in range(0, count, width)]
    return chains


class _Bench:
    """State shared by the steps of one benchmark run."""

    def __init__(self, options: RecoveryOptions, checkpoint: Path, config: ConfigFor) -> None:
        from ftengine.testbed.cluster import compare_outputs, reference_generate

        self.options = options
        self.checkpoint = checkpoint
        self.config = config
        self.prompts = prompts_for(checkpoint, 8)
        self.reference = reference_generate(checkpoint, self.prompts, CHECK_TOKENS)
        self.first_tokens = [list(g.token_ids[:1]) for g in self.reference]
        self.compare: Callable[..., Any] = compare_outputs
        self.restarts: list[Restart] = []
        self.trials: list[Trial] = []
        self.matches: list[bool] = []
        self.marks: list[Mark] = []
        self.pauses: list[tuple[float, float]] = []

    def start_cluster(
        self, *, cold: bool = False, sample: bool = True, **overrides: object
    ) -> BenchCluster:
        """Launch a cluster (``overrides`` on the flags' config) and time it to its first
        token; ``cold`` evicts the checkpoint from the page cache first. FT-on launches count
        as full-restart samples unless ``sample`` is False."""
        from ftengine.testbed.cluster import Cluster

        def start() -> BenchCluster:
            return Cluster.launch(self.config(self.checkpoint, **overrides))

        cluster, restart = timed_restart(start, self.prompts[0], self.checkpoint, cold=cold)
        if sample and overrides.get("fault_tolerance", True):
            self.restarts.append(restart)
        return cluster

    def outputs_match(self, cluster: BenchCluster) -> bool:
        start = time.monotonic()
        got = cluster.generate_batch(self.prompts, CHECK_TOKENS)
        self.pauses.append((start, time.monotonic()))
        match = bool(self.compare(got, self.reference).match)
        self.matches.append(match)
        return match

    def stream(self, cluster: BenchCluster) -> TrafficStream:
        return TrafficStream(
            cluster.generate,
            self.prompts,
            self.first_tokens,
            max_tokens=1,
            backoff_s=0.005,
            ready=serving_waiter(cluster),
        ).start()

    def chain(self, cluster: BenchCluster, kinds: Sequence[str], stream: TrafficStream) -> None:
        removed: frozenset[int] = frozenset()
        timeout = self.options.op_timeout + 30.0
        for index, kind in enumerate(kinds):
            victim = CHAIN_VICTIMS[index]
            plan = TrialPlan(kind, victim, removed, index < len(kinds) - 1, timeout)
            time.sleep(self.options.settle)  # steady traffic before the fault, for the plot
            trial = run_trial(cluster, stream, plan, lambda: self.outputs_match(cluster))
            self.trials.append(trial)
            self._mark(trial)
            removed |= {victim}

    def _mark(self, trial: Trial) -> None:
        name = f"{trial.kind} rank {trial.victim}"
        self.marks.append(Mark(trial.fault_at, "fault", name))
        self.marks.append(Mark(trial.detected_at, "detected"))
        if trial.recovered_at is not None and trial.interruption_s is not None:
            self.marks.append(Mark(trial.recovered_at, "recovered"))
            self.marks.append(Mark(trial.fault_at + trial.interruption_s, "first token"))


def _overhead(bench: _Bench, on: BenchCluster) -> dict[str, object]:
    """Step time of ``on`` and ``overhead_launches - 1`` more FT-on launches against as
    many FT-off launches on the same checkpoint, in interleaved rounds
    (``ftengine.testbed.bench.overhead``); the extra launches are not restart samples."""
    options = bench.options
    launches = options.overhead_launches
    extra: list[BenchCluster] = []
    try:
        for _ in range(launches):
            extra.append(bench.start_cluster(fault_tolerance=False))
        for _ in range(launches - 1):
            extra.append(bench.start_cluster(sample=False))
        offs, ons = extra[:launches], [on, *extra[launches:]]
        rounds = interleaved_rounds(
            ons, offs, bench.prompts, options.overhead_tokens, options.overhead_rounds
        )
    finally:
        for cluster in extra:
            cluster.shutdown()
    return {**rounds.to_dict(), "ft_overhead_launches": launches}


def _first_launch(bench: _Bench, kinds: Sequence[str]) -> dict[str, Any]:
    """Launch A: FT overhead, then an injected transient fault and retry, then a trial chain;
    its traffic is the one plotted."""
    options = bench.options
    steps_before = 1 + (options.overhead_rounds + 1) * options.overhead_tokens
    inject = f"rank=0,step={steps_before + 10},kind=raise"
    cluster = bench.start_cluster(inject_fault=inject)
    try:
        measured: dict[str, Any] = _overhead(bench, cluster)
        stream = bench.stream(cluster)
        try:
            retry = retry_trial(cluster, timeout_s=60.0)
            bench.marks.append(Mark(retry.detected_at, "detected", "injected raise"))
            bench.marks.append(Mark(retry.healthy_at, "recovered", "retry"))
            measured["retry_s"] = retry.retry_s
            bench.chain(cluster, kinds, stream)
        finally:
            stream.stop()
        measured["plot_samples"] = stream.samples
    finally:
        cluster.shutdown()
    return measured


def _result(
    bench: _Bench, measured: dict[str, Any], size_mb: float, wall_s: float
) -> dict[str, Any]:
    overhead = {k: v for k, v in measured.items() if k.startswith(("ft_", "step_time_"))}
    return {
        "checkpoint_mb": round(size_mb, 1),
        "dp_size": bench.options.dp_size,
        **_detection(bench),
        **_interruption(bench),
        "retry_s": measured.get("retry_s"),
        **overhead,
        "ft_off": FT_OFF_NOTE,
        **_reloads(bench),
        "outputs_match": bool(bench.matches) and all(bench.matches),
        "trials": [_trial_fields(t) for t in bench.trials],
        "wall_s": wall_s,
    }


def _detection(bench: _Bench) -> dict[str, Any]:
    return {
        "sigkill_detect_s": summary([t.detect_s for t in bench.trials if t.kind == "sigkill"]),
        "sigstop_detect_s": summary([t.detect_s for t in bench.trials if t.kind == "sigstop"]),
        "op_timeout_s": bench.options.op_timeout,
        "heartbeat_s": bench.options.heartbeat,
    }


def _interruption(bench: _Bench) -> dict[str, Any]:
    """Scale-down interruptions, full restarts (cold and warm) and their ratios."""
    downs = [t for t in bench.trials if t.interruption_s is not None]
    kill_downs = [t for t in downs if t.kind == "sigkill"]
    # The scale-down that reloads experts is the one where weight loading matters.
    reload_trials = [t for t in kill_downs if t.reloads] or kill_downs
    interruption = summary([t.interruption_s or 0.0 for t in reload_trials])["median"]
    cold = [r.seconds for r in bench.restarts if r.cold]
    warm = [r.seconds for r in bench.restarts if not r.cold]
    cold_s, warm_s = summary(cold)["median"], summary(warm)["median"]
    return {
        "scale_down_interruption_s": interruption,
        "scale_down_interruption_note": "median over SIGKILL scale-downs that reloaded experts",
        "sigkill_interruption_s": summary([t.interruption_s or 0.0 for t in kill_downs]),
        "sigstop_interruption_s": summary(
            [t.interruption_s or 0.0 for t in downs if t.kind == "sigstop"]
        ),
        "full_restart_s": cold_s,
        "full_restart_warm_s": warm_s,
        "full_restart_note": "launch -> first token; cold: checkpoint evicted from the page "
        "cache first (median), warm: left in it",
        "full_restart_samples_s": {"cold": cold, "warm": warm},
        "cold_restart_cached_fraction": max(
            (r.cached for r in bench.restarts if r.cached is not None), default=None
        ),
        "interruption_over_restart": _ratio(interruption, cold_s),
        "interruption_over_warm_restart": _ratio(interruption, warm_s),
    }


def _reloads(bench: _Bench) -> dict[str, Any]:
    downs = [t for t in bench.trials if t.interruption_s is not None]
    reload_trials = [t for t in downs if t.kind == "sigkill" and t.reloads]
    return {
        "reloads": max((t.reloads for t in downs), default=0),
        "reload_lower_bound": max((t.reload_lower_bound for t in reload_trials), default=0),
        "bytes_reloaded": max((t.bytes_reloaded for t in downs), default=0),
    }


def _ratio(part: float | int | None, whole: float | int | None) -> float | None:
    return None if not part or not whole else float(part) / float(whole)


def _trial_fields(trial: Trial) -> dict[str, object]:
    """A trial as JSON-able fields (absolute times dropped)."""
    fields = attrs.asdict(trial)
    for key in ("fault_at", "detected_at", "recovered_at"):
        fields.pop(key)
    return fields


def run_recovery(
    options: RecoveryOptions, checkpoint: contextlib.AbstractContextManager[Path], config: ConfigFor
) -> int:
    """Enter ``checkpoint`` (made or reused), run every measurement on clusters from
    ``config`` and print the JSON object; 0 only if every output matched the reference."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    start = time.monotonic()
    chains = _chains(options.kill_trials, options.stop_trials)
    with checkpoint as path:
        size_mb = sum(f.stat().st_size for f in path.iterdir()) / 1e6
        bench = _Bench(options, path, config)
        measured = _first_launch(bench, chains[0])
        for index, kinds in enumerate(chains[1:]):
            # Every other launch is cold: a restart after a real fault reads its weights from disk.
            cluster = bench.start_cluster(cold=index % 2 == 0)
            stream = bench.stream(cluster)
            try:
                bench.chain(cluster, kinds, stream)
            finally:
                stream.stop()
                cluster.shutdown()
    result = _result(bench, measured, size_mb, time.monotonic() - start)
    if options.plot is not None:
        result["plot"] = str(_plot(bench, measured["plot_samples"], options.plot))
    print(json.dumps(result, indent=None), flush=True)
    return 0 if result["outputs_match"] else 1


def _plot(bench: _Bench, samples: Sequence[Any], path: Path) -> Path:
    begin = min(s.start for s in samples)
    end = max(s.end for s in samples)
    marks = [m for m in bench.marks if begin <= m.at <= end]
    pauses = [(a, b) for a, b in bench.pauses if begin <= a <= end]
    title = (
        f"DP={bench.options.dp_size} CPU cluster: injected fault + retry, then SIGKILL/SIGSTOP "
        "trials with scale-down (orchestrator acting at once)"
    )
    return plot_throughput(samples, marks, path, start=begin, end=end, title=title, pauses=pauses)
