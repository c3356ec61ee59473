"""The recovery sequences: which backend actions a retry and a scale-down run, in which order,
which phase allows which action, and the plan one recovery run follows."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import attrs

from ftengine.backends.base import Backend, RepairReport
from ftengine.faults import Fault, Phase

RETRY_ACTIONS = ("reset_device", "rebuild_groups", "run_dummy_batch")
SCALE_DOWN_ACTIONS = ("mask_ranks", "rebuild_groups", "repair_experts", "run_dummy_batch")
# The backend actions the engine may start in each phase; nothing else ever runs.
ALLOWED_ACTIONS: Mapping[Phase, frozenset[str]] = {
    Phase.RUNNING: frozenset(),
    Phase.QUARANTINED: frozenset({"quarantine"}),
    Phase.RETRYING: frozenset(RETRY_ACTIONS),
    Phase.SCALING_DOWN: frozenset(SCALE_DOWN_ACTIONS),
    Phase.HEALTHY: frozenset(),
    Phase.DEAD: frozenset(),
}


@attrs.frozen
class Pending:
    """A time-driven decision waiting in ``quarantined`` until ``due`` (engine clock s)."""

    kind: Literal["retry", "scale_down", "deadline"]
    due: float
    ranks: frozenset[int] = frozenset()


@attrs.frozen
class RecoveryPlan:
    """One recovery run. ``removed`` is the cumulative removed set once it succeeds, ``alive``
    the ranks its groups span; ``token`` tells whether the engine still belongs to it."""

    token: int
    phase: Phase
    attempt: int
    removed: frozenset[int]
    alive: frozenset[int]
    actions: tuple[str, ...]


_CALLS: Mapping[str, Callable[[Backend, RecoveryPlan, int], RepairReport | None]] = {
    "reset_device": lambda backend, plan, epoch: backend.reset_device(),
    "mask_ranks": lambda backend, plan, epoch: backend.mask_ranks(plan.removed),
    "rebuild_groups": lambda backend, plan, epoch: backend.rebuild_groups(plan.alive, epoch),
    "repair_experts": lambda backend, plan, epoch: backend.repair_experts(plan.removed),
    "run_dummy_batch": lambda backend, plan, epoch: backend.run_dummy_batch(),
}


def invoke(backend: Backend, action: str, plan: RecoveryPlan, epoch: int) -> RepairReport | None:
    """Call one of the plan's backend actions with the plan's arguments."""
    return _CALLS[action](backend, plan, epoch)


def fault_text(fault: Fault) -> str:
    """``"dead_peer fault on rank 3 (PeerDead)"`` for logs and reasons."""
    rank = "" if fault.rank is None else f" on rank {fault.rank}"
    info = f" ({fault.info})" if fault.info else ""
    return f"{fault.kind.value} fault{rank}{info}"
