"""Recovery benchmark on the CPU cluster: SIGKILL/SIGSTOP detection, scale-down interruption
vs a cold restart, retry time, FT overhead and expert reloads, measured side by side on one
checkpoint. Prints one JSON object; ``--plot`` draws tokens/s with fault and recovery marks."""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from ftengine.control.bench_plot import Mark, plot_throughput
from ftengine.control.bench_trials import (
    BenchCluster,
    Trial,
    TrialPlan,
    launch_to_first_token,
    retry_trial,
    run_trial,
    step_time_s,
    summary,
)
from ftengine.control.launch import (
    CheckpointSize,
    add_checkpoint_args,
    add_cluster_args,
    checkpoint_dir,
    checkpoint_vocab,
    cluster_config,
    fixed_prompts,
    size_from_args,
)
from ftengine.control.traffic import TrafficStream

BENCH = "recovery"
# About 600 MB of bf16 weights (experts dominate), so that reloading experts costs real I/O.
BENCH_SIZE = CheckpointSize(layers=4, experts=16, hidden=1024, intermediate=1536, vocab=512)
CHAIN_VICTIMS = (1, 3, 2)  # rank 3 holds the last copies of rank 1's experts: 2nd kill reloads
CHECK_TOKENS = 4
FT_OFF = {"op_timeout_s": 1800.0, "heartbeat_s": 3600.0}  # torch's default gloo timeout
logger = logging.getLogger(__name__)


def register(parser: argparse.ArgumentParser) -> None:
    """Add ``bench recovery``'s flags."""
    parser.add_argument("--json", action="store_true", help="(always JSON; kept for symmetry)")
    parser.add_argument("--plot", type=Path, default=None, help="write a tokens/s PNG here")
    parser.add_argument("--kill-trials", type=int, default=10, help="SIGKILL trials (>= 1)")
    parser.add_argument("--stop-trials", type=int, default=10, help="SIGSTOP trials (>= 1)")
    parser.add_argument("--overhead-rounds", type=int, default=8, help="FT on/off step rounds")
    parser.add_argument("--overhead-tokens", type=int, default=24, help="decode steps per round")
    parser.add_argument(
        "--settle", type=float, default=1.0, help="seconds of steady traffic before each fault"
    )
    add_checkpoint_args(parser, BENCH_SIZE)
    add_cluster_args(parser)
    parser.set_defaults(func=run)


def _chains(kills: int, stops: int) -> list[list[str]]:
    """Trials grouped per cluster launch: up to len(CHAIN_VICTIMS) trials of one kind each."""
    width = len(CHAIN_VICTIMS)
    chains: list[list[str]] = []
    for kind, count in (("sigkill", kills), ("sigstop", stops)):
        chains += [[kind] * min(width, count - i) for i in range(0, count, width)]
    return chains


class _Bench:
    """State shared by the steps of one benchmark run."""

    def __init__(self, args: argparse.Namespace, checkpoint: Path) -> None:
        from ftengine.cluster import compare_outputs, reference_generate

        self.args = args
        self.checkpoint = checkpoint
        self.prompts = fixed_prompts(8, checkpoint_vocab(checkpoint))
        self.reference = reference_generate(checkpoint, self.prompts, CHECK_TOKENS)
        self.first_tokens = [list(g.token_ids[:1]) for g in self.reference]
        self.compare: Callable[..., Any] = compare_outputs
        self.restarts: list[float] = []
        self.trials: list[Trial] = []
        self.matches: list[bool] = []
        self.marks: list[Mark] = []
        self.pauses: list[tuple[float, float]] = []

    def launch(self, **overrides: object) -> BenchCluster:
        from ftengine.cluster import Cluster

        def start() -> BenchCluster:
            return Cluster.launch(cluster_config(self.args, self.checkpoint, **overrides))

        cluster, seconds = launch_to_first_token(start, self.prompts[0])
        self.restarts.append(seconds)
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
            cluster.generate, self.prompts, self.first_tokens, max_tokens=1, backoff_s=0.005
        ).start()

    def chain(self, cluster: BenchCluster, kinds: Sequence[str], stream: TrafficStream) -> None:
        removed: frozenset[int] = frozenset()
        timeout = self.args.op_timeout + 30.0
        for index, kind in enumerate(kinds):
            victim = CHAIN_VICTIMS[index]
            plan = TrialPlan(kind, victim, removed, index < len(kinds) - 1, timeout)
            time.sleep(self.args.settle)  # steady traffic before the fault, for the plot
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


def _overhead(bench: _Bench, on: BenchCluster) -> dict[str, float]:
    """Step time with FT on and with the FT-off proxy, in rounds that alternate which goes
    first (to cancel drift). The ratio uses each side's fastest round: on a shared machine
    the other load only ever adds time, so the minimum is the least disturbed estimate."""
    off = bench.launch(**FT_OFF)
    try:
        tokens = bench.args.overhead_tokens
        times: dict[str, list[float]] = {"on": [], "off": []}
        for cluster in (on, off):  # warm-up round each
            step_time_s(cluster, bench.prompts, tokens)
        for index in range(bench.args.overhead_rounds):
            order = ("on", "off") if index % 2 == 0 else ("off", "on")
            for name in order:
                cluster = on if name == "on" else off
                times[name].append(step_time_s(cluster, bench.prompts, tokens))
    finally:
        off.shutdown()
    best_on, best_off = min(times["on"]), min(times["off"])
    median_on, median_off = (float(summary(times[k])["median"] or 0.0) for k in ("on", "off"))
    return {
        "ft_overhead_ratio": best_on / best_off,
        "ft_overhead_ratio_median": median_on / median_off,
        "step_time_ft_on_s": best_on,
        "step_time_ft_off_s": best_off,
    }


def _first_launch(bench: _Bench, kinds: Sequence[str]) -> dict[str, Any]:
    """Launch A: FT overhead, then an injected transient fault and retry, then a trial chain;
    its traffic is the one plotted."""
    args = bench.args
    steps_before = 1 + (args.overhead_rounds + 1) * args.overhead_tokens
    inject = f"rank=0,step={steps_before + 10},kind=raise"
    cluster = bench.launch(inject_fault=inject)
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
    kills = [t for t in bench.trials if t.kind == "sigkill"]
    stops = [t for t in bench.trials if t.kind == "sigstop"]
    downs = [t for t in bench.trials if t.interruption_s is not None]
    kill_downs = [t for t in kills if t.interruption_s is not None]
    # The scale-down that reloads experts is the one where weight loading matters.
    reload_trials = [t for t in kill_downs if t.reloads] or kill_downs
    interruption = summary([t.interruption_s or 0.0 for t in reload_trials])["median"]
    restart = summary(bench.restarts)["median"]
    return {
        "checkpoint_mb": round(size_mb, 1),
        "dp_size": bench.args.dp_size,
        "sigkill_detect_s": summary([t.detect_s for t in kills]),
        "sigstop_detect_s": summary([t.detect_s for t in stops]),
        "op_timeout_s": bench.args.op_timeout,
        "heartbeat_s": bench.args.heartbeat,
        "scale_down_interruption_s": interruption,
        "scale_down_interruption_note": "median over SIGKILL scale-downs that reloaded experts",
        "sigkill_interruption_s": summary([t.interruption_s or 0.0 for t in kill_downs]),
        "sigstop_interruption_s": summary(
            [t.interruption_s or 0.0 for t in stops if t.interruption_s is not None]
        ),
        "full_restart_s": restart,
        "full_restart_samples_s": bench.restarts,
        "interruption_over_restart": None
        if not interruption or not restart
        else interruption / restart,
        "retry_s": measured.get("retry_s"),
        "ft_overhead_ratio": measured.get("ft_overhead_ratio"),
        "step_time_ft_on_s": measured.get("step_time_ft_on_s"),
        "step_time_ft_off_s": measured.get("step_time_ft_off_s"),
        "ft_overhead_ratio_median": measured.get("ft_overhead_ratio_median"),
        "ft_off_proxy": "same cluster with op timeout 1800 s and heartbeats every 3600 s",
        "reloads": max((t.reloads for t in downs), default=0),
        "reload_lower_bound": max((t.reload_lower_bound for t in reload_trials), default=0),
        "bytes_reloaded": max((t.bytes_reloaded for t in downs), default=0),
        "outputs_match": bool(bench.matches) and all(bench.matches),
        "trials": [_trial_fields(t) for t in bench.trials],
        "wall_s": wall_s,
    }


def _trial_fields(trial: Trial) -> dict[str, object]:
    """A trial as JSON-able fields (absolute times dropped)."""
    fields = attrs.asdict(trial)
    for key in ("fault_at", "detected_at", "recovered_at"):
        fields.pop(key)
    return fields


def run(args: argparse.Namespace) -> int:
    """Run every measurement and print the JSON object."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    start = time.monotonic()
    chains = _chains(max(1, args.kill_trials), max(1, args.stop_trials))
    with checkpoint_dir(args.checkpoint, size_from_args(args)) as checkpoint:
        size_mb = sum(f.stat().st_size for f in checkpoint.iterdir()) / 1e6
        bench = _Bench(args, checkpoint)
        measured = _first_launch(bench, chains[0])
        for kinds in chains[1:]:
            cluster = bench.launch()
            stream = bench.stream(cluster)
            try:
                bench.chain(cluster, kinds, stream)
            finally:
                stream.stop()
                cluster.shutdown()
    result = _result(bench, measured, size_mb, time.monotonic() - start)
    if args.plot is not None:
        result["plot"] = str(_plot(bench, measured["plot_samples"], args.plot))
    print(json.dumps(result, indent=None), flush=True)
    return 0 if result["outputs_match"] else 1


def _plot(bench: _Bench, samples: Sequence[Any], path: Path) -> Path:
    begin = min(s.start for s in samples)
    end = max(s.end for s in samples)
    marks = [m for m in bench.marks if begin <= m.at <= end]
    pauses = [(a, b) for a, b in bench.pauses if begin <= a <= end]
    title = (
        f"DP={bench.args.dp_size} CPU cluster: injected fault + retry, then SIGKILL/SIGSTOP "
        "trials with scale-down (orchestrator acting at once)"
    )
    return plot_throughput(samples, marks, path, start=begin, end=end, title=title, pauses=pauses)
