"""CPU per engine-core agent beat against a real TCPStore; prints one JSON object.

Usage: ``PYTHONPATH=. python bench/bench_agent_beat.py [BEATS]`` (it reuses the unit tests'
stand-in engine core). One agent (rank 0 of DP=2 and DP=4, its peers' statuses already on
the store) beats ``BEATS`` times (default 3000); its engine core's one worker is this
process (one ``/proc`` read per beat). The store is hosted in this process, as DP rank 0
hosts vLLM's DP store, so its server thread's CPU counts. Per beat: CPU
(``time.process_time``) and wall microseconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from types import SimpleNamespace

from torch._C._distributed_c10d import TCPStore

from ftengine.integrations.vllm.dp_board import KEY
from ftengine.integrations.vllm.engine_agent import EngineCoreAgent
from tests.unit.test_vllm_engine_agent import Sentinel, agent_for


def per_beat(world: int, beats: int) -> dict[str, float]:
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    for rank in range(1, world):
        store.set(KEY.format(rank=rank), json.dumps({"status": "healthy", "beat": 1, "epoch": 0}))
    sentinel = Sentinel(rank=0, world=world)
    sentinel.engine.dp_store = store
    worker = SimpleNamespace(proc=SimpleNamespace(pid=os.getpid()))
    sentinel.engine.model_executor.workers = [worker]
    agent: EngineCoreAgent = agent_for(sentinel)
    for _ in range(50):  # warm-up: the first beats learn every peer is on the store
        agent._watch_peers()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(beats):
        agent._watch_peers()
    return {
        "cpu_us": (time.process_time() - cpu) / beats * 1e6,
        "wall_us": (time.perf_counter() - wall) / beats * 1e6,
    }


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    print(json.dumps({f"dp{world}": per_beat(world, count) for world in (2, 4)}))
