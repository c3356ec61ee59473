"""Whether an engine core's worker process was killed, from ``/proc`` (Linux), before its
sockets close: what the engine-core agent's early ``dead`` report rests on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PF_EXITING = 0x4  # Linux task flag, set as a task starts to exit (include/linux/sched.h)
HAS_PROC = Path("/proc/self/stat").exists()


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def exiting(pid: int) -> bool:
    """Whether process ``pid`` is gone, a zombie, or has begun to exit.

    A SIGKILLed worker's thread-group leader shows the kill at once: it is a zombie, or,
    if it is the thread that tears the process down, it carries ``PF_EXITING``. The kernel
    closes the process's sockets and pipes only after its memory is unmapped (1.6 GB here:
    0.3-2 s on a loaded 2-core machine), and that close is when vLLM's worker monitor and
    the survivors' collectives first notice."""
    fields = _proc_stat(pid)
    if fields is None:
        return True
    return fields[0] in ("Z", "X") or bool(int(fields[6]) & PF_EXITING)


def worker_dying(executor: Any) -> bool:
    """Whether a worker process of ``executor`` (vLLM's ``MultiprocExecutor``) was killed
    (one ``/proc/PID/stat`` read per worker and beat; never on a system without /proc)."""
    if not HAS_PROC or getattr(executor, "shutting_down", False):
        return False  # a deployment that is stopping: its workers exit on purpose
    for handle in getattr(executor, "workers", None) or ():
        pid = getattr(getattr(handle, "proc", None), "pid", None)
        if pid is not None and exiting(int(pid)):
            return True
    return False
