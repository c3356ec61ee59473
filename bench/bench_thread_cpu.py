"""Per-thread CPU of the vLLM engine cores and workers running on this machine, over a window;
prints one JSON object.

Usage: ``python bench/bench_thread_cpu.py [SECONDS] [PORT ...]`` (default 15 s, every
deployment). Each process (``VLLM::EngineCore*`` / ``VLLM::Worker*``, named by the HTTP port
of the API server above it; only the given ports if any) gets its total and its busiest
threads: CPU run time and run-queue wait in ms per second (``/proc/PID/task/TID/schedstat``)
and voluntary / involuntary context switches per second (``.../status``). What found the
engine-core agent's cost (docs/notebook.md, "Found: the agent's own CPU on cold
caches"): the agent is the small Python thread named like its process.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

ROLES = ("VLLM::EngineCor", "VLLM::Worker")  # comm is cut at 15 characters
Counters = tuple[str, int, int, int, int]  # thread name, run ns, wait ns, vol, invol


def _read(path: str) -> str:
    return Path(path).read_text()


def port_of(pid: int) -> str:
    """The ``--port`` of the nearest API server above ``pid`` ("?" if none)."""
    for _ in range(4):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"--port" in argv:
                return argv[argv.index(b"--port") + 1].decode()
            pid = int(_read(f"/proc/{pid}/stat").rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return "?"
    return "?"


def engine_processes(ports: list[str]) -> dict[int, str]:
    """pid -> "comm port" of every engine core and worker (of ``ports``, if any)."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            comm = _read(f"/proc/{entry}/comm").strip()
        except OSError:
            continue
        port = port_of(int(entry)) if comm.startswith(ROLES) else ""
        if port and (not ports or port in ports):
            found[int(entry)] = f"{comm} {port}"
    return found


def threads(pid: int) -> dict[int, Counters]:
    counters: dict[int, Counters] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            run, wait = (int(v) for v in _read(f"{base}/schedstat").split()[:2])
            status, name = _read(f"{base}/status"), _read(f"{base}/comm").strip()
        except (OSError, ValueError):
            continue
        vol = re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M)
        invol = re.search(r"nonvoluntary_ctxt_switches:\s+(\d+)", status)
        if vol and invol:
            counters[int(tid)] = (name, run, wait, int(vol[1]), int(invol[1]))
    return counters


def per_second(before: Counters, after: Counters, seconds: float) -> dict[str, object]:
    return {
        "name": after[0],
        "run_ms_per_s": (after[1] - before[1]) / 1e6 / seconds,
        "wait_ms_per_s": (after[2] - before[2]) / 1e6 / seconds,
        "voluntary_per_s": (after[3] - before[3]) / seconds,
        "involuntary_per_s": (after[4] - before[4]) / seconds,
    }


def sample(seconds: float, ports: list[str]) -> dict[str, object]:
    processes = engine_processes(ports)
    before = {pid: threads(pid) for pid in processes}
    time.sleep(seconds)
    result: dict[str, object] = {"seconds": seconds, "loadavg": os.getloadavg()}
    for pid, label in processes.items():
        try:
            after = threads(pid)
        except OSError:
            continue
        rows = [
            per_second(before[pid][t], c, seconds) for t, c in after.items() if t in before[pid]
        ]
        rows.sort(key=lambda row: -float(str(row["run_ms_per_s"])))
        total = sum(float(str(row["run_ms_per_s"])) for row in rows)
        result[f"{pid} {label}"] = {"total_ms_per_s": total, "threads": rows[:6]}
    return result


if __name__ == "__main__":
    span = float(sys.argv[1]) if len(sys.argv) > 1 else 15.0
    print(json.dumps(sample(span, sys.argv[2:]), indent=1))
