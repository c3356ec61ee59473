"""Tokens per second of DP=2 vLLM deployments launched one at a time, one mode each; prints
one line per launch.

Usage (from a directory that is not the repository, so that each server imports ftengine
from ``PYTHONPATH`` or the installed package, not from its working directory)::

    cd /tmp && python /path/to/bench/bench_vllm_throughput.py CHECKPOINT MODE [MODE ...]

A MODE is ``off`` (no ``--enable-fault-tolerance``), ``on``, or ``on@DIR`` (FT on with
ftengine imported from ``DIR``, e.g. a ``git worktree`` of an older commit: before / after
in one run), each optionally followed by ``:NAME=VALUE;...`` for the servers' environment
(``on:FTENGINE_VLLM_BEAT_S=0.2``). Each launch: three warm-up completions, then 48-token
greedy completions to rank 0 back to back for ``SECONDS`` (env ``SECONDS``, default 40);
its figure is all tokens over all their seconds (no window rounding: a 5 s window holds
whole requests only, ~10 tok/s apart here), beside the figure of each half (the launch's
own drift) and the engine cores' thread counts (which code ran). Found the engine core's
wake-ups: docs/notebook.md, "The engine core's wake-ups".
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

from ftengine.testbed.bench.vllm import OP_TIMEOUT_S, Client
from ftengine.testbed.vllm.launcher import DeploymentConfig, VllmDeployment

TOKENS = 48


def launch(checkpoint: Path, spec: str, index: int) -> str:
    mode, _, environment = spec.partition(":")
    env = dict(kv.split("=", 1) for kv in environment.split(";") if kv)
    mode, _, source = mode.partition("@")
    if mode not in ("on", "off"):
        raise SystemExit(f"mode: expected on, off or on@DIR, found {spec!r}")
    if source:
        env["PYTHONPATH"] = source
    ft = mode == "on"
    options = {"ftengine": {"cpu_distributed_timeout_sec": OP_TIMEOUT_S}} if ft else {}
    config = DeploymentConfig(
        checkpoint,
        dp_size=2,
        port=8900,
        fault_tolerance=ft,
        dtype="float32",
        additional_config=options,
        env=env,
        log_dir=Path(f"vllm-throughput-logs/{index}"),
    )
    seconds = float(os.environ.get("SECONDS", "40"))
    with VllmDeployment.start(config) as deployment:
        client = Client(deployment, str(checkpoint))
        for _ in range(3):
            client.complete(0, TOKENS)
        durations: list[float] = []
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            began = time.monotonic()
            client.complete(0, TOKENS)
            durations.append(time.monotonic() - began)
        threads = {
            rank: len(os.listdir(f"/proc/{roles['engine_core']}/task"))
            for rank, roles in deployment.pids().items()
        }

    def rate(part: list[float]) -> float:
        return TOKENS * len(part) / sum(part)

    half = len(durations) // 2
    return (
        f"{spec}: {rate(durations):.1f} tok/s (halves {rate(durations[:half]):.1f}, "
        f"{rate(durations[half:]):.1f}; {len(durations)} completions, median "
        f"{statistics.median(durations) / TOKENS * 1000:.2f} ms/token); engine-core threads "
        f"{threads}"
    )


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    checkpoint = Path(argv[0])
    for index, spec in enumerate(argv[1:]):
        print(launch(checkpoint, spec, index), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
