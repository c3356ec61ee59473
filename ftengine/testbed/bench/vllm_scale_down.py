"""``ftengine bench vllm``'s scale-down figures: SIGKILL of the last rank's worker mid-traffic,
``scale_down`` to every survivor, and the interruption until every survivor answers correctly
again, against a cold restart of the same deployment.

Each trial is one launch: the launch itself is the cold restart (processes started from
nothing to the first completion, with the checkpoint in the page cache, as a restart right
after a failure would find it), then the fault. The reloads and bytes come from each
survivor's ``[FT] EP rank R adopted N experts (B bytes); lower bound L`` log line.

Each trial index launches both placements, interleaved: ftengine's default (survivors grow
their expert tensors from the checkpoint) and failure-aware (standby copies loaded at
start-up, ``experts_standby``; the survivors activate them in place). Their start-up memory
is the largest worker's resident set after the first completion.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import attrs
import httpx
import psutil

from ftengine.backends.npu_config import PLACEMENTS
from ftengine.testbed.vllm.launcher import VllmDeployment


class Client(Protocol):
    """What the trials use of ``bench.Client``."""

    deployment: VllmDeployment
    http: httpx.Client

    def complete(self, rank: int, tokens: int = ..., timeout: float = ...) -> dict[str, object]: ...

    def wait(self, want: Callable[[dict[int, str]], bool], timeout_s: float) -> float: ...


Launch = Callable[[int, str], VllmDeployment]
"""Start launch number ``i`` of the benchmark's FT-on deployment with ftengine's placement
``p`` (``ftengine.placement``: "default" or "failure-aware"; ``bench._launch``)."""
MakeClient = Callable[[VllmDeployment], Client]

ADOPTED = re.compile(r"EP rank (\d+) adopted (\d+) experts \((\d+) bytes\); lower bound (\d+)")
ACTIVATED = re.compile(r"EP rank (\d+) activated (\d+) standby expert copies")
STANDBY = re.compile(r"EP rank (\d+) holds (\d+) standby expert copies \((\d+) bytes")
STREAM_TOKENS = 8
SETTLE_S = 1.0  # traffic runs this long before the kill


@attrs.frozen
class Trial:
    """One launch: cold start, interruption, what the survivors reloaded, answers."""

    cold_restart_s: float
    interruption_s: float
    reloads: int
    reload_lower_bound: int
    bytes_reloaded: int
    outputs_match: bool
    worker_rss_mib: float = 0.0
    standby_copies: int = 0
    standby_bytes: int = 0
    activated: int = 0


def adopted(log: Path) -> tuple[int, int, int]:
    """(reloads, bytes, lower bound) from one rank's log (zeros if it adopted nothing)."""
    found = ADOPTED.findall(log.read_text(errors="replace")) if log.exists() else []
    if not found:
        return 0, 0, 0
    _rank, reloads, read, bound = found[-1]
    return int(reloads), int(read), int(bound)


def standby(log: Path) -> tuple[int, int, int]:
    """(standby copies loaded at start-up, their bytes, copies the last scale-down activated)
    from one rank's log (zeros without failure-aware placement)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    held, activated = STANDBY.findall(text), ACTIVATED.findall(text)
    copies, read = (int(held[-1][1]), int(held[-1][2])) if held else (0, 0)
    return copies, read, int(activated[-1][1]) if activated else 0


def _stream(client: Client, rank: int, stop: threading.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            client.complete(rank, timeout=30.0)


def _first_answer(client: Client, rank: int, timeout_s: float) -> tuple[float, object]:
    """``time.monotonic()`` when ``rank`` first completes a request again, and its text."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            choice = client.complete(rank, timeout=30.0)
            if choice.get("finish_reason") != "abort":
                return time.monotonic(), choice["text"]
        time.sleep(0.01)
    raise TimeoutError(f"rank {rank} completed no request within {timeout_s} s")


def kill_and_scale_down(client: Client, victim: int) -> tuple[float, bool]:
    """SIGKILL ``victim``'s worker mid-traffic, scale down on every survivor; seconds from
    the kill to the last survivor's first completed answer, and whether every survivor's
    answer equals its answer before the fault."""
    deployment = client.deployment
    survivors = [r for r in range(deployment.config.dp_size) if r != victim]
    before = {r: client.complete(r)["text"] for r in survivors}
    stop = threading.Event()
    streams = [threading.Thread(target=_stream, args=(client, r, stop)) for r in survivors]
    for stream in streams:
        stream.start()
    time.sleep(SETTLE_S)
    worker = deployment.pids()[victim]["worker"]
    killed = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    try:
        client.wait(lambda s: all(s.get(r) == "unhealthy" for r in survivors), 60)
    finally:
        stop.set()
    body = {"instruction": "scale_down", "params": {"removed_dp_ranks": [victim]}}
    for rank in survivors:
        client.http.post(f"{deployment.urls[rank]}/fault_tolerance/apply", json=body)
    answers = {r: _first_answer(client, r, 120) for r in survivors}
    for stream in streams:
        stream.join(timeout=60)
    last = max(at for at, _text in answers.values())
    return last - killed, all(answers[r][1] == before[r] for r in survivors)


def worker_rss_mib(deployment: VllmDeployment) -> float:
    """The largest resident set of the deployment's workers, MiB (after start-up)."""
    for _ in range(20):  # a process title can be unreadable for a moment on a loaded host
        workers = [pids.get("worker") for pids in deployment.pids().values()]
        if all(workers):
            break
        time.sleep(0.5)
    found = [psutil.Process(pid).memory_info().rss for pid in workers if pid]
    return max(found, default=0) / 2**20


def trial(launch: Launch, make_client: MakeClient, index: int, placement: str) -> Trial:
    """One launch of the deployment with ftengine's ``placement``, one fault, one scale-down."""
    started = time.monotonic()
    with launch(index, placement) as deployment:
        client = make_client(deployment)
        client.complete(0)
        cold = time.monotonic() - started
        rss = worker_rss_mib(deployment)
        victim = deployment.config.dp_size - 1
        interruption, match = kill_and_scale_down(client, victim)
        logs = [rank.log_path for rank in deployment.ranks]
        counts = [adopted(log) for r, log in enumerate(logs) if r != victim]
        copies = [standby(log) for log in logs]
    return Trial(
        cold_restart_s=cold,
        interruption_s=interruption,
        reloads=sum(c[0] for c in counts),
        reload_lower_bound=max(c[2] for c in counts),
        bytes_reloaded=sum(c[1] for c in counts),
        outputs_match=match,
        worker_rss_mib=rss,
        standby_copies=sum(c[0] for c in copies),
        standby_bytes=sum(c[1] for c in copies),
        activated=sum(c[2] for c in copies),
    )


def _summary(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "max": max(values), "n": len(values)}


def figures(trials: Sequence[Trial]) -> dict[str, object]:
    """One placement's figures over its launches."""
    interruption = _summary([t.interruption_s for t in trials])
    cold = _summary([t.cold_restart_s for t in trials])
    last = trials[-1]
    return {
        "scale_down_interruption_s": interruption,
        "cold_restart_s": cold,
        "interruption_over_restart": interruption["median"] / cold["median"],
        "reloads": last.reloads,
        "reload_lower_bound": last.reload_lower_bound,
        "bytes_reloaded": last.bytes_reloaded,
        "outputs_match_after_scale_down": all(t.outputs_match for t in trials),
        "startup_worker_rss_mib": _summary([t.worker_rss_mib for t in trials]),
        "standby_copies": last.standby_copies,
        "standby_bytes": last.standby_bytes,
        "standby_copies_activated": last.activated,
    }


def scale_down_figures(launch: Launch, make_client: MakeClient, count: int) -> dict[str, object]:
    """``count`` launches of each placement, interleaved (default, failure-aware, default,
    ...) so both see the same machine: the default's figures at the top level (survivors
    grow their expert tensors), failure-aware placement's under ``"failure_aware"``."""
    runs: dict[str, list[Trial]] = {p: [] for p in PLACEMENTS}
    for index in range(count):
        for offset, placement in enumerate(PLACEMENTS):
            runs[placement].append(trial(launch, make_client, 2 * index + offset, placement))
    return {**figures(runs["default"]), "failure_aware": figures(runs["failure-aware"])}
