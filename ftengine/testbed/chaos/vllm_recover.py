"""Real vLLM's side of recovery (``recovery.Orchestrator`` drives it): every rank's
``/fault_tolerance/status`` read through the status watch, :func:`vllm_plan.decide` asked
what to do, ``retry`` / ``scale_down`` POSTed to vLLM's ``/fault_tolerance/apply`` of every
faulted rank (vLLM answers 202 and runs it in the background: the command's end is seen
on the status), a hung engine fenced by SIGKILL of its worker."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import httpx

from ftengine.testbed.chaos.history import History
from ftengine.testbed.chaos.recovery import Decision, Engines
from ftengine.testbed.chaos.vllm_plan import decide
from ftengine.testbed.chaos.vllm_watch import StatusWatch

MARK = ("status", "epoch", "ft_error", "last_ft_request_id", "removed_ranks")
"""The status fields a finished command changes on the engine that ran it."""


def _mark(engine: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(str(engine.get(key)) for key in MARK)


@attrs.define
class VllmRules:
    """One recovery's rules on vLLM: :func:`vllm_plan.decide`, with how long some engines
    have been faulted while others still serve (a peer that has not faulted past
    ``grace_s`` of that is hung, and fenced)."""

    grace_s: float
    mixed_since: float | None = None

    def __call__(self, engines: Engines, may_die: Sequence[int], now: float) -> Decision:
        sick = any(e["status"] == "unhealthy" for e in engines.values())
        well = any(e["status"] == "healthy" for e in engines.values())
        self.mixed_since = (self.mixed_since or now) if sick and well else None
        decision = decide(engines, may_die, now - (self.mixed_since or now), self.grace_s)
        if decision.action == "fence":
            self.mixed_since = None  # the fenced go dead: their peers' grace starts again
        return decision


@attrs.frozen
class _Sent:
    """A command sent: the line about it, its targets and their status before."""

    line: str
    targets: tuple[int, ...]
    before: dict[int, tuple[str, ...]]
    until: float


class VllmChannel:
    """Every rank's own server (``urls[r]``; ``workers[r]``: its worker's pid, for
    fencing), read through ``watch``."""

    poll_s = 0.05

    def __init__(
        self,
        urls: Sequence[str],
        workers: Mapping[int, int],
        watch: StatusWatch,
        history: History,
        *,
        command_timeout_s: float,
        on_fence: Callable[[int], object] = lambda _rank: None,
        http: httpx.Client | None = None,
    ) -> None:
        self.urls = list(urls)
        self.workers = dict(workers)
        self.watch = watch
        self.history = history
        self.command_timeout_s = command_timeout_s
        self.fenced: list[int] = []
        self.on_fence = on_fence  # the campaign stops sending streams to a fenced rank
        self.http = http or httpx.Client(timeout=30.0)

    def close(self) -> None:
        self.http.close()

    def read(self) -> Engines:
        return self.watch.poll()

    def fence(self, fault: int | None, ranks: Sequence[int]) -> None:
        """SIGKILL the workers of ``ranks``: engines that did not fault while their peers'
        collectives timed out on them are hung, and only their death frees the peers."""
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.workers[rank], signal.SIGKILL)
            self.fenced.append(rank)
            self.on_fence(rank)
        why = "no fault seen while its peers' ops timed out on it"
        self.history.add("fence", fault, ranks=list(ranks), why=why)

    def send(self, fault: int | None, decision: Decision, engines: Engines) -> _Sent:
        """POST the decision's command to every target."""
        sent_at = time.monotonic()
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
        line = f"{decision.instruction} {decision.params} -> {answers}"
        before = {r: _mark(engines[r]) for r in decision.targets}
        return _Sent(line, decision.targets, before, sent_at + self.command_timeout_s)

    def finish(self, fault: int | None, handle: _Sent, until: float) -> str:
        """Until every target's status shows the command ended (or ``until``, at most the
        command timeout after it was sent)."""
        until = min(until, handle.until)
        while time.monotonic() < until:
            engines = self.watch.latest()
            if all(_mark(engines.get(r, {})) != handle.before[r] for r in handle.targets):
                self.history.add(
                    "command_done", None, engines={r: engines[r] for r in handle.targets}
                )
                return handle.line
            time.sleep(self.poll_s)
        self.history.add("command_stuck", None, targets=list(handle.targets))
        return handle.line
