"""Run the main job end to end: SIGKILL a rank of a DP=4 CPU cluster under traffic and watch
it recover (scale down), checked against a fault-free reference. Exits 0 only if all held."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ftengine.control import launch
from ftengine.control.live import NullReporter, PlainReporter, Reporter, RichReporter, Watcher
from ftengine.control.scenario import SCENARIO, ScenarioResult, ScenarioSettings, run_scenario
from ftengine.errors import FTEngineError

COMMAND = "demo"
DEMO_SIZE = launch.CheckpointSize(layers=2, experts=8, hidden=64, intermediate=64, vocab=256)


def register(parser: argparse.ArgumentParser) -> None:
    """Add ``demo``'s flags."""
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument("--victim", type=int, default=3, help="DP rank to SIGKILL")
    parser.add_argument("--prompts", type=int, default=4, help="number of fixed prompts")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per prompt")
    parser.add_argument(
        "--plain", action="store_true", help="timestamped lines instead of a live table"
    )
    launch.add_run_args(parser, DEMO_SIZE)
    parser.set_defaults(func=run)


def _reporter(args: argparse.Namespace, t0: float) -> Reporter:
    if args.json:
        return NullReporter()
    console = Console()
    if console.is_terminal and not args.plain:
        return RichReporter(console, t0)
    return PlainReporter(sys.stdout, t0)


@contextlib.contextmanager
def _worker_stderr(path: Path, redirect: bool) -> Iterator[None]:
    """While workers are spawned, point fd 2 at ``path`` so that their log lines do not tear
    the live display (workers inherit fd 2); this process's stderr is restored after."""
    if not redirect:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def run(args: argparse.Namespace) -> int:
    """Make a checkpoint, compute the reference, launch, run the scenario, report."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    t0 = time.monotonic()
    reporter = _reporter(args, t0)
    try:
        with launch.run_checkpoint(args) as checkpoint:
            result, launch_s = _run_on(args, checkpoint, reporter, t0)
    except FTEngineError as exc:
        reporter.close()
        error = f"{type(exc).__name__}: {exc}"
        if args.json:
            print(json.dumps({"scenario": SCENARIO, "ok": False, "error": error}), flush=True)
        else:
            print(f"ftengine demo: FAIL: {error}", file=sys.stderr)
        return 1
    timings = {**result.timings, "launch_s": launch_s, "total_s": time.monotonic() - t0}
    report = {**result.to_dict(), "timings": timings}
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        _print_summary(result, report)
    return 0 if result.ok else 1


def _run_on(
    args: argparse.Namespace, checkpoint: Path, reporter: Reporter, t0: float
) -> tuple[ScenarioResult, float]:
    """Reference, launch, scenario on ``checkpoint``; returns (result, launch seconds)."""
    from ftengine.cluster import Cluster, compare_outputs, reference_generate

    prompts = launch.prompts_for(checkpoint, args.prompts)
    reporter.note(time.monotonic(), f"checkpoint ready: {checkpoint}")
    reference = reference_generate(checkpoint, prompts, args.max_tokens)
    reporter.note(time.monotonic(), f"reference computed for {len(prompts)} prompts")
    start = time.monotonic()
    rich = isinstance(reporter, RichReporter)
    log = Path(tempfile.gettempdir()) / f"ftengine-demo-workers-{os.getpid()}.log"
    with _worker_stderr(log, rich):
        cluster = Cluster.launch(launch.cluster_config(args, checkpoint))
    launch_s = time.monotonic() - start
    reporter.note(time.monotonic(), f"cluster of {args.dp_size} workers up ({args.policy})")
    if rich:
        reporter.note(time.monotonic(), f"worker logs: {log}")
    watcher = Watcher(cluster, reporter).start()
    try:
        settings = ScenarioSettings(
            victim=args.victim, policy=args.policy, max_tokens=args.max_tokens
        )
        result = run_scenario(
            cluster, prompts, reference, settings=settings, reporter=reporter,
            compare=compare_outputs, t0=t0, flush=watcher.poll,
        )  # fmt: skip
    finally:
        watcher.stop()
        reporter.close()
        cluster.shutdown()
    return result, launch_s


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
