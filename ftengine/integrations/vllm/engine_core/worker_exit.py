"""Whether an engine core's worker process was killed, from ``/proc`` (Linux), before its
sockets close: what the engine-core agent's early ``dead`` report rests on.

Read every agent tick (20 ms), so it is one ``pread`` of a kept-open ``/proc`` file per
worker (the leader thread's own ``stat``: no sum over the worker's threads), not an
``open`` / ``read`` / ``close`` of the whole process's: on a loaded 2-core machine that
was ~150 us of the agent's ~400 us per tick (``bench/bench_agent_beat.py``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

PF_EXITING = 0x4  # Linux task flag, set as a task starts to exit (include/linux/sched.h)
SIGKILL_PENDING = 1 << (signal.SIGKILL - 1)  # its bit in a task's pending-signal mask
FLAGS, PENDING = 6, 28  # /proc/PID/stat fields 9 and 31, counted from the state (field 3)
HAS_PROC = Path("/proc/self/stat").exists()
_open: dict[int, int] = {}
"""pid -> an open descriptor of ``/proc/PID/task/PID/stat`` (bound to that process, so a
reused pid never reads as the old worker; closed once the process is gone)."""


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of the leader's ``stat`` after the command name (state first), None if
    the process is gone."""
    fd = _open.get(pid)
    try:
        if fd is None:
            fd = _open[pid] = os.open(f"/proc/{pid}/task/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        raw = os.pread(fd, 1024, 0)
    except OSError:
        raw = b""
    if not raw:
        if fd is not None:
            os.close(_open.pop(pid))
        return None
    return raw.rpartition(b")")[2].decode("ascii").split(None, PENDING + 1)[: PENDING + 1]


def exiting(pid: int) -> bool:
    """Whether process ``pid`` is gone, a zombie, has begun to exit, or holds a SIGKILL.

    ``kill -9`` marks SIGKILL pending on every thread of the process at once, before any of
    them runs again (a loaded machine may not schedule the leader for a while); once the
    leader handles it, it carries ``PF_EXITING``, then it is a zombie. The kernel closes the
    process's sockets and pipes only after its memory is unmapped (1.6 GB here: 0.3-2 s on
    a loaded 2-core machine), and that close is when vLLM's worker monitor and the
    survivors' collectives first notice."""
    fields = _proc_stat(pid)
    if fields is None:
        return True
    if fields[0] in ("Z", "X") or int(fields[FLAGS]) & PF_EXITING:
        return True
    return len(fields) > PENDING and bool(int(fields[PENDING]) & SIGKILL_PENDING)


def worker_dying(executor: Any) -> bool:
    """Whether a worker process of ``executor`` (vLLM's ``MultiprocExecutor``) was killed
    (one ``/proc`` read per worker and tick; never on a system without /proc)."""
    if not HAS_PROC or getattr(executor, "shutting_down", False):
        return False  # a deployment that is stopping: its workers exit on purpose
    for handle in getattr(executor, "workers", None) or ():
        pid = getattr(getattr(handle, "proc", None), "pid", None)
        if pid is not None and exiting(int(pid)):
            return True
    return False
