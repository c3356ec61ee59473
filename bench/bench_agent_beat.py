"""CPU of one engine-core agent thread against a real TCPStore; prints one JSON object.

Usage: ``PYTHONPATH=. python bench/bench_agent_beat.py [SECONDS]`` (it reuses the unit tests'
stand-in engine core). One agent (rank 0 of DP=2 and DP=4; its peers' statuses are on the
store, rewritten every ``PUBLISH_S`` by a client of their own) runs its own thread loop for
``SECONDS`` (default 10) at its real tick (``BEAT_S``); its engine core's one worker is this
process (its ``/proc`` entry is read every tick). The store is hosted in this process, as DP
rank 0 hosts vLLM's DP store. Beside it a thread multiplies matrices, as an engine core's
busy loop and its workers fill the caches: a tick that wakes on cold caches costs several
times what a tight loop of ticks does. Per DP size: the agent thread's CPU in ms per second
(``time.thread_time`` in that thread), the whole process's (agent, store server, peers,
matrices: ``process_ms_per_s``, for scale) and the peer reads done.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import torch
from torch._C._distributed_c10d import TCPStore

from ftengine.integrations.vllm.engine_core.agent import EngineCoreAgent
from ftengine.integrations.vllm.engine_core.dp_board import KEY, PUBLISH_S
from tests.unit.test_vllm_engine_agent import Sentinel, agent_for


def busy(stop: threading.Event) -> None:
    """What the engine core's process does meanwhile, as far as the caches see it."""
    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    while not stop.is_set():
        a = (a @ a).tanh_()


def peers_beat(store: TCPStore, world: int, stop: threading.Event) -> None:
    """The peers' engine cores, alive: each writes a new beat every ``PUBLISH_S``."""
    beat = 1
    while not stop.wait(PUBLISH_S):
        beat += 1
        for rank in range(1, world):
            value = {"status": "healthy", "beat": beat, "epoch": 0}
            store.set(KEY.format(rank=rank), json.dumps(value))


def agent_cpu(world: int, seconds: float) -> dict[str, float]:
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    for rank in range(1, world):
        store.set(KEY.format(rank=rank), json.dumps({"status": "healthy", "beat": 1, "epoch": 0}))
    sentinel = Sentinel(rank=0, world=world)
    sentinel.engine.dp_store = store
    worker = SimpleNamespace(proc=SimpleNamespace(pid=os.getpid()))
    sentinel.engine.model_executor.workers = [worker]
    agent: EngineCoreAgent = agent_for(sentinel)
    beats: list[int] = []
    cpu: list[float] = []

    def run() -> None:
        start = time.thread_time()
        agent._run()
        cpu.append(time.thread_time() - start)

    stop = threading.Event()
    matrices = threading.Thread(target=busy, args=(stop,), daemon=True)
    matrices.start()
    peers = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
    threading.Thread(target=peers_beat, args=(peers, world, stop), daemon=True).start()
    thread = threading.Thread(target=run, daemon=True)
    process = time.process_time()
    thread.start()
    time.sleep(seconds)
    agent.stop()
    thread.join()
    beats.append(agent._beat)
    stop.set()
    matrices.join()
    return {
        "agent_ms_per_s": cpu[0] / seconds * 1e3,
        "process_ms_per_s": (time.process_time() - process) / seconds * 1e3,
        "peer_reads": float(beats[0]),
    }


if __name__ == "__main__":
    span = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    print(json.dumps({f"dp{world}": agent_cpu(world, span) for world in (2, 4)}))
