"""``ftengine bench vllm``'s scale-down figures: SIGKILL of the last rank's worker mid-traffic,
``scale_down`` to every survivor, and the interruption until every survivor answers correctly
again, against a cold restart of the same deployment.

Each trial is one launch: the launch itself is the cold restart (processes started from
nothing to the first completion, with the checkpoint in the page cache, as a restart right
after a failure would find it), then the fault. The reloads and bytes come from each
survivor's ``[FT] EP rank R adopted N experts (B bytes); lower bound L`` log line.
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

from ftengine.integrations.vllm.launcher import VllmDeployment


class Client(Protocol):
    """What the trials use of ``bench.Client``."""

    deployment: VllmDeployment
    http: httpx.Client

    def complete(self, rank: int, tokens: int = ..., timeout: float = ...) -> dict[str, object]: ...

    def wait(self, want: Callable[[dict[int, str]], bool], timeout_s: float) -> float: ...


Launch = Callable[[int], VllmDeployment]
"""Start launch number ``i`` of the benchmark's FT-on deployment (``bench._launch``)."""
MakeClient = Callable[[VllmDeployment], Client]

ADOPTED = re.compile(r"EP rank (\d+) adopted (\d+) experts \((\d+) bytes\); lower bound (\d+)")
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


def adopted(log: Path) -> tuple[int, int, int]:
    """(reloads, bytes, lower bound) from one rank's log (zeros if it adopted nothing)."""
    found = ADOPTED.findall(log.read_text(errors="replace")) if log.exists() else []
    if not found:
        return 0, 0, 0
    _rank, reloads, read, bound = found[-1]
    return int(reloads), int(read), int(bound)


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


def trial(launch: Launch, make_client: MakeClient, index: int) -> Trial:
    """One launch of the deployment, one fault, one scale-down."""
    started = time.monotonic()
    with launch(index) as deployment:
        client = make_client(deployment)
        client.complete(0)
        cold = time.monotonic() - started
        victim = deployment.config.dp_size - 1
        interruption, match = kill_and_scale_down(client, victim)
        logs = [rank.log_path for rank in deployment.ranks if rank.rank != victim]
        counts = [adopted(log) for log in logs]
    return Trial(
        cold_restart_s=cold,
        interruption_s=interruption,
        reloads=sum(c[0] for c in counts),
        reload_lower_bound=max(c[2] for c in counts),
        bytes_reloaded=sum(c[1] for c in counts),
        outputs_match=match,
    )


def _summary(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "max": max(values), "n": len(values)}


def scale_down_figures(launch: Launch, make_client: MakeClient, count: int) -> dict[str, object]:
    """``count`` launches, measured: the figures ``bench vllm`` reports."""
    trials = [trial(launch, make_client, i) for i in range(count)]
    interruption = _summary([t.interruption_s for t in trials])
    cold = _summary([t.cold_restart_s for t in trials])
    return {
        "scale_down_interruption_s": interruption,
        "cold_restart_s": cold,
        "interruption_over_restart": interruption["median"] / cold["median"],
        "reloads": trials[-1].reloads,
        "reload_lower_bound": trials[-1].reload_lower_bound,
        "bytes_reloaded": trials[-1].bytes_reloaded,
        "outputs_match_after_scale_down": all(t.outputs_match for t in trials),
    }
