"""RankSentinel: the one glue object between a RecoveryEngine, a device Backend and the
host worker (the CPU cluster worker, the NPU worker, the vLLM adapter).

The host gives the sentinel a :class:`HostedBackend`: its device backend composed with a
:class:`WorkerHooks` object (clean its state, run a dummy batch of its model, reach its
expert layers), a subclass where the host has steps of its own (the vLLM worker's
``VllmHostedBackend``). The sentinel hands that backend to the engine, turns exceptions the
host catches into :class:`~ftengine.faults.Fault` records, and relays orchestrator commands. It
owns no threads and knows nothing about any particular cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from ftengine.backends.base import Backend
from ftengine.backends.delegating import DelegatingBackend
from ftengine.clock import Clock, MonotonicClock
from ftengine.collective_errors import classify_exception as classify_exception  # re-exported
from ftengine.commands import CommandResult
from ftengine.context import RedundancyFacts
from ftengine.engine import RecoveryEngine
from ftengine.faults import Fault, FaultKind, HealthStatus, Phase
from ftengine.policies import Policy
from ftengine.status import EngineStatus, PhaseChange

logger = logging.getLogger(__name__)


class WorkerHooks(Protocol):
    """What a host worker lets the sentinel do to it."""

    def clean_state(self) -> None:
        """Drop in-flight requests and per-request state (KV caches, batch bookkeeping).

        Runs while peers may be dead or hung, so it must not issue a collective.
        """

    def run_dummy_batch(self) -> None:
        """Run one full model step on dummy input through every collective (lockstep)."""

    def expert_layers(self) -> Sequence[object]:
        """The host's MoE layers, opaque to the sentinel (a backend may need them)."""


class HostedBackend(DelegatingBackend):
    """The backend the engine drives: the device backend plus the host's hooks.

    ``quarantine`` also cleans the host's state, and ``run_dummy_batch`` runs the
    host's full model step (which goes through the device backend's collectives)
    instead of the backend's model-less one. Everything else is the device backend's.
    A host with steps of its own subclasses it (one wrapper, the hooks passed once).
    """

    def __init__(self, backend: Backend, hooks: WorkerHooks) -> None:
        super().__init__(backend)
        self.hooks = hooks

    def quarantine(self, fault: Fault) -> None:
        super().quarantine(fault)
        self.hooks.clean_state()

    def run_dummy_batch(self) -> None:
        self.hooks.run_dummy_batch()


class RankSentinel:
    """Joins a policy and a hosted backend (a device backend and its host worker) into one
    recovering worker.

    ``rank`` / ``world_size`` are original DP ranks. ``engine`` is the RecoveryEngine
    it built (the host may ``subscribe`` to it); call ``report_fault`` from the host's
    exception handlers, ``report`` for faults learnt some other way (a supervisor saw
    a peer exit), ``run_command`` for orchestrator commands and ``poll`` every
    ~50 ms from the host's loop.
    """

    def __init__(
        self,
        policy: Policy,
        backend: HostedBackend,
        *,
        rank: int = 0,
        world_size: int = 1,
        clock: Clock | None = None,
        redundancy: RedundancyFacts | None = None,
        rejoining: bool = False,
    ) -> None:
        self.rank = rank
        self.clock: Clock = clock if clock is not None else MonotonicClock()
        self.backend = backend
        self.engine = RecoveryEngine(
            policy,
            self.backend,
            rank=rank,
            world_size=world_size,
            clock=self.clock,
            redundancy=redundancy,
            rejoining=rejoining,
        )

    @property
    def phase(self) -> Phase:
        return self.engine.phase

    @property
    def health(self) -> HealthStatus:
        return self.engine.health

    @property
    def serving(self) -> bool:
        """True while the worker may run real steps (running or healthy)."""
        return self.engine.phase.serving

    def report_fault(self, exc: BaseException, step: int | None = None) -> Fault:
        """Classify ``exc`` (caught by the host at model ``step``) and report it.

        A peer fault carries no rank (the exception does not say which peer); a local
        fault carries this worker's rank. Returns the Fault reported.
        """
        kind = classify_exception(exc)
        local = kind in (FaultKind.TRANSIENT, FaultKind.DEVICE_ERROR)
        fault = Fault(
            kind=kind,
            rank=self.rank if local else None,
            step=step,
            info=type(exc).__name__,
            at=self.clock.now(),
        )
        logger.warning(
            "fault on worker",
            extra={"rank": self.rank, "step": step, "kind": kind.value, "error": str(exc)},
        )
        self.report(fault)
        return fault

    def report(self, fault: Fault) -> None:
        """Hand a fault learnt by other means to the engine (it quarantines and decides)."""
        self.engine.report_fault(fault)

    def peer_fault(
        self, kind: FaultKind, rank: int | None, info: str, step: int | None = None
    ) -> None:
        """Report a fault learnt from outside, e.g. a supervisor saw peer ``rank`` exit."""
        self.report(Fault(kind=kind, rank=rank, step=step, info=info, at=self.clock.now()))

    def run_command(
        self, instruction: str, params: Mapping[str, object], request_id: str
    ) -> CommandResult:
        """Run an orchestrator command (``retry`` / ``scale_down``) to the end."""
        return self.engine.apply(instruction, params, request_id)

    def poll(self) -> None:
        """Let the engine run its time-driven decisions (due retries, deadlines) and the
        policy's admission of ready ranks (call it at a step boundary)."""
        self.engine.poll()

    def note_ready(self, ranks: frozenset[int]) -> None:
        """The host's word on which removed ranks wait, loaded, to be admitted."""
        self.engine.note_ready(ranks)

    def loaded(self, removed: frozenset[int] | None = None, epoch: int | None = None) -> None:
        """A returning worker (``rejoining=True``) loaded its weights: it is ready."""
        self.engine.loaded(removed, epoch)

    def status(self) -> EngineStatus:
        return self.engine.status()

    def subscribe(self, listener: Callable[[PhaseChange], None]) -> None:
        """Call ``listener`` on every phase change of the engine."""
        self.engine.subscribe(listener)
