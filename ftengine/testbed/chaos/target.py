"""What a chaos campaign runs against: a :class:`Target` is one world (the CPU cluster, real
vLLM, a later one) seen through what differs between worlds (start and stop a deployment,
inject a planned fault, read whether it showed, drive its recovery, judge it, count the
leftovers), so that one loop (``campaign.Campaign``) plans, injects, watches, recovers,
judges and rebuilds on any of them. :class:`Fleet` is the streaming traffic of every rank."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from ftengine.testbed.chaos.catalogue import ChaosKind, Injected, PlannedFault
from ftengine.testbed.chaos.census import Census
from ftengine.testbed.chaos.history import History
from ftengine.testbed.chaos.invariants import FaultResult
from ftengine.testbed.chaos.recovery import During, Outcome
from ftengine.testbed.chaos.traffic import PROMPTS, StreamRecord, Traffic


class Fleet:
    """The campaign's streaming clients: one :class:`Traffic` per URL the target serves on
    (``traffic[r]`` streams to ``urls[r]``; a request refused there is asked on the others,
    as a load balancer would)."""

    def __init__(self, traffic: Sequence[Traffic]) -> None:
        self.traffic = list(traffic)
        for each in self.traffic:  # a request refused on one server is asked on the others
            each.alternates = self.serving_urls

    def serving_urls(self) -> list[str]:
        """The URLs streamed to now (a paused client's server is left out: restarting)."""
        return [url for t in self.traffic if (url := t.streaming_to) is not None]

    def start(self, urls: Sequence[str]) -> None:
        for traffic, url in zip(self.traffic, urls, strict=True):
            traffic.start(url)

    def resume(self, urls: Sequence[str]) -> None:
        for traffic, url in zip(self.traffic, urls, strict=True):
            traffic.resume(url)

    def pause(self, timeout_s: float) -> int:
        """Start no new stream, let the running ones end; how many clients' streams did not
        end within ``timeout_s`` each."""
        return sum(not traffic.pause(timeout_s) for traffic in self.traffic)

    def stop(self, timeout_s: float) -> int:
        """End every client; how many had a stream still running after ``timeout_s``."""
        return sum(not traffic.stop(timeout_s) for traffic in self.traffic)

    def records(self) -> list[StreamRecord]:
        """Every stream of every client."""
        return [r for t in self.traffic for r in t.records]


@attrs.frozen
class Bench:
    """What every target keeps the same way: the run's history, the census of what its
    deployments used, the streaming clients, the tokens each stream asks for, and how long
    streams get to end before a rebuild or at the end (``drain_s``)."""

    history: History
    census: Census
    fleet: Fleet
    max_tokens: int
    drain_s: float

    @classmethod
    def make(
        cls, census: Census, *, max_tokens: int, drain_s: float, clients: int, seeds: Iterable[int]
    ) -> Bench:
        """One :class:`Traffic` of ``clients`` clients per seed (per URL the target serves
        on), a stream given twice ``drain_s`` to end."""
        history = History()
        fleet = Fleet([
            Traffic(PROMPTS, max_tokens, clients=clients, seed=seed, history=history,
                    timeout_s=drain_s * 2)
            for seed in seeds
        ])  # fmt: skip
        return cls(history, census, fleet, max_tokens, drain_s)


class Ran(Protocol):
    """What a target's report fields read of the campaign that ran on it."""

    unplanned: int
    skipped: list[str]
    rebuild_s: list[float]
    rejoin_s: list[float]
    reference: list[list[int]]

    def records(self) -> list[StreamRecord]: ...


@runtime_checkable
class Target(Protocol):
    """One world a campaign runs in. The target holds the deployment of the moment (a
    *generation*); :meth:`start` makes a fresh one, :meth:`stop` ends it. A new world (many
    hosts, say) is one more class with these members; ``tests/unit/test_chaos_target.py``
    checks each world has them all."""

    bench: Bench
    follows_show_late: bool
    """A fault injected during a recovery may show only after that recovery settled (the
    cluster files a killed worker's exit late): the loop waits for it to show and drives
    the recovery it starts before judging it."""

    def plan(self) -> list[PlannedFault]:
        """The seeded faults this campaign runs, of the kinds this target supports."""

    def start(self) -> None:
        """Start a deployment (noted in the census)."""

    def stop(self) -> None:
        """Stop the current deployment and everything it started."""

    def close(self) -> None:
        """Release what the target holds across deployments, once the last one stopped."""

    def urls(self) -> list[str]:
        """Where each of the fleet's clients streams to on the current deployment."""

    def reference(self, settle: Callable[[], None]) -> tuple[list[list[int]], list[str]]:
        """The fault-free greedy tokens of every prompt, and what disagreed (``settle``
        recovers a fault nobody injected on the way)."""

    def live(self) -> list[int]:
        """The ranks a steady fault may hit now."""

    def standing(self) -> list[int]:
        """The ranks a fault during a recovery may hit now (not removed, not dead)."""

    def follows(self, fault: PlannedFault, follow: PlannedFault | None) -> bool:
        """Whether ``follow`` lands during ``fault``'s recovery on the current ranks."""

    def rebuild_first(self, fault: PlannedFault, follow: PlannedFault | None) -> str | None:
        """Why the deployment must be rebuilt before ``fault`` (None: it can run now)."""

    def wait_steps(self, steps: int) -> None:
        """Let ``steps`` steps of traffic run."""

    def rss(self) -> dict[int, int]:
        """Resident bytes of every live worker, by rank."""

    def steady(self) -> bool:
        """Whether every engine serves (no fault is being, or waits to be, recovered)."""

    def engines(self) -> object:
        """The engines as the status reads them now (for the history)."""

    def inject(self, fault: PlannedFault, live: Sequence[int]) -> Injected:
        """Inject ``fault`` on victims chosen among ``live``."""

    def detection_bound(self, kind: ChaosKind) -> float:
        """Seconds within which ``kind`` must be detected."""

    def detected(self, shot: Injected) -> float | None:
        """Seconds until the last rank that had to see ``shot`` did (None: not yet)."""

    def shown(self, shot: Injected) -> bool:
        """Whether ``shot`` shows in the status a recovery is driven from."""

    def recover(self, fault: int | None, shot: Injected | None, during: During | None) -> Outcome:
        """Drive the recovery of fault ``fault`` (``shot``: as injected; None: a fault
        nobody planned) until it settles, ends dead or its deadline passes; ``during`` runs
        once, right after the first command."""

    def repair(self, shots: Sequence[Injected]) -> None:
        """Undo what ``shots`` left broken outside the deployment, once recovered."""

    def heal(self, fault: int | None) -> list[int]:
        """Bring the ranks the settled recovery of ``fault`` removed back by rejoin
        (restart, then ``scale_up``); the ranks that rejoined (empty: none was removed, or
        this world does not rejoin). Raises when a rejoin fails: the loop rebuilds."""

    def judge(self, shot: Injected, outcome: Outcome) -> tuple[FaultResult, list[str]]:
        """``shot``'s result as measured, and the invariants it violated."""

    def verdict(self, record: StreamRecord, problems: list[str]) -> list[str]:
        """A stream's problems as this target counts them."""

    def about(self, campaign: Ran) -> dict[str, Any]:
        """The report's fields about this target's run."""
