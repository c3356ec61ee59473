"""Poison requests inside vLLM's engine core (with ``"reinference": true``): a request whose
own content makes every re-run fault is found and aborted alone, its batch-mates resume.

The rule is the CPU cluster's (``ftengine.reinference.PoisonProbe``): after a fault of this
engine's own (its worker raised; not a peer's timeout or death, which only tell that some
other engine faulted), the requests that ran in the faulted step become suspects, and once
the engine serves again they are re-run one at a time. vLLM's scheduler runs the probe (and
every request that ran clean since the fault) while the other suspects and any request not
yet run since the fault stay held, a step each: the one seam is
``Scheduler._handle_blocked_waiting_request``, vLLM's own "skip this waiting request for
this step" (:func:`skipping_suspects`). Each step whose output comes back clears the
requests it ran (``Scheduler.update_from_output``, :func:`noting_clean_steps`). When the
probe's step faults on this engine again while every other request in it had run clean
since the fault, the probe is the poison request: the hold aborts it alone, with
``Reinference.poison``'s reason, and charges no re-run to the others.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from typing import Any

import attrs

from ftengine.collective_errors import classify_exception
from ftengine.faults import FaultKind
from ftengine.reinference import PoisonProbe

PROBE_ATTR = "_ftengine_probe"
"""The :class:`EngineProbe` on a vLLM ``Scheduler`` instance (none: vLLM's own behaviour)."""
PEER_KINDS = frozenset({FaultKind.HUNG_PEER, FaultKind.DEAD_PEER})


def own_fault(exc: BaseException, peers: Mapping[int, str]) -> bool:
    """Whether the busy loop's ``exc`` is this engine's own fault, one that its requests
    may have caused: not a peer's (a collective timed out, a peer's socket closed, the
    agent's ``PeerDead``), which says nothing of what this engine ran, and no peer is dead
    already (``peers``: the engine-core agent's view of its peers' statuses; a worker that
    lost a peer may raise something else). A peer merely ``unhealthy`` does not count: after
    a recovery a peer's last status may still say so for a moment (the agents' settle
    time), and a peer waiting for this engine's faulted step may report before this
    engine's own fault reaches here. In doubt it is a peer's: then no poison is looked for
    and the re-run limit still bounds every request."""
    if any(status == "dead" for status in peers.values()):
        return False
    return classify_exception(exc) not in PEER_KINDS


@attrs.define
class EngineProbe:
    """One engine core's poison probe: the suspects, and which requests ran a clean step
    since the last fault (``clean``; kept only while somebody is suspected)."""

    probe: PoisonProbe = attrs.field(factory=PoisonProbe)
    clean: set[str] = attrs.field(factory=set)

    def faulted(self, ran: Collection[str], own: bool) -> str | None:
        """A step that ran ``ran`` (request ids) faulted, ``own`` saying whether the fault
        was this engine's: the poison request, or None, in which case those that ran are
        suspects now (an own fault) and nobody counts as clean any more."""
        poison = self.probe.culprit(ran, self.clean) if own else None
        if poison is not None:
            self.probe.cleared(poison)
            return poison
        if own:
            self.probe.suspect(list(ran))
        self.clean = set()
        return None

    def ended(self, request_id: str) -> None:
        """``request_id`` was aborted: it is no longer suspected."""
        self.probe.cleared(request_id)

    def waits(self, request_id: str, requests: Mapping[str, Any]) -> bool:
        """Whether ``request_id`` must wait this step: suspected and not the probe, or,
        while a probe is out, one that has run no clean step since the fault (arrived
        since, or waiting then): the probe then runs beside none but requests that ran
        clean, so a fault of its step is its own. (Seen on hosts: a poison request re-run
        beside new arrivals three times over was aborted by the re-run limit, unnamed.)
        Suspects no longer among the scheduler's unfinished ``requests`` (a client aborted
        them) are dropped first, so that they never hold the others back."""
        while (head := self.probe.probe()) is not None and _gone(requests.get(head)):
            self.probe.cleared(head)
        if head is None or request_id == head:
            return False
        return self.probe.waits(request_id) or request_id not in self.clean

    def ran_clean(self, request_ids: Collection[str]) -> None:
        """A step's output came back for ``request_ids``: they are no longer suspected."""
        if not self.probe.suspects:
            return  # nothing to find until the next fault, which resets ``clean``
        for request_id in request_ids:
            self.probe.cleared(request_id)
            self.clean.add(request_id)


def _gone(request: Any) -> bool:
    return request is None or bool(request.is_finished())


def install(scheduler: Any) -> EngineProbe:
    """Give vLLM's ``scheduler`` its :class:`EngineProbe` (the patched methods read it)."""
    probe = EngineProbe()
    setattr(scheduler, PROBE_ATTR, probe)
    return probe


def skipping_suspects(handle: Callable[..., bool]) -> Callable[..., bool]:
    """``Scheduler._handle_blocked_waiting_request(request)``: False ("skip it this step",
    vLLM keeps it waiting in its place) for a suspect that is not the probe, else vLLM's."""

    @functools.wraps(handle)
    def handle_unless_suspected(self: Any, request: Any) -> bool:
        probe: EngineProbe | None = getattr(self, PROBE_ATTR, None)
        if probe is not None and probe.waits(request.request_id, self.requests):
            return False
        return handle(self, request)

    return handle_unless_suspected


def noting_clean_steps(update: Callable[..., Any]) -> Callable[..., Any]:
    """``Scheduler.update_from_output(scheduler_output, model_runner_output)``: vLLM's,
    then the step's requests ran clean."""

    @functools.wraps(update)
    def update_then_note(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = update(self, scheduler_output, model_runner_output)
        probe: EngineProbe | None = getattr(self, PROBE_ATTR, None)
        if probe is not None:
            probe.ran_clean(scheduler_output.num_scheduled_tokens)
        return outputs

    return update_then_note
