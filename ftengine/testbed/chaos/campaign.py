"""The campaign loop, the same on every :class:`~ftengine.testbed.chaos.target.Target`: a
seeded plan of faults run under continuous streaming traffic. For each fault it recovers
first what nobody planned, rebuilds when too few ranks remain, waits the planned steps,
injects, waits until the fault shows, drives recovery (injecting the next fault during it
when the plan says so), judges every fault with the shared invariants, and rebuilds the
deployment when the recovery did not settle."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import attrs

from ftengine.testbed.chaos.catalogue import Injected, PlannedFault, When
from ftengine.testbed.chaos.census import Census
from ftengine.testbed.chaos.findings import Findings
from ftengine.testbed.chaos.history import History
from ftengine.testbed.chaos.invariants import FaultResult, Violation
from ftengine.testbed.chaos.recovery import Outcome
from ftengine.testbed.chaos.target import Target
from ftengine.testbed.chaos.traffic import StreamRecord


@attrs.define
class Generation:
    """What the campaign measures of one deployment: its workers' RSS at its first fault
    and the recoveries it went through."""

    rss_start: dict[int, int] = attrs.field(factory=dict)
    recoveries: int = 0


class Campaign:
    """Runs ``target``'s plan; ``progress`` gets one line per event."""

    def __init__(self, target: Target, progress: Callable[[str], None]) -> None:
        self.target = target
        self.progress = progress
        self.history: History = target.bench.history
        self.plan = target.plan()
        self.found = Findings()
        self.reference: list[list[int]] = []
        self.rebuild_s: list[float] = []
        self.rejoin_s: list[float] = []  # restart to every rank admitted, per heal
        self.unplanned = 0  # faults nobody injected, recovered before the next planned one
        self.skipped: list[str] = []  # planned faults not even a fresh deployment could take
        self.error: str | None = None  # what ended the campaign early, if anything did
        self.interrupted = threading.Event()
        """Set (by a signal handler) to stop injecting; the campaign then ends cleanly and
        reports the faults run so far."""
        self.generation = Generation()

    @property
    def census(self) -> Census:
        return self.target.bench.census

    @property
    def rebuilds(self) -> int:
        return len(self.rebuild_s)

    def records(self) -> list[StreamRecord]:
        """Every stream of every client."""
        return self.target.bench.fleet.records()

    # -- deployments ----------------------------------------------------------------------
    def _end(self) -> None:
        ended = self.generation
        self.found.deployment_ended(ended.rss_start, self.target.rss(), ended.recoveries)
        self.target.stop()

    def _rebuild(self, why: str) -> None:
        self.progress(f"rebuild: {why}")
        self.history.add("rebuild", why=why)
        began = time.monotonic()
        for _ in range(self.target.bench.fleet.pause(self.target.bench.drain_s)):
            self.history.add("hang", why="streams did not end before a rebuild")
        paused = time.monotonic()
        self._end()
        ended = time.monotonic()
        self.target.start()
        self.generation = Generation()
        self.target.bench.fleet.resume(self.target.urls())
        self.rebuild_s.append(time.monotonic() - began)
        self.progress(
            f"rebuilt: drain {paused - began:.1f} s, stop {ended - paused:.1f} s, "
            f"launch {time.monotonic() - ended:.1f} s"
        )

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        """Run the whole plan (the traffic and every deployment end before it returns)."""
        for fault in self.plan:
            self.progress(f"plan {fault.describe()}")
        try:
            self._run()
        finally:
            self.target.close()

    def _run(self) -> None:
        self.target.start()
        streaming = False
        try:
            self.reference, mismatches = self.target.reference(self._settle)
            self.found.violations += [
                Violation("reference_mismatch", None, None, None, m) for m in mismatches
            ]
            self.history.add("reference", answers=self.reference)
            self.target.bench.fleet.start(self.target.urls())
            streaming = True
            position = 0
            while position < len(self.plan) and not self.interrupted.is_set():
                position = self._one(position)
        finally:
            try:
                for _ in range(
                    self.target.bench.fleet.stop(self.target.bench.drain_s) if streaming else 0
                ):
                    self.history.add("hang", why="streams still running at the end")
            finally:  # the deployment stops whatever happened to the streams
                self._end()

    def _settle(self, before: int | None = None) -> None:
        """Recover a fault nobody injected (a worker fenced as hung on a starved machine,
        an op timeout under load) as an orchestrator would, or rebuild when that does not
        settle; counted in ``unplanned``, so no planned fault (``before``: the next one)
        lands on a deployment that was already down."""
        if self.target.steady():
            return
        self.unplanned += 1
        engines = self.target.engines()
        self.history.add("unplanned", before, engines=engines)
        self.progress(f"unplanned fault before #{before}: recovering it first: {engines}")
        outcome = self.target.recover(before, None, None)
        self.history.add("unplanned_done", before, state=outcome.state)
        if outcome.state != "settled":
            self._rebuild(f"an unplanned fault ended {outcome.state}")

    def _pair(self, position: int) -> tuple[PlannedFault, PlannedFault | None]:
        """The fault at ``position`` and the one to inject during its recovery, if any."""
        fault = self.plan[position]
        if fault.when is When.RECOVERY:
            # Reached on its own: no recovery was running for it to land in (there was no
            # room for both), so it runs, and is judged, as a steady fault.
            fault = attrs.evolve(fault, when=When.STEADY)
        following = self.plan[position + 1] if position + 1 < len(self.plan) else None
        return fault, following if self.target.follows(fault, following) else None

    def _prepare(self, position: int) -> tuple[PlannedFault | None, PlannedFault | None]:
        """Fault ``position`` and its follow-up on a deployment that can take them (rebuilt
        first when it must be); (None, None): skipped, not even a fresh one can."""
        self._settle(self.plan[position].index)
        fault, follow = self._pair(position)
        why = self.target.rebuild_first(fault, follow)
        if why is None:
            return fault, follow
        self._rebuild(why)
        fault, follow = self._pair(position)
        if self.target.rebuild_first(fault, follow) is not None:
            self.skipped.append(fault.describe())
            self.progress(f"skipped {fault.describe()}: {why}")
            return None, None
        return fault, follow

    def _one(self, position: int) -> int:
        """Run fault ``position`` (and the one during its recovery); the next position."""
        fault, follow = self._prepare(position)
        if fault is None:
            return position + 1
        self.target.wait_steps(fault.delay_steps)
        self._settle(fault.index)
        if not self.generation.rss_start:
            self.generation.rss_start = self.target.rss()
        shots = [self._inject(fault, self.target.live())]
        self._await_detection(shots[0])

        def during() -> Sequence[int]:
            assert follow is not None
            rest = [r for r in self.target.standing() if r not in shots[0].victims]
            shots.append(self._inject(follow, rest))
            return shots[-1].victims

        outcome = self.target.recover(fault.index, shots[0], during if follow else None)
        final = self._after_follows(fault.index, shots[1:], outcome)
        self.generation.recoveries += 1
        self.target.repair(shots)
        self._judge(shots[0], outcome)
        for shot in shots[1:]:
            self._judge(shot, final)
        after = position + len(shots)
        why = rebuild_after(final.state)
        if why is None and after < len(self.plan):
            why = self._heal(fault.index)
        if why is not None and after < len(self.plan):
            self._rebuild(why)
        return after

    def _heal(self, index: int) -> str | None:
        """Rejoin the ranks fault ``index``'s recovery removed (where the target can);
        why the deployment must be rebuilt instead, if the rejoin failed."""
        began = time.monotonic()
        try:
            ranks = self.target.heal(index)
        except Exception as exc:  # a failed rejoin: say why, then rebuild
            self.history.add("rejoin_failed", index, error=f"{type(exc).__name__}: {exc}")
            return f"rejoin after #{index} failed: {exc}"
        if ranks:
            self.rejoin_s.append(time.monotonic() - began)
            self.history.add("rejoined", index, ranks=ranks, s=round(self.rejoin_s[-1], 3))
            self.progress(f"rejoined ranks {ranks} in {self.rejoin_s[-1]:.2f} s")
        return None

    def _after_follows(self, index: int, followed: Sequence[Injected], outcome: Outcome) -> Outcome:
        """The outcome once every fault injected during ``outcome``'s recovery has shown,
        on a target where one may show late (``follows_show_late``).

        Such a fault may show only after that recovery settled: a SIGKILLed victim reads
        alive until the supervisor files its exit, an armed step exception fires at the next
        step. Judged at the settle, its victim read alive (fault 29 of seed 19), and the next
        fault landed on a cluster already down (30, 36: no fresh quarantine to time). So wait
        for it to show, then drive the recovery it started, as an orchestrator would."""
        if not self.target.follows_show_late or outcome.state != "settled" or not followed:
            return outcome
        for shot in followed:
            self._await_detection(shot)
        return self.target.recover(index, None, None)

    def _inject(self, fault: PlannedFault, live: Sequence[int]) -> Injected:
        shot = self.target.inject(fault, live)
        self.found.injections.append(shot)
        self.history.add(
            "inject", fault.index, kind=fault.kind.value, when=fault.when.value,
            victims=list(shot.victims), step=shot.step,
        )  # fmt: skip
        return shot

    def _await_detection(self, shot: Injected) -> None:
        """Wait until every rank that must see ``shot`` did and it shows in the status (or
        its bound passed twice over: the judge reports it), so recovery is never judged
        before the fault showed: on the cluster the survivors quarantine as soon as a peer's
        socket closes, before the supervisor has filed that peer's exit, and a status read
        in between is every engine healthy, victims included."""
        deadline = shot.at + 2 * self.target.detection_bound(shot.fault.kind) + 1.0
        while time.monotonic() < deadline and (
            self.target.detected(shot) is None or not self.target.shown(shot)
        ):
            time.sleep(0.01)

    def _judge(self, shot: Injected, outcome: Outcome) -> None:
        result, problems = self.target.judge(shot, outcome)
        step = None if result.step < 0 else result.step
        self.found.judged(result, shot, step, problems, outcome.at, self.history)
        self.progress(_line(result, len(self.plan), outcome, problems))


def rebuild_after(outcome: str) -> str | None:
    """Why the deployment must be rebuilt right after a fault's recovery (None: it goes on,
    whatever it lost: a cluster with ranks to spare, a vLLM deployment that lost rank 0
    with two or more survivors, its DEAD engine core parked so the DP coordinator its API
    server runs stays up, ``coordinator_host.py``)."""
    if outcome != "settled":
        return f"recovery ended {outcome}"
    return None


def _line(result: FaultResult, planned: int, outcome: Outcome, problems: list[str]) -> str:
    """``[3/20] sigkill (steady) ranks [1] step 12: detect 0.010 s, settled after ...``."""
    detect = "-" if result.detect_s is None else f"{result.detect_s:.3f} s"
    step = "" if result.step < 0 else f" step {result.step}"
    recover = "-" if result.recover_s is None else f"{result.recover_s:.3f} s"
    return (
        f"[{result.index + 1}/{planned}] {result.kind.value} ({result.when.value}) "
        f"ranks {list(result.victims)}{step}: detect {detect}, {outcome.state} after "
        f"{recover}, commands {[c[:120] for c in outcome.commands]}"
        + (f"; VIOLATED {problems}" if problems else "")
    )
