"""vLLM's engine-core process entry, with ftengine's rejoin patch installed first.

vLLM loads its general plugins (ftengine's patches with them) in ``EngineCore.__init__``,
which a DP engine core reaches only after its start-up handshake and
``DPEngineCoreProc._init_data_parallel``: too late for a restarted rank, whose DP start must
differ (``engine_core/rejoin.py``). The API server starts each engine core with
``EngineCoreProc.run_engine_core`` as the process target; ftengine puts :func:`run_engine_core`
there (``patches/api_server.py``), a module-level function, so the spawned process unpickles
it by this module's name, installs :data:`REJOIN_ENGINE_CORE_PATCHES` and runs vLLM's own.
"""

from __future__ import annotations

import logging
from typing import Any

from ftengine.integrations.vllm.messages import import_vllm
from ftengine.integrations.vllm.patches.mechanism import PATCHED_MARK, VllmSeamMoved, apply_patches

logger = logging.getLogger(__name__)

CORE_MODULE = "vllm.v1.engine.core"


def run_engine_core(*args: Any, dp_rank: int = 0, local_dp_rank: int = 0, **kwargs: Any) -> None:
    """``EngineCoreProc.run_engine_core`` with the rejoin patch installed first."""
    from ftengine.integrations.vllm.patches.engine_core import REJOIN_ENGINE_CORE_PATCHES

    entry = import_vllm(CORE_MODULE).EngineCoreProc.run_engine_core
    try:
        apply_patches(REJOIN_ENGINE_CORE_PATCHES)
    except VllmSeamMoved as exc:  # a restarted rank then cannot rejoin; nothing else changes
        logger.error("[FT] ftengine's rejoin patch is off for this vLLM version: %s", exc)
    vllm_entry = getattr(entry, PATCHED_MARK, entry)
    vllm_entry(*args, dp_rank=dp_rank, local_dp_rank=local_dp_rank, **kwargs)


def as_process_entry(original: Any) -> Any:
    """A :class:`~ftengine.integrations.vllm.patches.mechanism.Patch`'s ``make``: the
    static method vLLM's process manager reads as its target (:func:`run_engine_core`)."""
    setattr(run_engine_core, PATCHED_MARK, original)
    return staticmethod(run_engine_core)
