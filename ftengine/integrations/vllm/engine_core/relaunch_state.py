"""Where DP rank 0's in-place worker relaunch stands (``relaunch.py``), as the status and
``scale_up`` read it."""

from __future__ import annotations

from typing import Any

import attrs

RELAUNCH_ATTR = "_ftengine_relaunch"
"""On ``EngineCoreSentinel``: the :class:`Relaunch` under way or failed (None otherwise)."""
LOADING, FAILED = "loading", "failed"
FAILED_WORDS = "relaunching it failed"
"""In a failed relaunch's ``fault_info``: the rank stays DEAD until its server restarts."""


@attrs.define
class Relaunch:
    """An in-place relaunch: ``phase`` :data:`LOADING` or :data:`FAILED`, and why."""

    phase: str
    reason: str


def relaunch_status(engine: Any) -> dict[str, object]:
    """Status fields of an engine core relaunching its worker (``dead``, phase ``loading``)
    or whose relaunch failed (``dead``, the reason); empty otherwise."""
    state = getattr(getattr(engine, "ft_sentinel", None), RELAUNCH_ATTR, None)
    if not isinstance(state, Relaunch):
        return {}
    phase = LOADING if state.phase == LOADING else "dead"
    return {"status": "dead", "phase": phase, "fault_info": state.reason}
