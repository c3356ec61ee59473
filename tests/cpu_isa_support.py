"""Run a Python process as if on a smaller x86-64 CPU (see ``tests/cpu_isa/sitecustomize.py``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SITE_DIR = Path(__file__).parent / "cpu_isa"
ISAS = ("avx2", "avx512")


def simulated_cpu_env(isa: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that make a child Python see an ``isa`` CPU (``avx2``: no AVX-512 at all;
    ``avx512``: AVX-512 without BF16 or AMX), ``PYTHONPATH`` kept behind the simulation's
    folder."""
    if isa not in ISAS:
        raise ValueError(f"unknown simulated CPU {isa!r}: expected one of {ISAS}")
    base = os.environ if base is None else base
    path = os.pathsep.join(p for p in (str(SITE_DIR), base.get("PYTHONPATH", "")) if p)
    return {"FTENGINE_TEST_CPU_ISA": isa, "ATEN_CPU_CAPABILITY": isa, "PYTHONPATH": path}


def host_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The x86 feature flags of this host's first CPU (empty where /proc/cpuinfo has none)."""
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()
