"""``bench rejoin --target cluster``: the CPU test bed (a DP cluster behind its serving loop).

Throughput of the full cluster (``trials`` batches), SIGKILL of ``victim`` and its
``scale_down``, ``streams`` long streams started on the survivors, then ``victim``'s worker
restarted with its original spec (it loads while they serve), announced ready between two
steps and admitted (``scale_up``, or the ``auto`` policy); the streams run on to the end
and are checked against the single-process reference; throughput again with every rank.
"""

from __future__ import annotations

import signal
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftengine.testbed.bench.rejoin_measure import (
    RejoinBenchError,
    RejoinSetup,
    Stream,
    header,
    pause_caused,
    summarize_ratio,
)
from ftengine.testbed.cluster import Cluster, ClusterConfig, reference_generate
from ftengine.testbed.cluster.serving import ServingLoop
from ftengine.testbed.serving_api import GenerationRequest, TokenEvent
from ftengine.weights.checkpoint_gen import make_checkpoint

SIZES: dict[str, Any] = {
    "layers": 2,
    "experts": 8,
    "hidden": 64,
    "intermediate": 32,
    "vocab": 128,
    "heads": 4,
    "kv_heads": 2,
    "top_k": 2,
    "seed": 7,
}
PROMPTS: tuple[tuple[int, ...], ...] = (
    (1, 2, 3, 4),
    (5, 6, 7),
    (8, 9, 10, 11, 12),
    (13, 14),
    (3, 1, 4, 1, 5, 9),
    (100, 7),
)
WAIT_S = 120.0


class _Recorder:
    """A stream's listener: chunk times and tokens, set ``done`` at its last event."""

    def __init__(self, prompt: tuple[int, ...]) -> None:
        self.prompt = prompt
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.detail: str | None = None
        self.done = threading.Event()

    def __call__(self, event: TokenEvent) -> None:
        if event.token_ids:
            self.times.append(time.monotonic())
            self.tokens.extend(event.token_ids)
        if event.finished:
            reason = event.finish_reason
            self.finish, self.detail = (None if reason is None else reason.value), event.detail
            self.done.set()

    def stream(self) -> Stream:
        return Stream(self.prompt, tuple(self.times), tuple(self.tokens), self.finish, self.detail)


def _submit(loop: ServingLoop, prompt: tuple[int, ...], tokens: int) -> _Recorder:
    recorder = _Recorder(prompt)
    loop.submit(GenerationRequest(prompt, tokens), recorder)
    return recorder


def _throughput(loop: ServingLoop, requests: int, tokens: int) -> float:
    """Generated tokens per second of one batch of ``requests`` concurrent requests."""
    start = time.monotonic()
    recorders = [_submit(loop, PROMPTS[i % len(PROMPTS)], tokens) for i in range(requests)]
    for recorder in recorders:
        if not recorder.done.wait(WAIT_S):
            raise RejoinBenchError("a throughput request did not finish in time")
    total = sum(len(r.tokens) for r in recorders)
    return total / (time.monotonic() - start)


def _wait(cluster: Cluster, what: str, predicate: Any) -> None:
    if cluster.wait_for(predicate, WAIT_S) is None:
        raise RejoinBenchError(f"expected {what} within {WAIT_S:g}s; status {cluster.status()}")


def _healthy_without(victim: int | None) -> Any:
    def check(status: Mapping[str, Any]) -> bool:
        engines = [e for e in status["engines"] if e["id"] != victim]
        return all(e["phase"] == "healthy" or e["phase"] == "running" for e in engines)

    return check


def run_cluster(setup: RejoinSetup, options: Mapping[str, Any]) -> dict[str, Any]:
    """Run the measurement on a fresh cluster; ``options["checkpoint"]`` (a directory, or
    None for a tiny generated one)."""
    checkpoint = options.get("checkpoint")
    with tempfile.TemporaryDirectory(prefix="ftengine-bench-rejoin-") as tmp:
        if checkpoint is None:
            checkpoint = make_checkpoint(Path(tmp) / "ckpt", **SIZES)
        config = ClusterConfig(
            Path(checkpoint), dp_size=setup.dp, policy=setup.policy, op_timeout_s=2.0
        )
        reference = reference_generate(checkpoint, PROMPTS, setup.stream_tokens)
        cluster = Cluster.launch(config)
        loop = ServingLoop(cluster, resumption=cluster.resumption()).start()
        try:
            return _measure(cluster, loop, setup, [g.token_ids for g in reference])
        finally:
            loop.close()
            cluster.shutdown()


def _measure(
    cluster: Cluster, loop: ServingLoop, setup: RejoinSetup, reference: list[tuple[int, ...]]
) -> dict[str, Any]:
    victim = setup.victim
    batch = (setup.batch_requests, setup.batch_tokens)
    for _ in range(3):  # warm-up (first batches pay one-off costs)
        _throughput(loop, *batch)
    before = [_throughput(loop, *batch) for _ in range(setup.trials)]

    cluster.kill(victim, signal.SIGKILL)
    _wait(cluster, f"rank {victim} detected", lambda s: victim in _dead_or_removed(s))
    if setup.policy != "auto":
        _wait(cluster, "the survivors unhealthy", lambda s: _all_unhealthy(s, victim))
        result = cluster.apply("scale_down", {"removed_dp_ranks": [victim]}, "bench-down")
        if not result.success:
            raise RejoinBenchError(f"scale_down failed: {result.reason}")
    _wait(cluster, f"rank {victim} removed", lambda s: victim in cluster.removed_ranks)
    _wait(cluster, "the survivors healthy", _healthy_without(victim))

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(setup.streams)]
    recorders = [_submit(loop, p, setup.stream_tokens) for p in prompts]
    deadline = time.monotonic() + WAIT_S
    while any(len(r.tokens) < 5 for r in recorders) and time.monotonic() < deadline:
        time.sleep(0.01)

    started = time.monotonic()
    loaded_s = cluster.restart(victim)
    admission_start = time.monotonic()
    in_flight = sum(not r.done.is_set() for r in recorders)
    if in_flight == 0:
        raise RejoinBenchError(
            "every stream ended before the admission: the pause would not be measured; "
            "raise --stream-tokens"
        )
    announced = cluster.announce_ready("bench-ready")
    if not announced.success:
        raise RejoinBenchError(f"announcing rank {victim} ready failed: {announced.reason}")
    if setup.policy != "auto":
        result = cluster.apply("scale_up", {"added_dp_ranks": [victim]}, "bench-up")
        if not result.success:
            raise RejoinBenchError(f"scale_up failed: {result.reason}")
    _wait(cluster, "every rank healthy", _healthy_without(None))
    finished = time.monotonic()
    for recorder in recorders:
        recorder.done.wait(WAIT_S)
    streams = [r.stream() for r in recorders]
    pause = pause_caused(streams, admission_start, finished)
    after = [_throughput(loop, *batch) for _ in range(setup.trials)]

    engines = {e["id"]: e for e in cluster.status()["engines"]}
    admissions = {r: e.get("last_admission") or {} for r, e in engines.items()}
    lost = [s for s in streams if s.finish_reason != "length"]
    refs = {p: ref for p, ref in zip(PROMPTS, reference, strict=True)}
    return {
        **header("cluster", setup, victim, in_flight, pause),
        "rejoin_total_s": round(finished - started, 4),
        "restart_to_ready_s": round(loaded_s, 4),
        "admission_s": round(finished - admission_start, 4),
        "admission_engine_s": {
            r: round(float(a["seconds"]), 4) for r, a in admissions.items() if a.get("seconds")
        },
        **summarize_ratio(before, after),
        "requests_lost": len(lost),
        "lost_details": [s.detail for s in lost],
        "outputs_match": all(s.tokens == refs[s.prompt] for s in streams),
        "survivor_reloads": sum(
            int(a.get("reloads", 0)) for r, a in admissions.items() if r != victim
        ),
        "returning_rank_reloads_at_admission": int(admissions[victim].get("reloads", 0)),
        "all_healthy": all(e["phase"] == "healthy" for e in engines.values()),
        "removed_ranks_after": sorted(cluster.removed_ranks),
    }


def _dead_or_removed(status: Mapping[str, Any]) -> set[int]:
    return {e["id"] for e in status["engines"] if e["status"] == 1 or not e["alive"]}


def _all_unhealthy(status: Mapping[str, Any], victim: int) -> bool:
    return all(e["status"] == 2 for e in status["engines"] if e["id"] != victim and e["alive"])
