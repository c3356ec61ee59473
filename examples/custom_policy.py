"""Writing a custom recovery policy: scale a flapping rank down, retry a transient fault
once on our own, leave everything else to the orchestrator. Runs on the fake backend with
a manual clock:

    .venv/bin/python examples/custom_policy.py

and, named by its import path, inside a real vLLM deployment (repository root on
``PYTHONPATH``; ``tests/integration/test_vllm_custom_policy.py`` does it: two faults of
one rank retried, the third scales it down):

    --additional-config '{"ftengine": {"policy": "examples.custom_policy:policy"}}'

The part between the ``readme`` marks is the README's example, verbatim (a test checks).
"""

from __future__ import annotations

import attrs

from ftengine.backends.fake import FakeBackend
from ftengine.clock import ManualClock
from ftengine.context import RecoveryContext
from ftengine.engine import RecoveryEngine
from ftengine.faults import Fault, FaultKind
from ftengine.policies import Composable, Decision, FlapGuard, OrchestratorDriven, Retry


# readme:begin
@attrs.frozen
class RetryTransientOnce(Composable):
    """Retry a transient fault once, ``delay`` seconds after it; otherwise abstain (None)."""

    delay: float = 0.0

    def __call__(self, ctx: RecoveryContext, /) -> Decision | None:
        if ctx.fault.kind is FaultKind.TRANSIENT and ctx.attempts == 0 and not ctx.in_recovery:
            return Retry(self.delay)
        return None


def policy() -> Composable:
    """The factory configuration names: ``"policy": "examples.custom_policy:policy"``.

    The first opinion wins: a rank that faulted 3 times within 10 minutes is scaled down (a
    worker gives up if it is that rank), a transient fault is retried once, and anything
    else waits for an orchestrator (vLLM's default behaviour).
    """
    return FlapGuard(k=3, window=600.0) | RetryTransientOnce(0.5) | OrchestratorDriven(60.0)


# readme:end


def main() -> None:
    clock = ManualClock()
    engine = RecoveryEngine(policy(), FakeBackend(), rank=0, world_size=4, clock=clock)
    engine.subscribe(lambda c: print(f"t={c.at:g}s {c.source.value} -> {c.dest.value}: {c.reason}"))

    engine.report_fault(Fault(FaultKind.TRANSIENT, rank=0, info="RuntimeError"))
    clock.advance(0.5)
    engine.poll()  # the host loop polls; our Retry is due now

    engine.report_fault(Fault(FaultKind.DEAD_PEER, rank=3, info="PeerDead"))
    result = engine.apply("scale_down", {"removed_dp_ranks": [3]}, "orchestrator-1")
    print(f"scale_down: success={result.success}")

    status = engine.status()
    print(f"final: phase={status.phase.value} removed={sorted(status.removed_ranks)}")


if __name__ == "__main__":
    main()
