"""The campaign driver: one seeded plan of faults run against a served CPU cluster under
continuous streaming traffic. For each fault it waits the planned steps, injects on the
ranks live then, drives recovery (``orchestrate``), injects the next fault during that
recovery when the plan says so, measures detection and recovery, checks the fault's
invariants, and rebuilds the deployment when it ended dead or too few ranks remain."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import attrs

from ftengine.testbed.chaos.actions import inject
from ftengine.testbed.chaos.catalogue import (
    ChaosKind,
    Injected,
    PlannedFault,
    When,
    plan,
    sub_plan,
)
from ftengine.testbed.chaos.census import Census, listening_here
from ftengine.testbed.chaos.deployment import Deployment
from ftengine.testbed.chaos.findings import Findings
from ftengine.testbed.chaos.history import History
from ftengine.testbed.chaos.invariants import FaultResult, check_fault, detection_bound
from ftengine.testbed.chaos.orchestrate import Orchestrator, Outcome
from ftengine.testbed.chaos.traffic import PROMPTS, Traffic
from ftengine.testbed.cluster import ClusterConfig
from ftengine.testbed.cluster.netns import Hosts
from ftengine.weights.index import CheckpointIndex

# Every kind this cluster mode can inject (the network cut needs hosts in namespaces).
PROCESS_KINDS = tuple(k for k in ChaosKind if k is not ChaosKind.NET_CUT)


@attrs.frozen
class CampaignOptions:
    """What a campaign runs: ``faults`` faults of ``kinds`` planned from ``seed`` on a
    ``dp_size`` cluster under ``clients`` streams of ``max_tokens`` tokens each."""

    faults: int = 20
    seed: int = 0
    policy: str = "orchestrator"
    dp_size: int = 4
    clients: int = 6
    max_tokens: int = 24
    op_timeout_s: float = 2.0
    recover_deadline_s: float = 60.0
    min_survivors: int = 1
    redundancy: int = 3
    """EPLB slots per logical expert minus one (``num_redundant_experts = redundancy x
    experts``): 3 on DP=4 lets every rank host every expert, so three ranks may go before a
    rebuild."""
    max_reinference: int = 8
    kinds: tuple[ChaosKind, ...] = PROCESS_KINDS
    netns: bool = False
    """Each worker in its own network namespace (``ftengine.testbed.cluster.netns``), which adds
    the network cut to the kinds."""
    only: tuple[int, ...] | None = None
    """Run only these fault numbers of the ``faults``-fault plan (``--only``), each as it is
    planned there: replays a reported fault without the ones before it."""

    @property
    def planned_kinds(self) -> tuple[ChaosKind, ...]:
        """``kinds``, plus ``net_cut`` in namespace mode."""
        if self.netns and ChaosKind.NET_CUT not in self.kinds:
            return (*self.kinds, ChaosKind.NET_CUT)
        return self.kinds


@attrs.define
class Generation:
    """One deployment of the campaign and the worker RSS it started with."""

    deployment: Deployment
    orchestrator: Orchestrator
    rss_start: dict[int, int] = attrs.field(factory=dict)
    recoveries: int = 0


class Campaign:
    """Runs :class:`CampaignOptions` on ``checkpoint``; ``progress`` gets one line per event."""

    def __init__(
        self, options: CampaignOptions, checkpoint: Path, progress: Callable[[str], None]
    ) -> None:
        self.options = options
        self.checkpoint = checkpoint
        self.progress = progress
        self.history = History()
        self.census = Census(listening_here, grace_s=5.0, poll_s=0.1)
        whole = plan(options.seed, options.faults, options.planned_kinds)
        self.plan = sub_plan(whole, options.only)
        self.hosts: Hosts | None = None
        self.found = Findings()
        self.rebuilds = 0
        self.unplanned = 0  # faults nobody injected, recovered before the next planned one
        self.error: str | None = None  # what ended the campaign early, if anything did
        self.interrupted = threading.Event()
        """Set (by a signal handler) to stop injecting; the campaign then ends cleanly and
        reports the faults run so far."""
        self.traffic = Traffic(
            PROMPTS, options.max_tokens, clients=options.clients, seed=options.seed,
            history=self.history, timeout_s=options.recover_deadline_s * 2,
        )  # fmt: skip
        self._experts = CheckpointIndex.open(checkpoint).num_experts
        self._stash = Path(tempfile.mkdtemp(prefix="ftengine-chaos-stash-"))

    # -- deployments ----------------------------------------------------------------------
    def _config(self) -> ClusterConfig:
        o, hosts = self.options, self.hosts
        config = ClusterConfig(
            self.checkpoint, dp_size=o.dp_size, policy=o.policy, op_timeout_s=o.op_timeout_s,
            max_reinference=o.max_reinference, recovery_timeout_s=o.recover_deadline_s,
            num_redundant_experts=self._redundant(),
            # A campaign relaunches its cluster dozens of times: forked workers skip the
            # seconds of torch and ftengine imports a spawned interpreter pays each time.
            worker_start="forkserver",
        )  # fmt: skip
        if hosts is None:
            return config
        # A cut rank must see its peers fail (op timeout) before the supervisor fences it
        # for its network silence: heartbeat timeout = op timeout + 1 s.
        misses = max(2, round((o.op_timeout_s + 1.0) / config.heartbeat_s))
        return attrs.evolve(
            config, host=hosts.host, worker_netns=hosts.namespaces, heartbeat_misses=misses
        )

    def _redundant(self) -> int:
        """EPLB slots to add: up to ``redundancy`` x experts, as many as divide evenly over
        the ranks (every rank gets the same number of slots)."""
        experts, ranks = self._experts, self.options.dp_size
        for copies in range(self.options.redundancy, 0, -1):
            if (copies + 1) * experts % ranks == 0:
                return copies * experts
        return 0

    def _launch(self) -> Generation:
        deployment = Deployment.launch(self._config())
        self.census.note(deployment.worker_pids.values(), [deployment.port])
        self.history.add("launch", url=deployment.url, pids=deployment.worker_pids)
        auto = self.options.policy != "orchestrator"
        grace = deployment.cluster.config.heartbeat_timeout_s + 1.0
        orchestrator = Orchestrator(deployment.url, auto=auto, history=self.history, grace_s=grace)
        return Generation(deployment, orchestrator)

    def _end(self, generation: Generation) -> None:
        rss_end = generation.deployment.rss()
        self.found.deployment_ended(generation.rss_start, rss_end, generation.recoveries)
        generation.orchestrator.close()
        generation.deployment.close()

    def _rebuild(self, generation: Generation, why: str) -> Generation:
        self.progress(f"rebuild: {why}")
        self.history.add("rebuild", why=why)
        self.rebuilds += 1
        began = time.monotonic()
        drained = self.traffic.pause(self.options.recover_deadline_s)
        if not drained:
            self.history.add("hang", why="streams did not end before a rebuild")
        paused = time.monotonic()
        self._end(generation)
        ended = time.monotonic()
        fresh = self._launch()
        self.traffic.resume(fresh.deployment.url)
        self.progress(
            f"rebuilt: drain {paused - began:.1f} s, stop {ended - paused:.1f} s, "
            f"launch {time.monotonic() - ended:.1f} s"
        )
        return fresh

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        """Run the whole plan (the traffic and every deployment end before it returns)."""
        for fault in self.plan:
            self.progress(f"plan {fault.describe()}")
        if self.options.netns:
            self.hosts = Hosts(self.options.dp_size).create()
            self.progress(
                f"netns: {self.hosts.namespaces} on {self.hosts.bridge} {self.hosts.subnet}"
            )
        try:
            self._run()
        finally:
            if self.hosts is not None:
                self.hosts.close()
            shutil.rmtree(self._stash, ignore_errors=True)  # every shard is back by now

    def _run(self) -> None:
        generation = self._launch()
        self.traffic.start(generation.deployment.url)
        try:
            position = 0
            while position < len(self.plan) and not self.interrupted.is_set():
                generation, position = self._one(generation, position)
        finally:
            if not self.traffic.stop(self.options.recover_deadline_s):
                self.history.add("hang", why="streams still running at the end")
            self._end(generation)

    def _live(self, generation: Generation) -> list[int]:
        cluster = generation.deployment.cluster
        return sorted(cluster.live_ranks() - cluster.removed_ranks)

    def _pair(self, position: int) -> tuple[PlannedFault, PlannedFault | None]:
        """The fault at ``position`` and the one to inject during its recovery, if any."""
        fault = self.plan[position]
        if fault.when is When.RECOVERY:
            # Reached on its own: no recovery was running for it to land in (there was no
            # room for both on the cluster), so it runs, and is judged, as a steady fault.
            fault = attrs.evolve(fault, when=When.STEADY)
        follow = self.plan[position + 1] if position + 1 < len(self.plan) else None
        if follow is not None and (
            follow.when is not When.RECOVERY
            or self.options.dp_size - fault.ranks_lost - follow.ranks_lost
            < self.options.min_survivors
        ):
            follow = None  # run as a steady fault of its own: even a fresh cluster cannot take both
        return fault, follow

    def _one(self, generation: Generation, position: int) -> tuple[Generation, int]:
        fault, follow = self._pair(position)
        need = fault.ranks_lost + (follow.ranks_lost if follow else 0)
        if len(self._live(generation)) - need < self.options.min_survivors:
            generation = self._rebuild(generation, f"{len(self._live(generation))} ranks left")
        self._wait_steps(generation, fault.delay_steps)
        generation = self._steady(generation, fault.index)
        if not generation.rss_start:
            generation.rss_start = generation.deployment.rss()
        first = self._inject(generation, fault)
        self._await_detection(generation, first)
        followed: list[Injected] = []

        def during() -> None:
            if follow is not None:
                followed.append(self._inject(generation, follow, exclude=first.victims))

        # Past the engines' own recovery deadline, so an engine left waiting ends DEAD first.
        deadline = self.options.recover_deadline_s + 15.0
        outcome = generation.orchestrator.recover(fault.index, deadline, during)
        final = self._after_follows(generation, fault.index, followed, outcome)
        generation.recoveries += 1
        for injected in reversed((first, *followed)):
            injected.repair()  # newest first: each puts back what was there before it
        self._judge(generation, first, outcome)
        for injected in followed:
            self._judge(generation, injected, final)
        after = position + 1 + len(followed)
        if final.state != "settled" and after < len(self.plan):
            generation = self._rebuild(generation, f"recovery ended {final.state}")
        return generation, after

    def _after_follows(
        self, generation: Generation, index: int, followed: list[Injected], outcome: Outcome
    ) -> Outcome:
        """The outcome once every fault injected during ``outcome``'s recovery has shown.

        Such a fault may show only after that recovery settled: a SIGKILLed victim reads
        alive until the supervisor files its exit, an armed step exception fires at the next
        step. Judged at the settle, its victim read alive (fault 29 of seed 19), and the next
        fault landed on a cluster already down (30, 36: no fresh quarantine to time). So wait
        for it to show, then drive the recovery it started, as an orchestrator would."""
        if outcome.state != "settled" or not followed:
            return outcome
        for injected in followed:
            self._await_detection(generation, injected)
        return generation.orchestrator.recover(index, self.options.recover_deadline_s + 15.0)

    def _shown(self, generation: Generation, injected: Injected) -> bool:
        """``injected`` shows in the status: its victims are gone (every kind but the step
        exception kills or stops them), or, for an armed step exception, every live rank's
        status counts a new fault episode (its phase change reaches the supervisor before
        the status that goes with it: read in between, every engine is still healthy)."""
        cluster = generation.deployment.cluster
        if injected.fault.kind is not ChaosKind.STEP_RAISE:
            return not set(injected.victims) & cluster.live_ranks()
        live = cluster.live_ranks()
        engines = {e["id"]: e for e in cluster.status()["engines"]}
        return all(
            int(engines[rank].get("fault_episodes") or 0) > before
            for rank, before in injected.episodes.items()
            if rank in live
        )

    def _steady(self, generation: Generation, index: int) -> Generation:
        """The cluster is serving before fault ``index`` goes in: a fault nobody planned
        (a worker fenced as hung on a starved machine) is recovered first, or the
        deployment rebuilt, and counted in ``unplanned``, so no planned fault is judged on
        a cluster that was already down."""
        if generation.orchestrator.state() == "settled":
            return generation
        self.unplanned += 1
        engines = generation.deployment.cluster.status()["engines"]
        self.history.add("unplanned", index, engines=[(e["id"], e["phase"]) for e in engines])
        self.progress(f"unplanned fault before #{index}: recovering it first")
        outcome = generation.orchestrator.recover(index, self.options.recover_deadline_s + 15.0)
        if outcome.state != "settled":
            generation = self._rebuild(generation, f"an unplanned fault ended {outcome.state}")
        return generation

    def _wait_steps(self, generation: Generation, steps: int) -> None:
        cluster = generation.deployment.cluster
        target, deadline = cluster.steps_run + steps, time.monotonic() + 10.0
        while cluster.steps_run < target and time.monotonic() < deadline:
            time.sleep(0.005)

    def _inject(
        self, generation: Generation, fault: PlannedFault, exclude: tuple[int, ...] = ()
    ) -> Injected:
        live = [r for r in self._live(generation) if r not in exclude]
        injected = inject(generation.deployment, fault, live, self._stash, self.hosts)
        self.found.injections.append(injected)
        self.history.add(
            "inject", fault.index, kind=fault.kind.value, when=fault.when.value,
            victims=list(injected.victims), step=injected.step,
        )  # fmt: skip
        return injected

    def _judge(self, generation: Generation, injected: Injected, outcome: Outcome) -> None:
        fault = injected.fault
        result = FaultResult(
            index=fault.index, kind=fault.kind, when=fault.when, step=injected.step,
            victims=injected.victims, detect_s=self._detect(generation, injected),
            recover_s=outcome.at - injected.at, outcome=outcome.state, engines=outcome.engines,
            both_sides_served=self._cut_side_served(generation, injected),
        )  # fmt: skip
        problems = check_fault(result, self.options.op_timeout_s)
        self.found.judged(result, injected, injected.step, problems, outcome.at, self.history)
        detect = "-" if result.detect_s is None else f"{result.detect_s:.3f} s"
        self.progress(
            f"[{fault.index + 1}/{len(self.plan)}] {fault.kind.value} ({fault.when.value}) "
            f"ranks {list(injected.victims)} step {injected.step}: detect {detect}, "
            f"{outcome.state} after {result.recover_s:.3f} s"
            + (f"; VIOLATED {problems}" if problems else "")
        )

    def _cut_side_served(self, generation: Generation, injected: Injected) -> bool:
        """A cut rank went back to serving after the cut (its engine healthy again, or still
        alive and healthy at the end) while the other side serves: both sides served."""
        if injected.fault.kind is not ChaosKind.NET_CUT:
            return False
        changes = generation.deployment.cluster.phase_changes()
        status = {e["id"]: e for e in generation.deployment.cluster.status()["engines"]}
        for rank in injected.victims:
            back = [c for c in changes.get(rank, ()) if c.at > injected.at and c.dest == "healthy"]
            alive_ok = status[rank].get("alive") and status[rank]["status"] == 0
            if back or alive_ok:
                return True
        return False

    def _await_detection(self, generation: Generation, injected: Injected) -> None:
        """Wait until every rank that must see ``injected`` did and it shows in the status
        (or its bound passed twice over: the judge reports it), so recovery is never judged
        before the fault showed: the survivors quarantine as soon as a peer's socket closes,
        before the supervisor has filed that peer's exit, and a status read in between is
        every engine healthy, victims included."""
        bound = 2 * detection_bound(injected.fault.kind, self.options.op_timeout_s) + 1.0
        deadline = injected.at + bound
        while time.monotonic() < deadline and (
            self._detect(generation, injected) is None or not self._shown(generation, injected)
        ):
            time.sleep(0.01)

    def _detect(self, generation: Generation, injected: Injected) -> float | None:
        """Seconds until the last rank that had to see the fault went ``quarantined``."""
        changes = generation.deployment.cluster.phase_changes()
        seen = []
        for rank in injected.detectors:
            times = [c.at for c in changes.get(rank, ()) if c.dest == "quarantined"]
            times = [t for t in times if t >= injected.at]
            if times:
                seen.append(min(times))
            elif rank in generation.deployment.cluster.live_ranks():
                return None
        return max(seen) - injected.at if seen else None
