"""The recovery steps as data: one table of the backend actions the engine runs (the call, its
timeline step, the phases it may run in, whether it opens an epoch or commits the run's
removed set), the retry, scale-down and scale-up sequences read from it, the pending
time-driven decisions and the plan of a run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import attrs

from ftengine.backends.base import Backend, RepairReport
from ftengine.backends.delegating import admit_ranks
from ftengine.errors import TransitionError
from ftengine.faults import Fault, Phase


@attrs.frozen
class StepArgs:
    """What a step's backend call may read: the fault being handled, the cumulative
    ``removed`` ranks, the ``alive`` ranks the groups span, the current ``epoch`` and, in
    a scale-up, the ranks being ``added`` back (``removed`` is then the set after it)."""

    fault: Fault | None
    removed: frozenset[int]
    alive: frozenset[int]
    epoch: int
    added: frozenset[int] = frozenset()


BackendCall = Callable[[Backend, StepArgs], RepairReport | None]


@attrs.frozen
class Step:
    """One backend action: ``action`` (the ``Backend`` method), ``timeline`` (its step name
    in the timeline and the metrics), ``call``, the phases it ``runs_in`` and whether it
    opens a new process-group epoch first; ``commits``: once it returns, the run's
    ``removed`` set is the engine's, even if a later step fails (the backend now serves
    that membership)."""

    action: str
    timeline: str
    call: BackendCall = attrs.field(repr=False)
    runs_in: frozenset[Phase]
    new_epoch: bool = False
    commits: bool = False


def _quarantine(backend: Backend, args: StepArgs) -> None:
    if args.fault is None:
        raise TransitionError("quarantine without a fault (an engine bug)")
    backend.quarantine(args.fault)


def _reset_device(backend: Backend, args: StepArgs) -> None:
    backend.reset_device()


def _mask_ranks(backend: Backend, args: StepArgs) -> None:
    backend.mask_ranks(args.removed)


def _rebuild_groups(backend: Backend, args: StepArgs) -> None:
    backend.rebuild_groups(args.alive, args.epoch)


def _repair_experts(backend: Backend, args: StepArgs) -> RepairReport:
    return backend.repair_experts(args.removed)


def _admit_ranks(backend: Backend, args: StepArgs) -> RepairReport:
    return admit_ranks(backend, args.added, args.removed)


def _run_dummy_batch(backend: Backend, args: StepArgs) -> None:
    backend.run_dummy_batch()


_Q, _T, _S = Phase.QUARANTINED, Phase.RETRYING, Phase.SCALING_DOWN
_U, _J = Phase.SCALING_UP, Phase.JOINING
RUN_PHASES = frozenset({_T, _S, _U, _J})
"""The phases a run of steps owns the worker in (a recovery or an admission)."""

# Every backend action the engine ever starts. A run's phase runs the rows that name it,
# in table order: retry = reset_device, rebuild_groups, run_dummy_batch; scale-down =
# mask_ranks, rebuild_groups, repair_experts, run_dummy_batch; scale-up (the survivors'
# scaling_up and the returning rank's joining alike) = rebuild_groups (the new membership,
# a fresh epoch), admit_ranks (un-mask, experts back, placement agreed over the new group;
# commits the removed set), run_dummy_batch.
STEPS: tuple[Step, ...] = (
    Step("quarantine", "quarantine", _quarantine, frozenset({_Q})),
    Step("reset_device", "device_reset", _reset_device, frozenset({_T})),
    Step("mask_ranks", "mask", _mask_ranks, frozenset({_S})),
    Step(
        "rebuild_groups",
        "comm_rebuild",
        _rebuild_groups,
        frozenset({_T, _S, _U, _J}),
        new_epoch=True,
    ),
    Step("repair_experts", "expert_repair", _repair_experts, frozenset({_S})),
    Step("admit_ranks", "admit", _admit_ranks, frozenset({_U, _J}), commits=True),
    Step("run_dummy_batch", "validate", _run_dummy_batch, frozenset({_T, _S, _U, _J})),
)
STEP: Mapping[str, Step] = MappingProxyType({step.action: step for step in STEPS})
QUARANTINE = STEP["quarantine"]


def sequence(phase: Phase) -> tuple[Step, ...]:
    """The steps a run in ``phase`` takes, in order (empty outside a run phase)."""
    return tuple(step for step in STEPS if phase in RUN_PHASES and phase in step.runs_in)


# The backend actions the engine may start in each phase; nothing else ever runs.
ALLOWED_ACTIONS: Mapping[Phase, frozenset[str]] = MappingProxyType(
    {phase: frozenset(s.action for s in STEPS if phase in s.runs_in) for phase in Phase}
)
RETRY_ACTIONS = tuple(step.action for step in sequence(Phase.RETRYING))
SCALE_DOWN_ACTIONS = tuple(step.action for step in sequence(Phase.SCALING_DOWN))
SCALE_UP_ACTIONS = tuple(step.action for step in sequence(Phase.SCALING_UP))


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
    """One run. ``removed`` is the cumulative removed set once it succeeds, ``alive`` the
    ranks its groups span, ``fault`` the latest fault of the episode it answers (None for
    an admission, which answers no fault), ``added`` the ranks a scale-up admits;
    ``token`` tells whether the engine still belongs to it."""

    token: int
    phase: Phase
    attempt: int
    removed: frozenset[int]
    alive: frozenset[int]
    fault: Fault | None
    steps: tuple[Step, ...]
    added: frozenset[int] = frozenset()

    def args(self, epoch: int) -> StepArgs:
        """The arguments of this run's backend calls in ``epoch``."""
        return StepArgs(self.fault, self.removed, self.alive, epoch, self.added)
