"""Recovery of a real vLLM deployment driven as an orchestrator drives it: every rank's
``/fault_tolerance/status`` read, :func:`ftengine.testbed.chaos.vllm_plan.decide` asked what to do,
``retry`` / ``scale_down`` POSTed to vLLM's ``/fault_tolerance/apply`` of every faulted
rank (vLLM answers 202 and runs it in the background: the command's end is seen on the
status), a hung engine fenced by SIGKILL of its worker, until it settles, ends dead, or
the deadline passes (``stuck``)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from ftengine.testbed.chaos.history import History
from ftengine.testbed.chaos.orchestrate import Outcome
from ftengine.testbed.chaos.vllm_plan import Decision, decide
from ftengine.testbed.chaos.vllm_watch import StatusWatch

POLL_S = 0.05
MARK = ("status", "epoch", "ft_error", "last_ft_request_id", "removed_ranks")
"""The status fields a finished command changes on the engine that ran it."""


def _mark(engine: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(str(engine.get(key)) for key in MARK)


class VllmOrchestrator:
    """Drives one deployment's recoveries (``urls[r]``: rank r's server; ``workers[r]``:
    its worker's pid, for fencing)."""

    def __init__(
        self,
        urls: Sequence[str],
        workers: Mapping[int, int],
        watch: StatusWatch,
        history: History,
        *,
        grace_s: float,
        command_timeout_s: float,
        on_fence: Callable[[int], object] = lambda _rank: None,
        http: httpx.Client | None = None,
    ) -> None:
        self.urls = list(urls)
        self.workers = dict(workers)
        self.watch = watch
        self.history = history
        self.grace_s = grace_s
        self.command_timeout_s = command_timeout_s
        self.fenced: list[int] = []
        self.on_fence = on_fence  # the campaign stops sending streams to a fenced rank
        self.http = http or httpx.Client(timeout=30.0)

    def close(self) -> None:
        self.http.close()

    def recover(
        self,
        fault: int | None,
        may_die: Sequence[int],
        deadline_s: float,
        on_command: Callable[[], Sequence[int]] | None = None,
    ) -> Outcome:
        """Drive recovery until it settles, ends dead or ``deadline_s`` passes;
        ``on_command`` runs once, right after the first command went out (the campaign's
        recovery-phase fault), and returns the ranks it hit (they may end dead too)."""
        deadline, commands = time.monotonic() + deadline_s, list[str]()
        dying, hooks = list(may_die), [] if on_command is None else [on_command]
        mixed_since: float | None = None  # some engines faulted while others still serve
        while True:
            engines, now = self.watch.poll(), time.monotonic()
            sick = any(e["status"] == "unhealthy" for e in engines.values())
            well = any(e["status"] == "healthy" for e in engines.values())
            mixed_since = (mixed_since or now) if sick and well else None
            decision = decide(engines, dying, now - (mixed_since or now), self.grace_s)
            if decision.action == "done":
                return Outcome(decision.state, now, tuple(engines.values()), tuple(commands))
            if now > deadline:
                return Outcome("stuck", now, tuple(engines.values()), tuple(commands))
            if decision.action == "fence":
                self._fence(fault, decision.targets)
                dying += decision.targets
                mixed_since = None
            elif decision.action == "command":
                commands.append(self._command(fault, decision, engines))
                if hooks:
                    dying += hooks.pop()()
                self._await(decision.targets, engines, min(deadline, now + self.command_timeout_s))
            time.sleep(POLL_S)

    def _fence(self, fault: int | None, ranks: Sequence[int]) -> None:
        """SIGKILL the workers of ``ranks``: engines that did not fault while their peers'
        collectives timed out on them are hung, and only their death frees the peers."""
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.workers[rank], signal.SIGKILL)
            self.fenced.append(rank)
            self.on_fence(rank)
        why = "no fault seen while its peers' ops timed out on it"
        self.history.add("fence", fault, ranks=list(ranks), why=why)

    def _command(
        self, fault: int | None, decision: Decision, engines: Mapping[int, Mapping[str, Any]]
    ) -> str:
        """POST the decision's command to every target; returns a one-line account."""
        body = {"instruction": decision.instruction, "params": decision.params}
        answers = {}
        for rank in decision.targets:
            try:
                reply = self.http.post(f"{self.urls[rank]}/fault_tolerance/apply", json=body)
                answers[rank] = reply.status_code
            except httpx.HTTPError as exc:
                answers[rank] = -1
                self.history.add("command_error", fault, rank=rank, error=repr(exc))
        self.history.add(
            "command", fault, instruction=decision.instruction, params=decision.params,
            http=answers, epochs={r: engines[r].get("epoch") for r in decision.targets},
        )  # fmt: skip
        return f"{decision.instruction} {decision.params} -> {answers}"

    def _await(
        self, targets: Sequence[int], before: Mapping[int, Mapping[str, Any]], until: float
    ) -> None:
        """Until every target's status shows the command ended (or ``until``)."""
        marks = {r: _mark(before[r]) for r in targets}
        while time.monotonic() < until:
            engines = self.watch.latest()
            if all(_mark(engines.get(r, {})) != marks[r] for r in targets):
                self.history.add("command_done", None, engines={r: engines[r] for r in targets})
                return
            time.sleep(POLL_S)
        self.history.add("command_stuck", None, targets=list(targets))
