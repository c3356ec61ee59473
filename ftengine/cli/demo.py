"""Run the main job end to end: SIGKILL a rank of a DP=4 CPU cluster under traffic and watch
it recover (scale down), checked against a fault-free reference. Exits 0 only if all held."""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from ftengine.control.launch import (
    CheckpointSize,
    add_checkpoint_args,
    add_cluster_args,
    checkpoint_dir,
    cluster_config,
    size_from_args,
)
from ftengine.control.live import NullReporter, PlainReporter, Reporter, RichReporter, Watcher
from ftengine.control.scenario import ScenarioResult, ScenarioSettings, run_scenario

COMMAND = "demo"
DEMO_SIZE = CheckpointSize(layers=2, experts=8, hidden=64, intermediate=64, vocab=256)


def register(parser: argparse.ArgumentParser) -> None:
    """Add ``demo``'s flags."""
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument("--victim", type=int, default=3, help="DP rank to SIGKILL")
    parser.add_argument("--prompts", type=int, default=4, help="number of fixed prompts")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per prompt")
    parser.add_argument(
        "--plain", action="store_true", help="timestamped lines instead of a live table"
    )
    add_checkpoint_args(parser, DEMO_SIZE)
    add_cluster_args(parser)
    parser.set_defaults(func=run)


def demo_prompts(count: int, vocab: int, seed: int = 1234) -> list[list[int]]:
    """``count`` fixed prompts of 3 to 8 token ids below ``vocab``."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(3 + i % 6)] for i in range(count)]


def _reporter(args: argparse.Namespace, t0: float) -> Reporter:
    if args.json:
        return NullReporter()
    console = Console()
    if console.is_terminal and not args.plain:
        return RichReporter(console, t0)
    return PlainReporter(sys.stdout, t0)


def run(args: argparse.Namespace) -> int:
    """Make a checkpoint, compute the reference, launch, run the scenario, report."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    from ftengine.cluster import Cluster, compare_outputs, reference_generate

    t0 = time.monotonic()
    reporter = _reporter(args, t0)
    settings = ScenarioSettings(victim=args.victim, policy=args.policy, max_tokens=args.max_tokens)
    prompts = demo_prompts(args.prompts, args.vocab)
    timings: dict[str, float] = {}
    with checkpoint_dir(args.checkpoint, size_from_args(args)) as checkpoint:
        reporter.note(time.monotonic(), f"checkpoint ready: {checkpoint}")
        reference = reference_generate(checkpoint, prompts, args.max_tokens)
        reporter.note(time.monotonic(), f"reference computed for {len(prompts)} prompts")
        start = time.monotonic()
        cluster = Cluster.launch(cluster_config(args, checkpoint))
        timings["launch_s"] = time.monotonic() - start
        reporter.note(time.monotonic(), f"cluster of {args.dp_size} workers up ({args.policy})")
        watcher = Watcher(cluster, reporter).start()
        try:
            result = run_scenario(
                cluster,
                prompts,
                reference,
                settings=settings,
                reporter=reporter,
                compare=compare_outputs,
                t0=t0,
            )
        finally:
            watcher.stop()
            reporter.close()
            cluster.shutdown()
    timings["total_s"] = time.monotonic() - t0
    report = {**result.to_dict(), "timings": {**result.timings, **timings}}
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        _print_summary(result, report)
    return 0 if result.ok else 1


def _print_summary(result: ScenarioResult, report: dict[str, Any]) -> None:
    console = Console()
    table = Table(title="recovery breakdown (seconds after the SIGKILL)")
    for column in ("phase", "starts at", "takes"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for row in result.rows:
        table.add_row(row.name, f"{row.start_s:+.3f} s", f"{row.seconds * 1000:.1f} ms")
    console.print(table)
    timings = report["timings"]
    for key in ("launch_s", "detect_s", "recovered_s", "interruption_s", "total_s"):
        value = timings.get(key)
        console.print(f"{key:>16}: {'n/a' if value is None else f'{value:.3f} s'}")
    for check in result.checks:
        mark = "[green]ok[/green]  " if check.ok else "[red]FAIL[/red]"
        console.print(f"{mark} {check.name}")
    verdict = "[bold green]PASS[/bold green]" if result.ok else "[bold red]FAIL[/bold red]"
    console.print(
        f"verdict: {verdict}  recovered={result.recovered} outputs_match={result.outputs_match} "
        f"removed_ranks={list(result.removed_ranks)}"
    )
