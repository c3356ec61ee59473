"""Every vLLM name ftengine's plugin replaces, installed from one place, by the process
each runs in: the engine core's (``engine_core.py``), the CPU worker's (``worker.py``), the
API server's (``api_server.py``).

:data:`PATCHES` names each replaced attribute with the parameters ftengine expects it to
have; ``tests/unit/test_vllm_patches.py`` fails when vLLM moves or changes one.
"""

from __future__ import annotations

import multiprocessing

from ftengine.integrations.vllm.api_server.ft_routes import guard_ft_routes
from ftengine.integrations.vllm.patches.api_server import API_SERVER_PATCHES, SCALE_DOWN_PATCHES
from ftengine.integrations.vllm.patches.engine_core import ENGINE_CORE_PATCHES, SCALE_DOWN_METHOD
from ftengine.integrations.vllm.patches.mechanism import apply_patches
from ftengine.integrations.vllm.patches.worker import CPU_PATCHES, REJOIN_WORKER_PATCHES

PATCHES = (
    ENGINE_CORE_PATCHES
    + CPU_PATCHES
    + REJOIN_WORKER_PATCHES
    + SCALE_DOWN_PATCHES
    + API_SERVER_PATCHES
)


def apply_scale_down_patches() -> None:
    """``scale_down`` in vLLM's router and engine-core sentinel (idempotent). The router is
    patched only in a main process (an API server): vLLM's engine cores and workers are its
    children, and importing the FastAPI router there only costs them time."""
    SCALE_DOWN_METHOD.install()
    if multiprocessing.parent_process() is None:
        apply_patches(SCALE_DOWN_PATCHES)


def apply_cpu_patches() -> None:
    """The CPU platform's DP+EP pieces (:data:`CPU_PATCHES`); in vLLM's child processes
    (engine cores, workers: the API server never builds a worker) the rejoining worker's
    distributed start-up (:data:`REJOIN_WORKER_PATCHES`)."""
    apply_patches(CPU_PATCHES)
    if multiprocessing.parent_process() is not None:
        apply_patches(REJOIN_WORKER_PATCHES)


def apply_engine_core_patches() -> None:
    """ftengine's engine-core agent (:data:`ENGINE_CORE_PATCHES`) and ``scale_down``."""
    apply_patches(ENGINE_CORE_PATCHES)
    apply_scale_down_patches()


def apply_api_server_patches() -> None:
    """In a main process (an API server; vLLM's engine cores and workers are its children):
    the FT routes behind the API key, the start-up warning when they answer anyone, and
    finished streams that always say how they ended (:data:`API_SERVER_PATCHES`)."""
    if multiprocessing.parent_process() is None:
        guard_ft_routes()
        apply_patches(API_SERVER_PATCHES)
