"""The recovery steps as data: one table of the backend actions the engine runs (the call, its
timeline step, the phases it may run in, whether it opens an epoch), the retry and
scale-down sequences read from it, the pending time-driven decisions and the plan of a run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import attrs

from ftengine.backends.base import Backend, RepairReport
from ftengine.errors import TransitionError
from ftengine.faults import Fault, Phase


@attrs.frozen
class StepArgs:
    """What a step's backend call may read: the fault being handled, the cumulative
    ``removed`` ranks, the ``alive`` ranks the groups span and the current ``epoch``."""

    fault: Fault
    removed: frozenset[int]
    alive: frozenset[int]
    epoch: int


BackendCall = Callable[[Backend, StepArgs], RepairReport | None]


@attrs.frozen
class Step:
    """One backend action: ``action`` (the ``Backend`` method), ``timeline`` (its step name
    in the timeline and the metrics), ``call``, the phases it ``runs_in`` and whether it
    opens a new process-group epoch first."""

    action: str
    timeline: str
    call: BackendCall = attrs.field(repr=False)
    runs_in: frozenset[Phase]
    new_epoch: bool = False


def _quarantine(backend: Backend, args: StepArgs) -> None:
    backend.quarantine(args.fault)


def _reset_device(backend: Backend, args: StepArgs) -> None:
    backend.reset_device()


def _mask_ranks(backend: Backend, args: StepArgs) -> None:
    backend.mask_ranks(args.removed)


def _rebuild_groups(backend: Backend, args: StepArgs) -> None:
    backend.rebuild_groups(args.alive, args.epoch)


def _repair_experts(backend: Backend, args: StepArgs) -> RepairReport:
    return backend.repair_experts(args.removed)


def _run_dummy_batch(backend: Backend, args: StepArgs) -> None:
    backend.run_dummy_batch()


_Q, _T, _S = Phase.QUARANTINED, Phase.RETRYING, Phase.SCALING_DOWN

# Every backend action the engine ever starts. A recovery phase runs the rows that name it,
# in table order: retry = reset_device, rebuild_groups, run_dummy_batch; scale-down =
# mask_ranks, rebuild_groups, repair_experts, run_dummy_batch.
STEPS: tuple[Step, ...] = (
    Step("quarantine", "quarantine", _quarantine, frozenset({_Q})),
    Step("reset_device", "device_reset", _reset_device, frozenset({_T})),
    Step("mask_ranks", "mask", _mask_ranks, frozenset({_S})),
    Step("rebuild_groups", "comm_rebuild", _rebuild_groups, frozenset({_T, _S}), new_epoch=True),
    Step("repair_experts", "expert_repair", _repair_experts, frozenset({_S})),
    Step("run_dummy_batch", "validate", _run_dummy_batch, frozenset({_T, _S})),
)
STEP: Mapping[str, Step] = MappingProxyType({step.action: step for step in STEPS})
QUARANTINE = STEP["quarantine"]


def sequence(phase: Phase) -> tuple[Step, ...]:
    """The steps a run in ``phase`` takes, in order (empty outside a recovery phase)."""
    return tuple(step for step in STEPS if phase.recovering and phase in step.runs_in)


# The backend actions the engine may start in each phase; nothing else ever runs.
ALLOWED_ACTIONS: Mapping[Phase, frozenset[str]] = MappingProxyType(
    {phase: frozenset(s.action for s in STEPS if phase in s.runs_in) for phase in Phase}
)
RETRY_ACTIONS = tuple(step.action for step in sequence(Phase.RETRYING))
SCALE_DOWN_ACTIONS = tuple(step.action for step in sequence(Phase.SCALING_DOWN))


def check_allowed(step: Step, phase: Phase) -> None:
    """Raise ``TransitionError`` unless ``step`` may run in ``phase``."""
    if phase not in step.runs_in:
        raise TransitionError(
            f"backend action {step.action!r} is not allowed in phase {phase.value!r}; "
            f"allowed there: {sorted(ALLOWED_ACTIONS[phase])} (an engine bug)"
        )


@attrs.frozen
class PendingRetry:
    """A policy's retry, due at ``due`` (engine clock s)."""

    due: float


@attrs.frozen
class PendingScaleDown:
    """A policy's scale-down of ``ranks`` (added to the removed ones), due at ``due``."""

    due: float
    ranks: frozenset[int]


@attrs.frozen
class Deadline:
    """The orchestrator's deadline: without a command by ``due`` the engine dies."""

    due: float


# A time-driven decision waiting in ``quarantined``.
Pending = PendingRetry | PendingScaleDown | Deadline


@attrs.frozen
class RecoveryPlan:
    """One recovery run. ``removed`` is the cumulative removed set once it succeeds, ``alive``
    the ranks its groups span, ``fault`` the latest fault of the episode it answers;
    ``token`` tells whether the engine still belongs to it."""

    token: int
    phase: Phase
    attempt: int
    removed: frozenset[int]
    alive: frozenset[int]
    fault: Fault
    steps: tuple[Step, ...]

    def args(self, epoch: int) -> StepArgs:
        """The arguments of this run's backend calls in ``epoch``."""
        return StepArgs(self.fault, self.removed, self.alive, epoch)
