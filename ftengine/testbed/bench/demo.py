"""The demo: SIGKILL a rank of a CPU cluster under traffic and watch it recover (scale down),
checked against a fault-free reference; shown as a live table on a terminal, as timestamped
lines, or as one JSON object (``ftengine demo [--plain | --json]``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table

from ftengine.errors import FTEngineError
from ftengine.testbed.bench.live import NullReporter, PlainReporter, Reporter, RichReporter, Watcher
from ftengine.testbed.bench.prompts import prompts_for
from ftengine.testbed.bench.protocol import ConfigFor
from ftengine.testbed.bench.scenario import SCENARIO, ScenarioResult, ScenarioSettings, run_scenario


@attrs.frozen
class DemoOptions:
    """What the demo's flags ask for: ``victim`` is the DP rank SIGKILLed, ``prompts`` the
    number of fixed prompts, ``json`` one JSON object only, ``plain`` timestamped lines
    instead of a live table; ``policy`` and ``dp_size`` are the cluster's."""

    victim: int = 3
    prompts: int = 4
    max_tokens: int = 8
    policy: str = "orchestrator"
    dp_size: int = 4
    json: bool = False
    plain: bool = False


def _reporter(options: DemoOptions, t0: float) -> Reporter:
    if options.json:
        return NullReporter()
    console = Console()
    if console.is_terminal and not options.plain:
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


def run_demo(
    options: DemoOptions, checkpoint: contextlib.AbstractContextManager[Path], config: ConfigFor
) -> int:
    """Enter ``checkpoint`` (made or reused), compute the reference, launch a cluster from
    ``config``, run the scenario and report; 0 only if every check held."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    t0 = time.monotonic()
    reporter = _reporter(options, t0)
    try:
        with checkpoint as path:
            result, launch_s = _run_on(options, path, config, reporter, t0)
    except FTEngineError as exc:
        reporter.close()
        error = f"{type(exc).__name__}: {exc}"
        if options.json:
            print(json.dumps({"scenario": SCENARIO, "ok": False, "error": error}), flush=True)
        else:
            print(f"ftengine demo: FAIL: {error}", file=sys.stderr)
        return 1
    timings = {**result.timings, "launch_s": launch_s, "total_s": time.monotonic() - t0}
    report = {**result.to_dict(), "timings": timings}
    if options.json:
        print(json.dumps(report), flush=True)
    else:
        _print_summary(result, report)
    return 0 if result.ok else 1


def _run_on(
    options: DemoOptions, checkpoint: Path, config: ConfigFor, reporter: Reporter, t0: float
) -> tuple[ScenarioResult, float]:
    """Reference, launch, scenario on ``checkpoint``; returns (result, launch seconds)."""
    from ftengine.testbed.cluster import Cluster, compare_outputs, reference_generate

    prompts = prompts_for(checkpoint, options.prompts)
    reporter.note(time.monotonic(), f"checkpoint ready: {checkpoint}")
    reference = reference_generate(checkpoint, prompts, options.max_tokens)
    reporter.note(time.monotonic(), f"reference computed for {len(prompts)} prompts")
    start = time.monotonic()
    rich = isinstance(reporter, RichReporter)
    log = Path(tempfile.gettempdir()) / f"ftengine-demo-workers-{os.getpid()}.log"
    with _worker_stderr(log, rich):
        cluster = Cluster.launch(config(checkpoint))
    launch_s = time.monotonic() - start
    reporter.note(time.monotonic(), f"cluster of {options.dp_size} workers up ({options.policy})")
    if rich:
        reporter.note(time.monotonic(), f"worker logs: {log}")
    watcher = Watcher(cluster, reporter).start()
    try:
        settings = ScenarioSettings(
            victim=options.victim, policy=options.policy, max_tokens=options.max_tokens
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
    print_verdict(
        console,
        [check.to_dict() for check in result.checks],
        f"recovered={result.recovered} outputs_match={result.outputs_match} "
        f"removed_ranks={list(result.removed_ranks)}",
    )


def print_verdict(console: Console, checks: Sequence[Mapping[str, object]], tail: str) -> None:
    """Each check (``Check.to_dict()``) marked ok / FAIL, then PASS only if all held."""
    for check in checks:
        mark = "[green]ok[/green]  " if check["ok"] else "[red]FAIL[/red]"
        console.print(f"{mark} {check['name']}")
    passed = all(check["ok"] for check in checks)
    verdict = "[bold green]PASS[/bold green]" if passed else "[bold red]FAIL[/bold red]"
    console.print(f"verdict: {verdict}  {tail}")
