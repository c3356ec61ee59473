"""The engine cores' DP group let go of on a fault, so peers waiting in it fail at once.

vLLM's DP engine cores share a gloo group of their own (``engine.dp_group``, apart from the
workers'): its all-reduce of the DP state (``ParallelConfig.sync_dp_state``) runs at the
first step of a wave and every ``dp_sync_interval`` steps. A peer that faulted at such a
step leaves the others blocked in that all-reduce until the per-op timeout (measured: a
step error on rank 1 held ranks 0 and 2 for the whole 5 s op timeout, streams waiting 7-18
s). The worker side closes its DP group on a fault (``worker/hooks.close_dp_group``); this
is the engine core's half: as the fault reaches ``on_fault``, before vLLM makes the engine
UNHEALTHY (so that no recovery can have rebuilt the group yet: closing the new one would
fault the recovered peers), the group is replaced by a
:class:`ClosedDpGroup` and the real one destroyed and let go of (the fault's finished
frames first release what they held of it), so gloo closes its connections and every peer
waiting in it fails with "Connection closed by peer", a peer's fault.

The engine core's busy loop runs no collective between its fault and the recovery (vLLM's
``fault_tolerant_wrapper`` parks it on ``resumed``); ``retry`` and ``scale_down`` replace
the group (vLLM's ``_reinit_dp_group`` destroys the old one first: the stand-in accepts
that, as it accepts vLLM's own destroy at shutdown); a collective on it raises.
"""

from __future__ import annotations

import logging
import traceback
import weakref
from typing import Any

from ftengine.integrations.vllm.messages import import_vllm

logger = logging.getLogger(__name__)

UTILS_MODULE = "vllm.distributed.utils"


class ClosedDpGroup:
    """Where a faulted engine core's DP group stood until a recovery rebuilds it: vLLM's
    destroy (``shutdown``, then unregistering ``group_name``) does nothing; any collective
    on it raises, naming why."""

    group_name = ""

    def __init__(self, rank: int) -> None:
        self.rank_closed = rank

    def shutdown(self) -> None:
        """vLLM's ``stateless_destroy_torch_distributed_process_group`` calls it: nothing
        is left to shut down."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle, hasattr probes: no such attribute
            raise AttributeError(name)
        raise RuntimeError(
            f"[FT] engine {self.rank_closed}'s DP group was closed after a fault ({name!r} "
            "on it); a retry or scale_down rebuilds it"
        )


def close_dp_group(engine: Any, rank: int, exc: BaseException | None = None) -> bool:
    """Let go of ``engine``'s DP group after a fault (``exc``: its finished frames release
    the group first, if they held it). Whether a group was closed (False: none, or closed
    already)."""
    group = getattr(engine, "dp_group", None)
    if group is None or isinstance(group, ClosedDpGroup):
        return False
    chained, seen = exc, set()
    while chained is not None and id(chained) not in seen:  # and what it wraps
        seen.add(id(chained))
        traceback.clear_frames(chained.__traceback__)
        chained = chained.__cause__ or chained.__context__
    engine.dp_group = ClosedDpGroup(rank)
    held = weakref.ref(group)
    try:
        import_vllm(UTILS_MODULE).stateless_destroy_torch_distributed_process_group(group)
    except Exception:  # torch already shut it down: letting go of it is what closes it
        logger.debug("[FT] engine %d: its DP group's destroy failed", rank, exc_info=True)
    del group
    if held() is not None:
        logger.warning(
            "[FT] engine %d: DP group closed, but it is still referenced: peers waiting "
            "in its all-reduce wait for the op timeout",
            rank,
        )
    else:
        logger.info("[FT] engine %d: DP group closed", rank)
    return True
