"""Token-level re-inference inside vLLM's engine core (on by default; ``"reinference":
false`` in the ``ftengine`` options turns it off): a fault holds the engine core's requests
instead of aborting them, and after ``retry`` they continue from their last emitted token.

vLLM 0.32's ``EngineCoreSentinel.on_fault`` finishes every request as aborted. With a
:class:`Hold` installed it does what it does otherwise (status, fault info, status push) but
holds instead: the scheduler preempts its running requests back to waiting with vLLM's own
``reset_prefix_cache(reset_running_requests=True)`` (their KV and the prefix cache, which
the faulted step may have written, are dropped; their emitted tokens are kept, so they are
recomputed from prompt + emitted tokens), and the waiting ones stay. The faulted step's
outputs never left the engine core, so a resumed stream has no gap and no repeat. The busy
loop of ``fault_tolerant_wrapper`` waits on ``sentinel.resumed``; after ``retry`` sets it,
the held requests are scheduled again as vLLM schedules any preempted request (the worker
keeps their model-runner states for that: ``VllmWorkerHooks.keep_request_states``).

Bounds (``ftengine.reinference.Reinference``, one definition with the CPU cluster): a
request running in more than ``max_reinference`` faulted steps is aborted with the reason
in ``stop_reason``; an engine whose fault leaves it DEAD aborts what it held; a wait past
``engine_recovery_timeout_sec`` aborts every held request before vLLM's wrapper gives up.
A DEAD engine of a deployment of several ranks hands what it held to a survivor instead
(``ftengine.integrations.vllm.engine_core.handoff``).
A poison request (its own content faults every re-run) is found by re-running the requests
of the engine's own faulted step one at a time (``poison.py``) and aborted alone, with
``Reinference.poison``'s reason; its batch-mates are not charged for that fault.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from ftengine.integrations.vllm.config import VllmFtSettings
from ftengine.integrations.vllm.engine_core import handoff
from ftengine.integrations.vllm.engine_core.parking import ParkableEvent
from ftengine.integrations.vllm.engine_core.poison import EngineProbe, own_fault
from ftengine.integrations.vllm.engine_core.poison import install as install_probe
from ftengine.integrations.vllm.messages import import_vllm
from ftengine.reinference import Reinference

logger = logging.getLogger(__name__)

HOLD_ATTR = "_ftengine_hold"
ENGINE_MODULE = "vllm.v1.engine"
REQUEST_MODULE = "vllm.v1.request"


@attrs.define
class Hold:
    """One engine core's held requests: how many faulted steps each ran in, since when the
    current fault holds them (``time.monotonic``; None while nothing is held), and the
    poison probe that re-runs the requests of an own fault one at a time (``poison.py``)."""

    bounds: Reinference
    reruns: dict[str, int] = attrs.field(factory=dict)
    since: float | None = None
    probe: EngineProbe = attrs.field(factory=EngineProbe)

    def hold(self, engine: Any, own: bool = True) -> None:
        """On a fault (busy-loop thread; ``own``: this engine's, not a peer's): running
        requests back to waiting, KV dropped; a poison request found by the probe aborted
        alone, else the ones over the re-run limit aborted with the reason."""
        scheduler = engine.scheduler
        running = list(scheduler.running)
        # vLLM's own way to drop every running request's KV and the prefix cache: each goes
        # back to the front of the waiting queue as PREEMPTED, its emitted tokens kept.
        scheduler.reset_prefix_cache(reset_running_requests=True)
        waiting = import_vllm(REQUEST_MODULE).RequestStatus.WAITING
        for request in running:
            # The faulted step's output never comes: nothing of it is in flight any more
            # (else vLLM would skip, then drop, the resumed step's output as stale).
            request.num_in_flight_tokens = 0
            request.num_stale_output_tokens = 0
            request.drop_stale_output = False
            if request.num_output_tokens == 0:
                # Sent again as a new request: the step that first scheduled it may have
                # faulted before the model runner recorded it, and a PREEMPTED one is sent
                # as cached (the runner's KeyError). A runner that has it takes it as vLLM's
                # streaming update (new blocks, 0 computed, same prompt).
                request.status = waiting
        self.reruns = {rid: n for rid, n in self.reruns.items() if rid in scheduler.requests}
        poison = self.probe.faulted([r.request_id for r in running], own)
        if poison is not None:
            # Its batch-mates are not charged: the fault was the poison's, not theirs.
            culprit = [r for r in running if r.request_id == poison]
            abort(engine, culprit, Reinference.poison(int(engine.engine_index)))
        else:
            self._charge(engine, running)
        self.since = self.since or time.monotonic()
        logger.warning(
            "[FT] engine %s holds %d requests (%d were running; %s fault, %d suspected) for "
            "re-inference", getattr(engine, "engine_index", "?"), len(scheduler.requests),
            len(running), "its own" if own else "a peer's", len(self.probe.probe.suspects),
        )  # fmt: skip

    def _charge(self, engine: Any, running: Sequence[Any]) -> None:
        """One more faulted step for each of ``running``; those over the limit aborted."""
        over: dict[str, list[Any]] = defaultdict(list)
        for request in running:
            count = self.reruns[request.request_id] = self.reruns.get(request.request_id, 0) + 1
            reason = self.bounds.over_limit(count)
            if reason is not None:
                over[reason].append(request)
        for reason, requests in over.items():
            abort(engine, requests, reason)
            for request in requests:
                self.probe.ended(request.request_id)

    def release(self, engine: Any, reason: str) -> None:
        """Abort every request the engine holds, with ``reason``."""
        abort(engine, held_requests(engine), reason)
        self.since = None

    def resumed(self) -> None:
        """The engine serves again: the next fault's hold starts its own clock."""
        self.since = None


def abort_held(sentinel: Any, why: str) -> None:
    """An engine that stops outside ``on_fault`` where nobody may serve its requests (its
    policy gave up: a partition's minority): abort what it holds, with the reason, so no
    client waits for a recovery that will not come."""
    hold: Hold | None = getattr(sentinel, HOLD_ATTR, None)
    if hold is not None:
        hold.release(sentinel.engine, Reinference.dead(why))


def release_dead(sentinel: Any, why: str) -> None:
    """An engine DEAD with survivors serving (its worker died, or its ``scale_down`` failed
    for good): what it holds is handed to a survivor where it has a :class:`handoff.Handoff`
    (several ranks); what cannot be (or everything, without one) is aborted with the reason."""
    hold: Hold | None = getattr(sentinel, HOLD_ATTR, None)
    if hold is None:
        return
    engine = sentinel.engine
    reason = Reinference.dead(why)
    refused = handoff.release_dead(sentinel, engine, held_requests(engine), reason)
    if refused is None:
        hold.release(engine, reason)
        return
    for abort_reason, requests in refused.items():
        abort(engine, requests, abort_reason)
    hold.since = None


def held_requests(engine: Any) -> list[Any]:
    """Every unfinished request the engine core's scheduler has."""
    return [r for r in engine.scheduler.requests.values() if not r.is_finished()]


def abort(engine: Any, requests: Sequence[Any], reason: str) -> None:
    """Finish ``requests`` as aborted and tell their clients why (``stop_reason``)."""
    status = import_vllm(REQUEST_MODULE).RequestStatus
    finished = engine.scheduler.finish_requests(
        [r.request_id for r in requests], status.FINISHED_ABORTED
    )
    v1 = import_vllm(ENGINE_MODULE)
    by_client: dict[int, list[str]] = defaultdict(list)
    for request in finished:
        by_client[request.client_index].append(request.request_id)
    for client, ids in by_client.items():
        outputs = [
            v1.EngineCoreOutput(
                request_id=rid,
                new_token_ids=[],
                finish_reason=v1.FinishReason.ABORT,
                stop_reason=reason,
            )
            for rid in ids
        ]
        engine.output_queue.put_nowait(
            (client, v1.EngineCoreOutputs(finished_requests=set(ids), outputs=outputs))
        )
    if finished:
        logger.warning("[FT] aborted %d held requests: %s", len(finished), reason)


class ResumedOrDeadline(ParkableEvent):
    """``EngineCoreSentinel.resumed`` with the hold's deadline: when the wrapper's wait for
    a recovery times out (the busy-loop thread, about to give up and re-raise), every
    held request is aborted first, with the reason, so clients learn why. Parkable
    (``parking.py``): a parked engine's wait does not time out."""

    def __init__(self, hold: Hold, engine: Any) -> None:
        super().__init__()
        self.hold = hold
        self.engine = engine

    def set(self) -> None:
        self.hold.resumed()
        super().set()

    def wait(self, timeout: float | None = None) -> bool:
        recovered = super().wait(timeout)
        if not recovered and timeout is not None and self.hold.since is not None:
            # The wrapper waited the whole deadline: past it, whatever the clocks' jitter.
            held_s = max(time.monotonic() - self.hold.since, self.hold.bounds.deadline_s + 0.05)
            self.hold.release(self.engine, self.hold.bounds.expired(held_s) or "")
        return recovered


def install(
    sentinel: Any,
    settings: VllmFtSettings,
    check_seams: Callable[[], None],
    last_read: Callable[[], Mapping[int, str]] | None = None,
) -> None:
    """Give a new ``EngineCoreSentinel`` its :class:`Hold` when ``settings.reinference``
    (else vLLM's ``on_fault`` aborts as before), once ``check_seams`` (``patches.
    check_reinference_seams``) found the vLLM names it calls where it expects them; its
    handoff falls back on ``last_read`` (the peers' API servers on the agent's DP board)."""
    if not settings.reinference:
        return
    check_seams()
    bounds = Reinference(settings.max_reinference, settings.recovery_timeout_s)
    hold = Hold(bounds, probe=install_probe(sentinel.engine.scheduler))
    resumed = ResumedOrDeadline(hold, sentinel.engine)
    if sentinel.resumed.is_set():
        resumed.set()
    sentinel.resumed = resumed
    setattr(sentinel, HOLD_ATTR, hold)
    handoff.install(sentinel, settings, last_read)


def hold_or_abort(
    sentinel: Any,
    exc: BaseException,
    vllm_on_fault: Any,
    peers: Mapping[int, str] | None = None,
) -> None:
    """What the patched ``EngineCoreSentinel.on_fault`` runs: vLLM's own ``on_fault``
    (``vllm_on_fault``) without a :class:`Hold`, the requests it would abort aborted first
    with the reason (vLLM gives none); with one, the same steps (vLLM 0.32's)
    except that requests are held, or aborted with the reason when the engine is DEAD (its
    worker process died: nothing can resume them here). ``peers``: the engine-core agent's
    view of its peers' statuses (``poison.own_fault``)."""
    hold: Hold | None = getattr(sentinel, HOLD_ATTR, None)
    engine = sentinel.engine
    dead = bool(getattr(engine.model_executor, "is_failed", False))
    if hold is None:
        # vLLM's on_fault aborts every request without a word: abort them first, saying why.
        what = "lost its worker" if dead else "faulted"
        fault = f"engine {sentinel.engine_index} {what} ({type(exc).__name__})"
        abort(engine, held_requests(engine), Reinference.off(fault))
        vllm_on_fault(sentinel, exc)
        return
    statuses = import_vllm(ENGINE_MODULE).EngineStatusType
    sentinel.resumed.clear()
    logger.warning("[FT] Busy loop raised %s. Holding requests for recovery.", type(exc).__name__)
    if engine.batch_queue is not None:
        engine.batch_queue.clear()
    sentinel.status_type = statuses.DEAD if dead else statuses.UNHEALTHY
    sentinel.fault_info = type(exc).__name__
    if dead:
        # With survivors to hand them to (several ranks) they resume there instead.
        release_dead(
            sentinel, f"engine {sentinel.engine_index}'s worker process died ({type(exc).__name__})"
        )
    else:
        hold.hold(engine, own_fault(exc, peers or {}))
    logger.info(
        "[FT] Engine %d status -> %s:", sentinel.engine_index, sentinel.status_type.name,
        exc_info=exc,
    )  # fmt: skip
    sentinel._push_status()
