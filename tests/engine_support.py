"""A recovery engine on a FakeBackend and a ManualClock, with its phase changes collected."""

from __future__ import annotations

import attrs

from ftengine.backends.fake import FakeBackend
from ftengine.clock import ManualClock
from ftengine.context import RedundancyFacts
from ftengine.engine import PhaseChange, RecoveryEngine
from ftengine.faults import Fault, FaultKind, Phase
from ftengine.policies import OrchestratorDriven, Policy


@attrs.define
class Rig:
    """The engine under test and everything it touches."""

    engine: RecoveryEngine
    backend: FakeBackend
    clock: ManualClock
    changes: list[PhaseChange]

    def phases(self) -> list[Phase]:
        """Every phase entered so far, in order."""
        return [change.dest for change in self.changes]

    def poll_after(self, seconds: float) -> Phase:
        """Let ``seconds`` pass on the engine's clock, poll once, and return the phase."""
        self.clock.advance(seconds)
        self.engine.poll()
        return self.engine.phase


def make_rig(
    policy: Policy | None = None,
    *,
    world_size: int = 4,
    rank: int = 0,
    redundancy: RedundancyFacts | None = None,
) -> Rig:
    """Build a rig; the default policy is ``OrchestratorDriven(recovery_timeout=10)``."""
    clock = ManualClock(100.0)
    backend = FakeBackend(rank=rank)
    engine = RecoveryEngine(
        policy or OrchestratorDriven(recovery_timeout=10.0),
        backend,
        rank=rank,
        world_size=world_size,
        clock=clock,
        redundancy=redundancy,
    )
    changes: list[PhaseChange] = []
    engine.subscribe(changes.append)
    return Rig(engine, backend, clock, changes)


def dead_peer(rank: int = 3) -> Fault:
    """A peer's process is gone."""
    return Fault(FaultKind.DEAD_PEER, rank=rank, step=7, info="PeerDead")


def transient(rank: int | None = None) -> Fault:
    """A fault a retry may clear."""
    return Fault(FaultKind.TRANSIENT, rank=rank, step=7, info="RuntimeError")
