"""The serving loop's held requests: what a fault does to the requests it was computing when
re-inference is on (``ftengine.reinference`` holds the semantics; this module applies them
to the loop's steps).

A failed step's requests are held (their KV of the step dropped by the workers), counted
as re-run, and those on the ranks that raised become suspects, re-run one at a time; a
lone suspect whose step faults again on its rank is the poison request. While the cluster
recovers everything waits, up to the deadline or a DEAD verdict.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs

from ftengine.reinference import PoisonProbe, Reinference, TokenLedger
from ftengine.testbed.cluster.generation import StepFailed

Ran = tuple[str, int, TokenLedger]  # a failed step's item: request id, rank, its ledger


@attrs.frozen
class Resumption:
    """What a serving loop needs to hold requests through a fault: the ``bounds``, and
    ``verdict()``, the reason recovery can no longer succeed (an engine is DEAD), or None."""

    bounds: Reinference
    verdict: Callable[[], str | None]
    clock: Callable[[], float] = time.monotonic


@attrs.frozen
class Ending:
    """A held request that must end now: ``poison`` ends it with an error, else an abort."""

    request_id: str
    detail: str
    poison: bool = False


@attrs.define
class Held:
    """The loop's fault bookkeeping: since when requests are held, and the poison probe."""

    resumption: Resumption
    probe: PoisonProbe = attrs.field(factory=PoisonProbe)
    since: float | None = None
    clean: set[str] = attrs.field(factory=set)  # ran a clean step since the last fault

    def hold(self) -> None:
        """The cluster does not serve: start (or keep) the hold clock."""
        if self.since is None:
            self.since = self.resumption.clock()

    def resumed(self) -> None:
        """A step ran clean: nothing is held any more."""
        self.since = None

    def cleared(self, request_id: str) -> None:
        """``request_id`` ran a clean step (or ended): no longer suspected."""
        self.probe.cleared(request_id)
        self.clean.add(request_id)

    def give_up(self) -> str | None:
        """Why every held request must end now (DEAD, or past the deadline), or None."""
        dead = self.resumption.verdict()
        if dead is not None:
            return self.resumption.bounds.dead(dead)
        if self.since is None:
            return None
        return self.resumption.bounds.expired(self.resumption.clock() - self.since)

    def step_failed(self, exc: StepFailed, ran: Sequence[Ran]) -> list[Ending]:
        """A step with items ``ran`` failed: count their re-runs and say which requests end
        now (the poison one alone, or those over the re-run limit)."""
        self.hold()
        if exc.refused:  # nothing ran (the engines were not serving yet): no re-run spent
            return []
        lone = self._lone_probe(ran)
        if lone is not None and exc.culprits == {lone[1]}:
            # Its batch-mates are not charged: the fault was the poison's, not theirs.
            self.probe.cleared(lone[0])
            return [Ending(lone[0], Reinference.poison(lone[1]), poison=True)]
        endings = []
        for request_id, _, ledger in ran:
            ledger.faulted()
            over = self.resumption.bounds.over_limit(ledger.reruns)
            if over is not None:
                endings.append(Ending(request_id, over))
        ended = {e.request_id for e in endings}
        self.probe.suspect(
            [rid for rid, rank, _ in ran if rank in exc.culprits and rid not in ended]
        )
        for request_id in ended:
            self.probe.cleared(request_id)
        self.clean = set()
        return endings

    def _lone_probe(self, ran: Sequence[Ran]) -> tuple[str, int] | None:
        """The probe and its rank, if it ran and every other request on its rank had run
        clean steps without it since the fault (so a fault on that rank now is the probe's)."""
        ranks = {rid: rank for rid, rank, _ in ran}
        probe = self.probe.probe()
        if probe is None or probe not in ranks:
            return None
        rank = ranks[probe]
        on_rank = [rid for rid, r in ranks.items() if r == rank]
        return (probe, rank) if self.probe.culprit(on_rank, self.clean) is not None else None
