"""Continuous batching over the cluster's lockstep steps: requests join and leave between
steps, and each one's tokens are handed out as they come (for streaming).

Every cycle admits waiting requests (each onto the least loaded live rank, where its KV
cache then stays), runs one step in which every running request advances by one token
(its prompt on its first step), hands each request its token, and finishes those that
reached ``max_tokens`` or generated a stop id, dropping their caches. Every live rank runs
every step whatever the mix, and the model computes each request on its own shapes, so a
request's tokens do not depend on what it shares a step with. A request a rank rejects
fails alone (``error``). A failed step (a fault) aborts every running request, unless the
loop was given a :class:`~ftengine.testbed.cluster.inflight.Resumption` (token-level
re-inference): then the running and waiting requests are held while the cluster recovers
and resume from their last emitted token (a request whose rank is gone is re-routed and
recomputed), so each stream carries exactly the fault-free tokens; see
``ftengine.reinference`` for the bounds and the reasons a held request ends with.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs

from ftengine.errors import FTEngineError
from ftengine.reinference import ReplayMismatch, TokenLedger
from ftengine.testbed.cluster.generation import StepFailed, StepResult
from ftengine.testbed.cluster.inflight import Held, Resumption
from ftengine.testbed.cluster.protocol import StepItem
from ftengine.testbed.serving_api import FinishReason, GenerationRequest, Listener, TokenEvent

logger = logging.getLogger(__name__)

SHUTDOWN_REASON = "the server is shutting down"
HOLD_POLL_S = 0.05  # how often held requests look whether the cluster serves again


class ServingUnavailable(FTEngineError, RuntimeError):
    """The serving loop cannot take a request now (closed, or too many waiting)."""


class StepCluster(Protocol):
    """What the loop needs from a cluster (``ftengine.testbed.cluster.Cluster`` has it)."""

    def serving_ranks(self) -> tuple[int, ...]:
        """Live ranks when all serve; raises an FTEngineError (RequestAborted) otherwise."""
        ...

    def run_step(self, items: Mapping[int, Sequence[StepItem]]) -> StepResult:
        """One lockstep step; raises an FTEngineError (RequestAborted) when it failed."""
        ...

    def release(self, rank: int, request_ids: Sequence[str]) -> None:
        """Drop these requests' caches on ``rank`` with its next step."""
        ...


@attrs.define(eq=False)
class _Running:
    """One request inside the loop: where it runs and its tokens so far (its ledger)."""

    request_id: str
    request: GenerationRequest
    listener: Listener
    rank: int | None = None
    ledger: TokenLedger = attrs.field()
    cancelled: bool = False

    @ledger.default
    def _ledger(self) -> TokenLedger:
        return TokenLedger(self.request.prompt_token_ids)

    def item(self, checked: bool) -> StepItem:
        """This step's input; ``checked``: the rank verifies the cache length first."""
        start, tokens = self.ledger.next_input()
        return StepItem(self.request_id, tokens, start=start if checked else None)

    def advance(self, token: int) -> TokenEvent | None:
        """Take the step's token; the event says whether that finished the request (None:
        the step replayed a token already emitted). Raises ReplayMismatch."""
        if self.ledger.accept(token) is None:
            return None
        if token in self.request.stop_token_ids:
            return TokenEvent((token,), FinishReason.STOP, stop_reason=token)
        if len(self.ledger.emitted) >= self.request.max_tokens:
            return TokenEvent((token,), FinishReason.LENGTH)
        return TokenEvent((token,))


class Ticket:
    """A submitted request; :meth:`cancel` aborts it (finish ``abort``) before the next step."""

    def __init__(self, loop: ServingLoop, running: _Running) -> None:
        self._loop = loop
        self._running = running

    def cancel(self) -> None:
        """Abort the request (the client went away); no-op once it finished."""
        self._loop.cancel(self._running)


class ServingLoop:
    """A thread that serves submitted requests with continuous batching on ``cluster``.

    At most ``max_running`` requests share a step; up to ``max_waiting`` more queue.
    ``resumption`` turns token-level re-inference on (None: a fault aborts them).
    """

    def __init__(
        self,
        cluster: StepCluster,
        *,
        max_running: int = 256,
        max_waiting: int = 4096,
        resumption: Resumption | None = None,
    ) -> None:
        self._cluster = cluster
        self._held = None if resumption is None else Held(resumption)
        self._max_running = max_running
        self._max_waiting = max_waiting
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Running] = collections.deque()
        self._running: list[_Running] = []  # touched by the loop thread only
        self._ids = itertools.count(1)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ftengine-serving", daemon=True)

    def start(self) -> ServingLoop:
        """Start the loop's thread; returns self."""
        self._thread.start()
        return self

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking requests, abort the ones left (finish ``abort``), join the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest, listener: Listener) -> Ticket:
        """Queue ``request``; ``listener`` then gets its events on the loop's thread.

        Raises RequestAborted when the cluster is not serving now (nothing is queued) and
        ServingUnavailable when the loop is closed or full.
        """
        self._cluster.serving_ranks()  # fail now rather than queue a request bound to abort
        with self._cond:
            if self._closed:
                raise ServingUnavailable("the serving loop is closed (server shutting down)")
            if len(self._waiting) >= self._max_waiting:
                raise ServingUnavailable(
                    f"{len(self._waiting)} requests are already waiting (the limit); retry later"
                )
            running = _Running(f"srv-{next(self._ids)}", request, listener)
            self._waiting.append(running)
            self._cond.notify_all()
        return Ticket(self, running)

    def cancel(self, running: _Running) -> None:
        """Mark ``running`` cancelled; the loop drops it before its next step."""
        with self._cond:
            running.cancelled = True
            self._cond.notify_all()

    # -- the loop thread -------------------------------------------------------------------
    def _run(self) -> None:
        while self._wait_for_work():
            try:
                self._cycle()
            except Exception as exc:
                # A bug must not kill serving: fail what was running, keep the loop alive.
                logger.exception("serving cycle failed")
                self._finish(self._take_all(), FinishReason.ERROR, f"internal error: {exc!r}")
        self._finish(self._take_all(), FinishReason.ABORT, SHUTDOWN_REASON)

    def _wait_for_work(self) -> bool:
        with self._cond:
            while not self._closed and not self._waiting and not self._running:
                self._cond.wait()
            return not self._closed

    def _cycle(self) -> None:
        try:
            ranks = self._cluster.serving_ranks()
        except FTEngineError as exc:
            self._not_serving(exc)
            return
        self._reroute(ranks)
        self._admit(ranks)
        self._drop_cancelled()
        if not self._running:
            return
        items: dict[int, list[StepItem]] = {}
        ran = [
            r
            for r in self._running
            if self._held is None or not self._held.probe.waits(r.request_id)
        ]
        for running in ran:
            assert running.rank is not None  # set on admission
            items.setdefault(running.rank, []).append(running.item(self._held is not None))
        try:
            result = self._cluster.run_step(items)
        except FTEngineError as exc:
            self._step_failed(exc, ran)
            return
        if self._held is not None:
            self._held.resumed()
        self._deliver(result, {r.request_id for r in ran})

    # -- held requests (re-inference) ---------------------------------------------------------
    def _not_serving(self, exc: FTEngineError) -> None:
        held = self._held
        why = str(exc) if held is None else held.give_up()
        if why is None and held is not None:
            held.hold()  # everything waits for the recovery
            with self._cond:
                self._cond.wait(HOLD_POLL_S)
            return
        self._finish(self._take_all(), FinishReason.ABORT, why or str(exc))

    def _step_failed(self, exc: FTEngineError, ran: Sequence[_Running]) -> None:
        held = self._held
        if held is None:
            self._finish(self._take_running(), FinishReason.ABORT, str(exc))
            return
        if not isinstance(exc, StepFailed):  # raced with a rank leaving: re-plan the step
            held.hold()
            return
        by_id = {r.request_id: r for r in ran}
        for ending in held.step_failed(exc, [(r.request_id, r.rank or 0, r.ledger) for r in ran]):
            gone = by_id[ending.request_id]
            self._running.remove(gone)
            reason = FinishReason.ERROR if ending.poison else FinishReason.ABORT
            self._finish([gone], reason, ending.detail)
        logger.warning(
            "step failed, %d requests held for re-inference: %s", len(self._running), exc
        )

    def _reroute(self, ranks: Sequence[int]) -> None:
        """Requests whose rank no longer serves (scaled away) move to the least loaded
        survivor and recompute their prompt and emitted tokens there."""
        lost = [r for r in self._running if r.rank not in ranks]
        if not lost:
            return
        load = self._load(ranks)
        for running in lost:
            running.rank = _least_loaded(load)
            running.ledger.cache_lost()

    def _admit(self, ranks: Sequence[int]) -> None:
        load = self._load(ranks)
        with self._cond:
            while self._waiting and len(self._running) < self._max_running:
                running = self._waiting.popleft()
                running.rank = _least_loaded(load)
                self._running.append(running)

    def _load(self, ranks: Sequence[int]) -> collections.Counter[int]:
        """Running requests per serving rank."""
        load = collections.Counter({rank: 0 for rank in ranks})
        load.update(r.rank for r in self._running if r.rank is not None and r.rank in load)
        return load

    def _drop_cancelled(self) -> None:
        with self._cond:
            gone = [r for r in (*self._waiting, *self._running) if r.cancelled]
            self._waiting = collections.deque(r for r in self._waiting if not r.cancelled)
            self._running = [r for r in self._running if not r.cancelled]
        self._finish(gone, FinishReason.ABORT, "cancelled (the client went away)")

    def _deliver(self, result: StepResult, ran: set[str]) -> None:
        still = []
        for running in self._running:
            event = self._outcome(running, result) if running.request_id in ran else None
            if event is not None:
                self._notify(running, event)
            if event is not None and event.finished:
                self._release(running)
            else:
                still.append(running)
        self._running = still

    def _outcome(self, running: _Running, result: StepResult) -> TokenEvent | None:
        """What the step brought ``running``: an event, or None (a replayed token, or a
        lost cache to recompute on the next step)."""
        rid = running.request_id
        if self._held is not None:
            self._held.cleared(rid)
        out = result.outputs.get(rid)
        if out is not None:
            try:
                return running.advance(out.next_token)
            except ReplayMismatch as exc:
                return TokenEvent(finish_reason=FinishReason.ERROR, detail=str(exc))
        if rid in result.lost and self._held is not None:
            running.ledger.cache_lost()
            return None
        why = result.rejected.get(rid) or f"rank {running.rank} returned no output for it"
        return TokenEvent(finish_reason=FinishReason.ERROR, detail=why)

    def _take_running(self) -> list[_Running]:
        taken, self._running = self._running, []
        return taken

    def _take_all(self) -> list[_Running]:
        with self._cond:
            taken = [*self._running, *self._waiting]
            self._running, self._waiting = [], collections.deque()
        return taken

    def _finish(self, requests: Sequence[_Running], reason: FinishReason, detail: str) -> None:
        for running in requests:
            self._release(running)
            self._notify(running, TokenEvent(finish_reason=reason, detail=detail))

    def _release(self, running: _Running) -> None:
        if running.rank is not None:
            self._cluster.release(running.rank, [running.request_id])

    def _notify(self, running: _Running, event: TokenEvent) -> None:
        try:
            running.listener(event)
        except Exception:
            # A broken listener (its client gone) must not stop the others being served.
            logger.exception("listener of %s failed; cancelling it", running.request_id)
            running.cancelled = True


def _least_loaded(load: collections.Counter[int]) -> int:
    """The rank with the fewest requests (lowest id on ties), charged one more."""
    rank = min(load, key=lambda r: (load[r], r))
    load[rank] += 1
    return rank
