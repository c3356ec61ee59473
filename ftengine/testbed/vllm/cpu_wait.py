"""vLLM's shared-memory queue waits, made to nap instead of yield, for a deployment with more
busy processes than cores (this test bed's DP=3 on 2 cores).

vLLM's ``MessageQueue`` readers (the engine core waiting for its worker's answer, the worker
for its next step) spin on ``os.sched_yield()`` for a second after each message
(``shm_broadcast.SpinCondition``, through ``vllm.distributed.utils.sched_yield``). Under
Linux's EEVDF scheduler (6.6 on) each yield pushes the spinner's virtual deadline one slice
further, so where the spinners outnumber the cores the process that must act next waits
behind the others for up to seconds. Measured here (kernel 6.18, 2 cores, DP=3): a warm,
fault-free deployment's streams stalled up to 1.40-2.03 s between two tokens; with the
yield replaced by a 0.1 ms sleep, 0.06 s, and six times the throughput
(docs/results/rejoin.md). Opt-in (``DeploymentConfig.cpu_nap``): on dedicated cores the
spin is vLLM's choice and costs nothing.

How: a ``sitecustomize`` module first on each rank's ``PYTHONPATH`` replaces
``os.sched_yield`` when the interpreter starts, in every process of the rank (API server,
engine core, workers), before vLLM is imported; vLLM's wait looks ``os.sched_yield`` up at
each call. ``tests/unit/test_vllm_cpu_wait.py`` fails when vLLM waits some other way.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

NAP_S = 1e-4
DIR_NAME = "cpu-nap"
CPU_WAITS = ("yield", "nap")
"""The benches' ``--cpu-wait``: ``yield`` (vLLM's own) or ``nap`` (``DeploymentConfig.cpu_nap``)."""


def naps(cpu_wait: str | None) -> bool:
    """Whether the ``--cpu-wait`` choice ``cpu_wait`` is ``nap`` (``DeploymentConfig.cpu_nap``)."""
    return cpu_wait == CPU_WAITS[1]


def cpu_wait_name(cpu_nap: bool) -> str:
    """The ``cpu_wait`` a JSON records for a deployment's ``cpu_nap``."""
    return CPU_WAITS[1] if cpu_nap else CPU_WAITS[0]


SITECUSTOMIZE = f'''"""ftengine test bed (testbed/vllm/cpu_wait.py): os.sched_yield naps."""
import os
import time


def _nap() -> None:
    time.sleep({NAP_S!r})


os.sched_yield = _nap
'''


def nap_dir(root: Path) -> Path:
    """``root/cpu-nap`` holding the ``sitecustomize`` module (written, or rewritten)."""
    where = root / DIR_NAME
    where.mkdir(parents=True, exist_ok=True)
    (where / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return where


def with_nap(env: Mapping[str, str], root: Path) -> dict[str, str]:
    """``env`` with :func:`nap_dir` first on its ``PYTHONPATH`` (the rest kept after it)."""
    rest = env.get("PYTHONPATH", "")
    path = str(nap_dir(root).resolve())
    return {**env, "PYTHONPATH": f"{path}:{rest}" if rest else path}
