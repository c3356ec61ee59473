"""In-flight benchmark (``ftengine bench inflight``): what a fault costs the requests that
are being served when it strikes. Concurrent streaming completions go to a real ``ftengine
serve``; mid-generation a fault strikes (an injected transient error answered by ``retry``,
or a SIGKILLed rank answered by ``scale_down``); each stream is checked against the
single-process reference (``ftengine.testbed.bench.inflight_tally`` says what is counted). Every
scenario runs twice side by side, with token-level re-inference on and off (``serve
--no-reinference``: a fault aborts what was in flight), each on its own server. The same
for real vLLM's retry and scale-down: ``ftengine.testbed.bench.inflight_vllm``."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from ftengine.testbed.bench.inflight_serve import MODEL, Server
from ftengine.testbed.bench.inflight_stream import Stream, join_all, start_streams, wait_streaming
from ftengine.testbed.bench.inflight_tally import durations, tally, targets_met
from ftengine.testbed.bench.inflight_vllm import VllmRun, vllm_rows
from ftengine.testbed.vllm.cpu_wait import CPU_WAITS, naps

PROMPTS = ((1, 2, 3, 4), (5, 6, 7), (8, 9, 10, 11, 12), (13, 14), (3, 1, 4, 1, 5, 9), (100, 7))
MODES = {"reinference": (), "no_reinference": ("--no-reinference",)}


@attrs.frozen
class InflightOptions:
    """The run: ``dp_size`` ranks, ``tokens`` per request, the injected fault at rank 1's
    model step ``fault_step`` (retry; counted from the server's start, one-token warm-up
    request included), the op timeout (seconds), the bound on each stream
    (``stream_timeout`` seconds); the vLLM rows run on ``vllm_checkpoint`` (none: not
    measured), rank r's server on ``vllm_port + r``, each deployment's rank logs under
    ``vllm_log_dir`` (kept: a row that lost a request can be read afterwards), their queue
    waits by ``cpu_wait`` (``yield``, vLLM's own, or ``nap``: ``DeploymentConfig.cpu_nap``)."""

    dp_size: int = attrs.field(default=4, validator=attrs.validators.ge(2))
    tokens: int = attrs.field(default=40, validator=attrs.validators.ge(4))
    fault_step: int = attrs.field(default=20, validator=attrs.validators.ge(1))
    op_timeout: float = 2.0
    stream_timeout: float = 150.0
    vllm_checkpoint: Path | None = None
    vllm_port: int = 8720
    vllm_log_dir: Path = Path("vllm-bench-logs/inflight")
    cpu_wait: str = attrs.field(default="yield", validator=attrs.validators.in_(CPU_WAITS))

    def serve_args(self, mode: str, *extra: str) -> list[str]:
        return [
            "--dp-size", str(self.dp_size), "--op-timeout", str(self.op_timeout),
            *MODES[mode], *extra,
        ]  # fmt: skip


@attrs.frozen
class Round:
    """One round of streams and when the fault struck (``time.monotonic``; inf: none)."""

    streams: list[Stream]
    fault_s: float = float("inf")


Launch = Callable[[str, Sequence[str]], Server]
"""``(name, serve flags) -> a started server`` (its home folder named ``name``)."""


class Bench:
    """The runs of one benchmark on one checkpoint and its reference tokens."""

    def __init__(self, options: InflightOptions, reference: Sequence[Sequence[int]]) -> None:
        self.options = options
        self.reference = [list(r) for r in reference]

    def streams(self, server: Server) -> list[Stream]:
        o = self.options
        return start_streams(server.url, MODEL, PROMPTS, o.tokens, o.stream_timeout)

    def warm_up(self, server: Server) -> None:
        """One one-token request, so that no measured round pays the first step's costs."""
        o = self.options
        join_all(start_streams(server.url, MODEL, PROMPTS[:1], 1, o.stream_timeout), 60.0)

    def baseline(self, server: Server) -> list[float]:
        """Each prompt's fault-free duration in one concurrent round (all must complete)."""
        streams = self.streams(server)
        join_all(streams, self.options.stream_timeout)
        took = durations(streams)
        if not all(s.completed for s in streams) or None in took:
            raise RuntimeError(f"expected a fault-free round, found {[s.error for s in streams]}")
        return [t for t in took if t is not None]

    def retry_round(self, server: Server) -> Round:
        """Streams run into rank 1's injected fault; once every engine is UNHEALTHY, retry."""
        streams = self.streams(server)
        fault_s = server.wait(lambda e: all(x["status"] == "unhealthy" for x in e.values()), 60)
        server.command("retry", {}, "bench-inflight-retry")
        join_all(streams, self.options.stream_timeout)
        # The injected fault strikes inside a worker: the first sign of it is the status
        # turning UNHEALTHY or, without re-inference, an aborted stream, whichever came first.
        broken = [s.end_s for s in streams if not s.completed and s.end_s is not None]
        return Round(streams, min([fault_s, *broken]))

    def scale_down_round(self, server: Server) -> Round:
        """Streams run; the highest rank is SIGKILLed mid-generation; once it is DEAD (and the
        others UNHEALTHY), ``scale_down`` removes it."""
        victim = self.options.dp_size - 1
        pid = server.pid_of(victim)
        streams = self.streams(server)
        wait_streaming(streams, 2, 60.0)
        fault_s = time.monotonic()
        os.kill(pid, signal.SIGKILL)  # a worker of the server this benchmark started
        server.wait(lambda e: e[victim]["status"] == "dead", 60)
        server.command("scale_down", {"removed_dp_ranks": [victim]}, "bench-inflight-down")
        join_all(streams, self.options.stream_timeout)
        return Round(streams, fault_s)

    def row(self, baseline: Sequence[float], fault: Round) -> dict[str, Any]:
        counts = tally(fault.streams, self.reference, fault.fault_s, baseline)
        return {**counts, "targets_met": targets_met(counts)}


def cluster_rows(bench: Bench, launch: Launch) -> dict[str, dict[str, Any]]:
    """``{retry, scale_down} x {reinference, no_reinference}`` on the CPU cluster, each on a
    warmed-up server of its own. Baselines come from the same server: the round before the
    SIGKILL (after it the cluster has a rank less), the round after the retry (the injected
    fault fires once; before it, a round would use up the model steps it counts)."""
    rows: dict[str, dict[str, Any]] = {"retry": {}, "scale_down": {}}
    step = f"rank=1,step={bench.options.fault_step},kind=raise"
    for mode in MODES:
        server = launch(f"{mode}-scale-down", bench.options.serve_args(mode))
        try:
            bench.warm_up(server)
            baseline = bench.baseline(server)
            rows["scale_down"][mode] = bench.row(baseline, bench.scale_down_round(server))
        finally:
            server.stop()
        server = launch(f"{mode}-retry", bench.options.serve_args(mode, "--inject-fault", step))
        try:
            bench.warm_up(server)
            fault = bench.retry_round(server)
            rows["retry"][mode] = bench.row(bench.baseline(server), fault)
        finally:
            server.stop()
    return rows


def setup(options: InflightOptions) -> dict[str, Any]:
    """The run's options as JSON values (paths as strings), with the number of prompts."""

    def plain(_instance: object, _field: object, value: object) -> object:
        return str(value) if isinstance(value, Path) else value

    return {**attrs.asdict(options, value_serializer=plain), "prompts": len(PROMPTS)}


def run_inflight(options: InflightOptions, checkpoint: Path) -> dict[str, Any]:
    """Run every measured scenario on ``checkpoint``; the benchmark's JSON object."""
    from ftengine.testbed.cluster import reference_generate

    reference = [g.token_ids for g in reference_generate(checkpoint, PROMPTS, options.tokens)]
    bench = Bench(options, reference)
    with tempfile.TemporaryDirectory(prefix="ftengine-inflight-") as scratch:

        def launch(name: str, args: Sequence[str]) -> Server:
            return Server(Path(scratch) / name, checkpoint, args)

        cluster = cluster_rows(bench, launch)
    vllm = vllm_rows(_vllm_run(options), PROMPTS)
    # The targets are re-inference's; the rows without it show what it saves.
    measured = [rows["reinference"] for rows in (*cluster.values(), *vllm.values())
                if isinstance(rows, dict)]  # fmt: skip
    return {
        "benchmark": "inflight",
        "setup": setup(options),
        "cluster": cluster,
        "vllm": vllm,
        "targets_met": all(row["targets_met"] for row in measured),
    }


def _vllm_run(options: InflightOptions) -> VllmRun | None:
    o = options
    if o.vllm_checkpoint is None:
        return None
    return VllmRun(
        o.vllm_checkpoint,
        o.vllm_port,
        o.tokens,
        max(o.stream_timeout, 240.0),
        o.vllm_log_dir,
        cpu_nap=naps(o.cpu_wait),
    )
