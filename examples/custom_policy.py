"""Writing a custom recovery policy: retry a transient fault once on our own, leave
everything else to the orchestrator. Runs on the fake backend with a manual clock:

    .venv/bin/python examples/custom_policy.py

and, named by its import path, inside a real vLLM deployment (repository root on
``PYTHONPATH``; ``tests/integration/test_vllm_custom_policy.py`` does it):

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
from ftengine.policies import Composable, Decision, GiveUp, OrchestratorDriven, Retry


# readme:begin
@attrs.frozen
class RetryTransientOnce(Composable):
    """Retry a transient fault once, ``delay`` seconds after it; otherwise abstain (None)."""

    delay: float = 0.0

    def __call__(self, ctx: RecoveryContext, /) -> Decision | None:
        if ctx.fault.kind is FaultKind.TRANSIENT and ctx.attempts == 0 and not ctx.in_recovery:
            return Retry(self.delay)
        return None


def give_up_if_this_rank_flaps(ctx: RecoveryContext) -> Decision | None:
    """A plain function is a policy too: give up once this worker faulted 3 times in 60 s."""
    if len(ctx.faults_of(ctx.rank, since=ctx.now - 60.0)) >= 3:
        return GiveUp(f"rank {ctx.rank} faulted 3 times within 60s")
    return None


def policy() -> Composable:
    """The factory configuration names: ``"policy": "examples.custom_policy:policy"``.

    The first opinion wins: the flap check, our retry rule, then vLLM's default behaviour.
    """
    return give_up_if_this_rank_flaps | RetryTransientOnce(0.5) | OrchestratorDriven(60.0)


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
