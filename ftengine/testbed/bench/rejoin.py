"""``ftengine bench rejoin``: a removed rank comes back (``scale_up``) under traffic, measured.

One result shape for every target: ``rejoin_pause_s`` (the longest wait
between two chunks of a survivor's stream that the admission caused), ``rejoin_total_s``
(restart command to every rank healthy), ``throughput_after_over_before`` (the full
deployment after the rejoin against before the fault, 1 = as before), ``requests_lost``,
``outputs_match`` (every stream against the fault-free reference), ``survivor_reloads``.

Targets: ``cluster`` (the CPU test bed, ``rejoin_cluster``) and ``vllm`` (real vLLM,
``rejoin_vllm``: the victim's server restarted with its original command, then ``scale_up``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ftengine.testbed.bench.rejoin_cluster import run_cluster
from ftengine.testbed.bench.rejoin_measure import (
    RejoinBenchError,
    RejoinSetup,
    Stream,
    longest_gap,
    pause_caused,
    summarize_ratio,
)
from ftengine.testbed.bench.rejoin_vllm import run_vllm

__all__ = [
    "TARGETS",
    "RejoinBenchError",
    "RejoinSetup",
    "Stream",
    "longest_gap",
    "pause_caused",
    "run_target",
    "run_vllm",
    "summarize_ratio",
]

TARGETS = ("cluster", "vllm")


def run_target(target: str, setup: RejoinSetup, options: Mapping[str, Any]) -> dict[str, Any]:
    """Run ``target`` and return its JSON-able result."""
    runners: dict[str, Callable[[RejoinSetup, Mapping[str, Any]], dict[str, Any]]] = {
        "cluster": run_cluster,
        "vllm": run_vllm,
    }
    if target not in runners:
        raise RejoinBenchError(f"unknown target {target!r}: expected one of {list(TARGETS)}")
    return runners[target](setup, options)
