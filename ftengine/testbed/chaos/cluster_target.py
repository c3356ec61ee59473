"""The CPU cluster as a campaign target: each deployment a cluster served over HTTP in
this process (``deployment``), recovery driven over that HTTP API (``orchestrate``), faults
injected by signals to its own workers, faults armed inside them, weight shards broken on
disk around a reload and, in namespace mode, links cut (``actions``)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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
from ftengine.testbed.chaos.cluster_options import ClusterCampaignOptions
from ftengine.testbed.chaos.deployment import Deployment
from ftengine.testbed.chaos.findings import spread
from ftengine.testbed.chaos.invariants import FaultResult, check_fault, detection_bound
from ftengine.testbed.chaos.orchestrate import ClusterChannel, ClusterRules, settled_state
from ftengine.testbed.chaos.recovery import Decision, During, Orchestrator, Outcome
from ftengine.testbed.chaos.target import Bench, Ran
from ftengine.testbed.chaos.traffic import PROMPTS, StreamRecord
from ftengine.testbed.cluster import ClusterConfig, ClusterError, reference_generate
from ftengine.testbed.cluster.netns import Hosts
from ftengine.weights.index import CheckpointIndex

POISON_NOT_COVERED = {
    "poison": "not injected here: the CPU cluster's re-inference of a poison request is "
    "covered by its serving tests (tests/integration/test_serving_reinference.py); the "
    "real-vLLM campaign injects it"
}
NOT_COVERED = {
    "net_cut": "not injected: this cluster mode runs every worker in the root network "
    "namespace (run with --netns for hosts in network namespaces), so a link cannot be cut alone",
    **POISON_NOT_COVERED,
}


class ClusterTarget:
    """:class:`ClusterCampaignOptions` on ``checkpoint`` (``progress``: one line per event)."""

    follows_show_late = True

    def __init__(
        self, options: ClusterCampaignOptions, checkpoint: Path, progress: Callable[[str], None]
    ) -> None:
        self.options = options
        self.checkpoint = checkpoint
        self.progress = progress
        self.bench = Bench.make(
            Census(listening_here, grace_s=5.0, poll_s=0.1), max_tokens=options.max_tokens,
            drain_s=options.recover_deadline_s, clients=options.clients, seeds=[options.seed],
        )  # fmt: skip
        self.hosts: Hosts | None = None
        self.deployment: Deployment | None = None
        self.orchestrator: Orchestrator[str] | None = None
        self._experts = CheckpointIndex.open(checkpoint).num_experts
        self._stash = Path(tempfile.mkdtemp(prefix="ftengine-chaos-stash-"))

    def plan(self) -> list[PlannedFault]:
        o = self.options
        return sub_plan(plan(o.seed, o.faults, o.planned_kinds), o.only)

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

    def start(self) -> None:
        if self.options.netns and self.hosts is None:
            self.hosts = Hosts(self.options.dp_size).create()
            self.progress(
                f"netns: {self.hosts.namespaces} on {self.hosts.bridge} {self.hosts.subnet}"
            )
        deployment = Deployment.launch(self._config())
        self.bench.census.note(deployment.worker_pids.values(), [deployment.port])
        self.bench.history.add("launch", url=deployment.url, pids=deployment.worker_pids)
        auto = self.options.policy != "orchestrator"
        grace = deployment.cluster.config.heartbeat_timeout_s + 1.0
        self.deployment = deployment
        channel = ClusterChannel(deployment.url, self.bench.history)
        self.orchestrator = Orchestrator(channel, lambda: ClusterRules(auto, grace))

    def stop(self) -> None:
        if self.orchestrator is not None:
            self.orchestrator.close()
        if self.deployment is not None:
            self.deployment.close()
        self.deployment = self.orchestrator = None

    def close(self) -> None:
        if self.hosts is not None:
            self.hosts.close()
        shutil.rmtree(self._stash, ignore_errors=True)  # every shard is back by now

    def urls(self) -> list[str]:
        return [self._deployment().url]

    def reference(self, settle: Callable[[], None]) -> tuple[list[list[int]], list[str]]:
        """The single-process reference: one answer by construction, none to settle."""
        generated = reference_generate(self.checkpoint, PROMPTS, self.options.max_tokens)
        return [list(g.token_ids) for g in generated], []

    def _deployment(self) -> Deployment:
        if self.deployment is None:
            raise RuntimeError("the chaos campaign has no cluster deployment running")
        return self.deployment

    def _orchestrator(self) -> Orchestrator[str]:
        if self.orchestrator is None:
            raise RuntimeError("the chaos campaign has no cluster deployment running")
        return self.orchestrator

    def rss(self) -> dict[int, int]:
        return {} if self.deployment is None else self.deployment.rss()

    # -- the rules ------------------------------------------------------------------------
    def live(self) -> list[int]:
        cluster = self._deployment().cluster
        return sorted(cluster.live_ranks() - cluster.removed_ranks)

    def standing(self) -> list[int]:
        return self.live()

    def follows(self, fault: PlannedFault, follow: PlannedFault | None) -> bool:
        """Planned so, unless even a fresh cluster cannot take both."""
        o = self.options
        return (
            follow is not None
            and follow.when is When.RECOVERY
            and o.dp_size - fault.ranks_lost - follow.ranks_lost >= o.min_survivors
        )

    def rebuild_first(self, fault: PlannedFault, follow: PlannedFault | None) -> str | None:
        """Too few ranks left for the faults, and a fresh cluster would have more."""
        live = len(self.live())
        need = fault.ranks_lost + (follow.ranks_lost if follow else 0)
        if live - need < self.options.min_survivors and live < self.options.dp_size:
            return f"{live} ranks left"
        return None

    def wait_steps(self, steps: int) -> None:
        cluster = self._deployment().cluster
        target, deadline = cluster.steps_run + steps, time.monotonic() + 10.0
        while cluster.steps_run < target and time.monotonic() < deadline:
            time.sleep(0.005)

    def steady(self) -> bool:
        engines = self._orchestrator().read()
        return settled_state([dict(e) for e in engines.values()]) == "settled"

    def engines(self) -> object:
        return [(e["id"], e["phase"]) for e in self._deployment().cluster.status()["engines"]]

    def detection_bound(self, kind: ChaosKind) -> float:
        return detection_bound(kind, self.options.op_timeout_s)

    # -- a fault --------------------------------------------------------------------------
    def inject(self, fault: PlannedFault, live: Sequence[int]) -> Injected:
        return inject(self._deployment(), fault, live, self._stash, self.hosts)

    def detected(self, shot: Injected) -> float | None:
        """Seconds until the last rank that had to see the fault went ``quarantined``."""
        cluster = self._deployment().cluster
        changes = cluster.phase_changes()
        seen = []
        for rank in shot.detectors:
            times = [c.at for c in changes.get(rank, ()) if c.dest == "quarantined"]
            times = [t for t in times if t >= shot.at]
            if times:
                seen.append(min(times))
            elif rank in cluster.live_ranks():
                return None
        return max(seen) - shot.at if seen else None

    def shown(self, shot: Injected) -> bool:
        """``shot`` shows in the status: its victims are gone (every kind but the step
        exception kills or stops them), or, for an armed step exception, every live rank's
        status counts a new fault episode (its phase change reaches the supervisor before
        the status that goes with it: read in between, every engine is still healthy)."""
        cluster = self._deployment().cluster
        if shot.fault.kind is not ChaosKind.STEP_RAISE:
            return not set(shot.victims) & cluster.live_ranks()
        live = cluster.live_ranks()
        engines = {e["id"]: e for e in cluster.status()["engines"]}
        return all(
            int(engines[rank].get("fault_episodes") or 0) > before
            for rank, before in shot.episodes.items()
            if rank in live
        )

    def recover(self, fault: int | None, shot: Injected | None, during: During | None) -> Outcome:
        """Past the engines' own recovery deadline, so an engine left waiting ends DEAD
        first."""

        deadline = self.options.recover_deadline_s + 15.0
        return self._orchestrator().recover(fault, deadline, during=during)

    def repair(self, shots: Sequence[Injected]) -> None:
        for shot in reversed(shots):
            shot.repair()  # newest first: each puts back what was there before it

    def heal(self, fault: int | None) -> list[int]:
        """Restart every removed rank's worker (it loads its experts while the others
        serve), tell the members they are ready, and admit them: ``scale_up`` over the HTTP
        API under the orchestrator policy, by the members' own policy under ``auto``; until
        every engine is healthy with nothing removed."""
        if not self.options.rejoin:
            return []
        deployment = self._deployment()
        cluster = deployment.cluster
        removed = sorted(cluster.removed_ranks)
        if not removed:
            return []
        history = self.bench.history
        for rank in removed:
            loaded_s = cluster.restart(rank)
            history.add("restart", fault, rank=rank, loaded_s=round(loaded_s, 3))
        pids = cluster.pids()
        self.bench.census.note([pid for r in removed if (pid := pids.get(r)) is not None], [])
        deployment.worker_pids.update({r: p for r in removed if (p := pids.get(r)) is not None})
        announced = cluster.announce_ready(f"chaos-ready-{fault}-{time.monotonic_ns()}")
        if not announced.success:
            raise ClusterError(f"announcing ranks {removed} ready failed: {announced.reason}")
        if self.options.policy == "orchestrator":
            params = {"added_dp_ranks": removed}
            decision = Decision("command", (), "scale_up", params)
            channel = self._orchestrator().channel
            handle = channel.send(fault, decision, channel.read())
            channel.finish(fault, handle, time.monotonic() + self.options.recover_deadline_s)
        deadline = time.monotonic() + self.options.recover_deadline_s
        while True:
            engines = [dict(e) for e in self._orchestrator().read().values()]
            if settled_state(engines) == "settled" and not cluster.removed_ranks:
                return removed
            if time.monotonic() > deadline:
                raise ClusterError(f"ranks {removed} not admitted back: {engines}")
            time.sleep(0.02)

    def judge(self, shot: Injected, outcome: Outcome) -> tuple[FaultResult, list[str]]:
        fault = shot.fault
        result = FaultResult(
            index=fault.index, kind=fault.kind, when=fault.when, step=shot.step,
            victims=shot.victims, detect_s=self.detected(shot),
            recover_s=outcome.at - shot.at, outcome=outcome.state, engines=outcome.engines,
            both_sides_served=self._cut_side_served(shot),
        )  # fmt: skip
        return result, check_fault(result, self.options.op_timeout_s)

    def _cut_side_served(self, shot: Injected) -> bool:
        """A cut rank went back to serving after the cut (its engine healthy again, or still
        alive and healthy at the end) while the other side serves: both sides served."""
        if shot.fault.kind is not ChaosKind.NET_CUT:
            return False
        cluster = self._deployment().cluster
        changes = cluster.phase_changes()
        status = {e["id"]: e for e in cluster.status()["engines"]}
        for rank in shot.victims:
            back = [c for c in changes.get(rank, ()) if c.at > shot.at and c.dest == "healthy"]
            alive_ok = status[rank].get("alive") and status[rank]["status"] == 0
            if back or alive_ok:
                return True
        return False

    # -- the report -----------------------------------------------------------------------
    def verdict(self, record: StreamRecord, problems: list[str]) -> list[str]:
        return problems

    def about(self, campaign: Ran) -> dict[str, Any]:
        """The sub-plan replayed, the faults nobody planned, the mode and the sizes."""
        o = self.options
        return {
            "only": None if o.only is None else list(o.only),
            "unplanned_faults": campaign.unplanned,
            "not_covered": POISON_NOT_COVERED if o.netns else NOT_COVERED,
            "netns": o.netns,
            "rejoin": o.rejoin,
            "rejoins": len(campaign.rejoin_s),
            "rejoin_s": spread(campaign.rejoin_s),
            "seed": o.seed,
            "policy": o.policy,
            "dp_size": o.dp_size,
            "clients": o.clients,
            "prompts": len(PROMPTS),
        }
