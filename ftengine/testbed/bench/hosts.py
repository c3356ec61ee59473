"""``ftengine bench hosts``: real vLLM over three namespace hosts (DP=4 as 1 + 2 + 1, rank 0's
host holding vLLM's coordinator), ``"policy": "auto"``, no orchestrator; one JSON object.

Each trial is one deployment and its faults, in order:

- **Partition** {host 0, host 1} | {host 2} while two greedy streams run on every rank and
  new requests keep going to the minority's server: ``partition_detect_s`` (cut -> the
  majority's rank 0 reports ``unhealthy``), ``minority_stop_s`` (cut -> rank 3 reports
  ``dead``), ``partition_recovery_s`` (cut -> ranks 0-2 healthy with rank 3 removed),
  ``split_brain_answers`` (requests the minority answered in full after the cut: a stream
  or a new request ending ``length``), ``requests_lost_majority`` (majority streams that did
  not end with exactly the fault-free tokens), ``minority_requests_ended_with_reason``
  (of ``minority_requests``: the minority's held streams and refused new requests whose end
  names the partition).
- **Host loss**: host 1 (ranks 1 and 2) SIGKILLed while two streams run on rank 0:
  ``host_loss_detect_s`` (kill -> rank 0 ``unhealthy``), ``host_loss_interruption_s`` (kill
  -> rank 0 ``healthy`` again with both removed, in one scale-down), ``requests_lost_host_loss``.

- **Heal**: the partition undone and nothing restarted: rank 3's engine core, parked since
  the cut, reaches a majority again, relaunches its worker in place, announces itself on the
  survivors' DP store, and their ``auto`` policy admits it with no command:
  ``heal_to_all_serving_s`` (heal -> rank 3 and rank 0 ``healthy``, only host 1's ranks
  still removed; the new worker's load included), ``heal_admission_s`` (rank 3 ``ready``
  -> admitted), ``heal_restarts`` (servers restarted: 0), ``heal_requests_exact`` (of
  ``heal_requests``: streams on rank 3 and rank 0 afterwards with the fault-free tokens).
- **Coordinator's host lost**: host 0 SIGKILLed whole (the DP store in rank 0's engine
  core, vLLM's DP coordinator in its API server) while two streams run on rank 3, the one
  member left: ``coordinator_host_loss_detect_s`` (kill -> rank 3 ``unhealthy``),
  ``coordinator_host_loss_interruption_s`` (kill -> rank 3 ``healthy`` with ranks 0-2
  removed, through its own standby store), ``requests_lost_coordinator_host_loss``.

Detection is timed by polling each server's ``/fault_tolerance/status`` every 20 ms.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

from ftengine.testbed.vllm.cpu_wait import cpu_wait_name
from ftengine.testbed.vllm.hosts import HostLayout, MultiHostDeployment, leftovers
from ftengine.testbed.vllm.launcher import DeploymentConfig, _tree

LAYOUT = HostLayout((1, 2, 1))
MAJORITY_HOSTS, MINORITY_HOSTS = (0, 1), (2,)
MAJORITY, MINORITY = (0, 1, 2), 3
LOST_HOST, LOST_RANKS = 1, (1, 2)
PROMPTS = ([1, 2, 3, 4], [5, 6, 7])
POLL_S = 0.02
WAIT_S = 120.0


@attrs.frozen
class HostsBenchConfig:
    checkpoint: Path = attrs.field(converter=Path)
    trials: int = 1
    port: int = 8600
    stream_tokens: int = 48
    op_timeout_s: float = 5.0
    log_dir: Path = attrs.field(default=Path("vllm-bench-logs"), converter=Path)
    cpu_nap: bool = False
    """vLLM's queue waits nap instead of yield (``DeploymentConfig.cpu_nap``)."""


class Stream(threading.Thread):
    """One greedy streamed completion; its token ids, finish and stop reasons, error."""

    def __init__(self, url: str, model: str, prompt: Sequence[int], tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.prompt, self.max_tokens = url, model, list(prompt), tokens
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: object = None
        self.error: str | None = None

    def run(self) -> None:
        import json

        body = {
            "model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens,
            "stream": True, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
        }  # fmt: skip
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=300) as r:
                if r.status_code != 200:
                    self.error = f"{r.status_code} {r.read().decode(errors='replace')}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for choice in json.loads(line[6:]).get("choices", []):
                        self.tokens += list(choice.get("token_ids") or [])
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
                        self.stop_reason = choice.get("stop_reason") or self.stop_reason
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def says(self, word: str) -> bool:
        return word in f"{self.stop_reason} {self.error}"


def status(url: str, rank: int) -> dict[str, Any]:
    engines = httpx.get(f"{url}/fault_tolerance/status", timeout=10).json()["engines"]
    found: dict[str, Any] = next(e for e in engines if int(e["id"]) == rank)
    return found


def when(check: Callable[[], bool], timeout_s: float = WAIT_S) -> float:
    """The monotonic time ``check`` first held (polled every ``POLL_S``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return time.monotonic()
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s:.0f} s: {check}")
        time.sleep(POLL_S)


def started(streams: list[Stream]) -> list[Stream]:
    for stream in streams:
        stream.start()
    deadline = time.monotonic() + WAIT_S
    while not all(len(s.tokens) >= 2 for s in streams):
        if time.monotonic() > deadline:
            raise TimeoutError(f"streams did not start: {[len(s.tokens) for s in streams]}")
        time.sleep(0.01)
    return streams


def healthy_without(url: str, rank: int, removed: list[int]) -> Callable[[], bool]:
    def check() -> bool:
        found = status(url, rank)
        return bool(found["status"] == "healthy" and found["removed_ranks"] == removed)

    return check


def _trial(config: HostsBenchConfig, trial: int) -> dict[str, Any]:
    deployment = DeploymentConfig(
        config.checkpoint,
        dp_size=LAYOUT.dp_size,
        port=config.port,
        dtype="float32",
        additional_config={"ftengine": {"policy": "auto"}},
        log_dir=config.log_dir / f"trial{trial}",
        recovery_timeout_s=300.0,
        extra_args=("--cpu-distributed-timeout-seconds", str(int(config.op_timeout_s))),
        cpu_nap=config.cpu_nap,
    )
    model, n = str(config.checkpoint), config.stream_tokens
    begun = time.monotonic()
    spread = MultiHostDeployment.start(deployment, LAYOUT)
    startup_s = time.monotonic() - begun
    tag = spread.hosts.tag
    try:
        urls = spread.urls
        rss = sum(p.memory_info().rss for p in _tree([r.process.pid for r in spread.started.ranks]))
        reference = [
            s.tokens for s in _done(started([Stream(urls[0], model, p, n) for p in PROMPTS]))
        ]
        out: dict[str, Any] = {"startup_s": round(startup_s, 1), "rss_gb": round(rss / 2**30, 2)}
        out.update(_partition(spread, model, n, reference))
        out.update(_host_loss(spread, model, n, reference))
        out.update(_heal(spread, model, n, reference))
        out.update(_coordinator_host_loss(spread, model, n, reference))
    finally:
        spread.stop()
    out["leftovers"] = len(leftovers(tag))
    return out


def _done(streams: list[Stream], timeout_s: float = WAIT_S) -> list[Stream]:
    """Each stream ended, or the shared ``timeout_s`` passed (a stream still running then
    is counted as hung by the caller)."""
    deadline = time.monotonic() + timeout_s
    for stream in streams:
        stream.join(max(0.0, deadline - time.monotonic()))
    return streams


def _partition(
    spread: MultiHostDeployment, model: str, n: int, reference: list[list[int]]
) -> dict[str, Any]:
    urls = spread.urls
    majority = started([Stream(urls[r], model, p, n) for r in MAJORITY for p in PROMPTS])
    minority = started([Stream(urls[MINORITY], model, p, n) for p in PROMPTS])
    cut = spread.partition(MAJORITY_HOSTS, MINORITY_HOSTS)
    asked: list[Stream] = []
    stop = threading.Event()

    def keep_asking() -> None:  # new requests to the minority's server while it decides
        while not stop.is_set():
            asked.append(Stream(urls[MINORITY], model, PROMPTS[0], 4))
            asked[-1].start()
            stop.wait(0.25)

    asker = threading.Thread(target=keep_asking, daemon=True)
    asker.start()
    detect = when(lambda: status(urls[0], 0)["status"] != "healthy")
    stopped = when(lambda: status(urls[MINORITY], MINORITY)["status"] == "dead")
    time.sleep(1.0)  # a request asked after the stop is refused
    stop.set()
    asker.join()
    recovered = max(when(healthy_without(urls[r], r, [MINORITY])) for r in MAJORITY)
    _done(majority + minority + asked)
    lost = sum(
        s.finish_reason != "length" or s.tokens != reference[i % len(PROMPTS)]
        for i, s in enumerate(majority)
    )
    of_minority = minority + asked
    return {
        "partition_detect_s": round(detect - cut, 3),
        "minority_stop_s": round(stopped - cut, 3),
        "partition_recovery_s": round(recovered - cut, 3),
        "split_brain_answers": sum(s.finish_reason == "length" for s in of_minority),
        "requests_lost_majority": lost,
        "majority_requests": len(majority),
        "minority_requests": len(of_minority),
        "minority_requests_ended_with_reason": sum(s.says("partition") for s in of_minority),
        "minority_requests_hung": sum(s.is_alive() for s in of_minority),
        "minority_fault_info": status(urls[MINORITY], MINORITY).get("fault_info"),
    }


def _host_loss(
    spread: MultiHostDeployment, model: str, n: int, reference: list[list[int]]
) -> dict[str, Any]:
    urls = spread.urls
    running = started([Stream(urls[0], model, p, n) for p in PROMPTS])
    killed = spread.kill_host(LOST_HOST)
    detect = when(lambda: status(urls[0], 0)["status"] != "healthy")
    removed = sorted({*LOST_RANKS, MINORITY})
    recovered = when(healthy_without(urls[0], 0, removed))
    _done(running)
    log = spread.started.ranks[0].log_path.read_text(errors="replace")
    steps = [line for line in log.splitlines() if "survivors agree: scale down" in line]
    return {
        "host_loss_detect_s": round(detect - killed, 3),
        "host_loss_interruption_s": round(recovered - killed, 3),
        "host_loss_scale_downs": len(steps) - 1,  # the partition's was the first
        "requests_lost_host_loss": sum(
            s.finish_reason != "length" or s.tokens != reference[i] for i, s in enumerate(running)
        ),
    }


ADMITTABLE = ("ready", "healthy")
REJOIN_S = 600.0  # the new worker's whole load on 2 shared cores, then the admission


def _heal(
    spread: MultiHostDeployment, model: str, n: int, reference: list[list[int]]
) -> dict[str, Any]:
    """The cut undone, nothing restarted; until rank 3 and rank 0 serve with only the lost
    host's ranks removed; then the prompts streamed on both."""
    urls = spread.urls
    servers = {r: e["api_server"] for r, e in spread.started.pids().items()}
    healed = time.monotonic()
    spread.heal()
    # loading -> ready (started alone) -> healthy (admitted): the first answer past loading
    ready = when(lambda: status(urls[MINORITY], MINORITY)["phase"] in ADMITTABLE, REJOIN_S)

    def serving() -> bool:
        mine = status(urls[MINORITY], MINORITY)["status"] == "healthy"
        return mine and healthy_without(urls[0], 0, list(LOST_RANKS))()

    all_serving = when(serving, REJOIN_S)
    now = {r: e["api_server"] for r, e in spread.started.pids().items()}
    after = _done(started([Stream(urls[r], model, p, n) for r in (0, MINORITY) for p in PROMPTS]))
    return {
        "heal_to_all_serving_s": round(all_serving - healed, 3),
        "heal_admission_s": round(all_serving - ready, 3),
        "heal_restarts": sum(now[r] != pid for r, pid in servers.items()),
        "heal_requests": len(after),
        "heal_requests_exact": sum(
            s.finish_reason == "length" and s.tokens == reference[i % len(PROMPTS)]
            for i, s in enumerate(after)
        ),
    }


def _coordinator_host_loss(
    spread: MultiHostDeployment, model: str, n: int, reference: list[list[int]]
) -> dict[str, Any]:
    """Last: host 0 SIGKILLed whole (the DP store in rank 0's engine core, the coordinator in
    its API server): rank 3, the one member left, takes over on its own standby store."""
    urls = spread.urls
    running = started([Stream(urls[MINORITY], model, p, n) for p in PROMPTS])
    killed = spread.kill_host(0)
    detect = when(lambda: status(urls[MINORITY], MINORITY)["status"] != "healthy")
    recovered = when(healthy_without(urls[MINORITY], MINORITY, sorted({0, *LOST_RANKS})))
    _done(running)
    return {
        "coordinator_host_loss_detect_s": round(detect - killed, 3),
        "coordinator_host_loss_interruption_s": round(recovered - killed, 3),
        "requests_lost_coordinator_host_loss": sum(
            s.finish_reason != "length" or s.tokens != reference[i] for i, s in enumerate(running)
        ),
    }


SUMMED = ("split_brain_answers", "requests_lost_majority", "requests_lost_host_loss",
          "minority_requests", "minority_requests_ended_with_reason", "minority_requests_hung",
          "majority_requests", "leftovers", "heal_requests", "heal_requests_exact",
          "heal_restarts", "requests_lost_coordinator_host_loss")  # fmt: skip
TIMED = ("startup_s", "rss_gb", "host_loss_detect_s", "host_loss_interruption_s",
         "partition_detect_s", "minority_stop_s", "partition_recovery_s",
         "heal_to_all_serving_s", "heal_admission_s", "coordinator_host_loss_detect_s",
         "coordinator_host_loss_interruption_s")  # fmt: skip


def run(config: HostsBenchConfig) -> dict[str, Any]:
    """Every trial, then per timed field the median, min and max, and the sums."""
    trials = [_trial(config, t) for t in range(config.trials)]
    result: dict[str, Any] = {
        "layout": list(LAYOUT.ranks_per_host),
        "dp_size": LAYOUT.dp_size,
        "trials": len(trials),
        "op_timeout_s": config.op_timeout_s,
    }
    for key in TIMED:
        values = [t[key] for t in trials]
        result[key] = statistics.median(values)
        result[f"{key}_range"] = [min(values), max(values)]
    for key in SUMMED:
        result[key] = sum(t[key] for t in trials)
    result["cpu_wait"] = cpu_wait_name(config.cpu_nap)
    result["per_trial"] = trials
    return result
